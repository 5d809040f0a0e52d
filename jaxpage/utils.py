"""Small helpers every layer uses (vLLM's vllm.utils)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size ``b`` that hold ``a`` items."""
    return -(-a // b)
