"""SamplingParams: vLLM's names and meanings, checked at construction with messages that name the field."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        _check(isinstance(self.n, int) and self.n == 1, "n", self.n, "must be 1 (n > 1 is not supported yet)")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "must be an integer >= 0 (0 disables it)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32), "seed", self.seed,
               "must be an integer in [0, 2**32)")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"must not exceed max_tokens={self.max_tokens}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}={value!r} {rule}")
