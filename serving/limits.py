"""The size limit on prompts, shared by the gRPC and HTTP front ends (--max-prompt-bytes)."""
from __future__ import annotations

from typing import Iterable


def check_prompt_bytes(texts: Iterable[str], max_bytes: int | None, field: str) -> None:
    """ValueError naming field when the texts (a prompt, or chat messages' roles and contents) hold more than
    max_bytes of UTF-8: checked before anything tokenizes or renders them."""
    if max_bytes is None:
        return
    size = sum(len(text.encode()) for text in texts)
    if size > max_bytes:
        raise ValueError(f"{field} is {size} bytes; the limit is {max_bytes} (--max-prompt-bytes)")
