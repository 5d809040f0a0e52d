"""Small helpers every layer uses (vLLM's vllm.utils)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size ``b`` that hold ``a`` items."""
    return -(-a // b)


class FieldError(ValueError):
    """Bad input, naming the field (``param``): a 400 from the server, a ValueError to LLM's callers."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
