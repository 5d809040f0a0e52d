"""JAX's persistent compilation cache, kept beside the converted weights."""
from __future__ import annotations

from pathlib import Path

import jax


def enable_compilation_cache(cache_dir: Path) -> None:
    path = cache_dir / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
