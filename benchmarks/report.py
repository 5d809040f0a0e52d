"""What a benchmark does with its result besides its table: the picture, where matplotlib is installed."""
from __future__ import annotations

from typing import Callable


def save_plot(path, draw: Callable[[], None]) -> None:
    """Runs ``draw`` (which writes the PNG at ``path``) and says so; without matplotlib, says that instead."""
    try:
        draw()
    except ImportError:
        print("no plot: matplotlib is not installed")
        return
    print(f"wrote {path}")
