"""SamplingParams: vLLM's names and meanings, checked at construction with messages that name the field."""
from __future__ import annotations

import dataclasses
import math

from jaxpage.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20  # top log-probabilities the step returns per token (also bounds beam width: 2 x width)
# Bounds that keep the float32 sampler and the beam score finite: logits / temperature and logits /
# repetition_penalty stay far below float32's max (3.4e38) for logits of any model, a nucleus of top_p holds at
# least one token (a denormal top_p flushes to 0 on the device), and len ** length_penalty stays finite and non-zero
# in float64 for any length up to 10**6.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 100.0
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 1e-2
MAX_ABS_LENGTH_PENALTY = 10.0
MAX_STOP_TOKEN_IDS = 64  # all of them are banned under min_tokens (sampler.MAX_BANNED)
MAX_LOGIT_BIAS = 128  # token ids one request may bias: the width of the step's per-row bias list
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range of a bias


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # samples (or beams) generated, n best returned; defaults to n
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top log-probabilities returned per generated token
    # the top N log-probabilities and the prompt token's own at every prompt position (vLLM's); such a request
    # reads nothing from the prefix cache, as in vLLM, so that every position is computed
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    skip_special_tokens: bool = True
    # "cumulative": every step, the whole output so far; "delta": every step, what is new since the last
    # output; "final_only": one output when finished
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is taken too

    def __post_init__(self):
        self._normalize()
        self._check_counts()
        self._check_sampling()
        self._check_lengths_and_stops()
        self._check_logit_bias()
        self._check_outputs()
        if self.use_beam_search:
            self._check_beam_search()

    def _normalize(self):
        """vLLM's spellings to one form: -1 top_k, a lone stop string, None lists, a dict of structured outputs."""
        if self.top_k == -1:
            self.top_k = 0
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.best_of = self.n if self.best_of is None else self.best_of
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
               "must be a dict of token id -> bias")
        self.logit_bias = dict(self.logit_bias or {})
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")

    def _check_counts(self):
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(isinstance(self.best_of, int) and self.best_of >= self.n, "best_of", self.best_of,
               f"must be an integer >= n={self.n}")

    def _check_sampling(self):
        for name in _FLOATS:
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                   value, "must be a finite number")
        _check(self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE, "temperature",
               self.temperature, f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "must be an integer >= 0 (0 or -1 disables it)")
        _check(MIN_TOP_P <= self.top_p <= 1, "top_p", self.top_p, f"must be in [{MIN_TOP_P}, 1]")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**32), "seed", self.seed,
               "must be an integer in [0, 2**32)")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2, "repetition_penalty",
               self.repetition_penalty, f"must be in [{MIN_REPETITION_PENALTY}, 2]")
        _check(abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY, "length_penalty", self.length_penalty,
               f"must be in [-{MAX_ABS_LENGTH_PENALTY}, {MAX_ABS_LENGTH_PENALTY}]")

    def _check_lengths_and_stops(self):
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"must not exceed max_tokens={self.max_tokens}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"<{len(self.stop_token_ids)} ids>",
               f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")

    def _check_logit_bias(self):
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(self.logit_bias)} ids>",
               f"must hold at most {MAX_LOGIT_BIAS} token ids")
        for token, bias in self.logit_bias.items():
            _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias", token,
                   "keys must be token ids (integers >= 0)")
            _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
                   and abs(bias) <= MAX_ABS_LOGIT_BIAS, "logit_bias", {token: bias},
                   f"values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")

    def _check_outputs(self):
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(self.output_kind in ("cumulative", "delta", "final_only"), "output_kind", self.output_kind,
               "must be 'cumulative', 'delta' or 'final_only'")
        _check(self.output_kind != "delta" or (self.best_of == self.n and not self.use_beam_search),
               "output_kind", self.output_kind, "cannot be 'delta' with beam search or best_of > n")

    def _check_beam_search(self):
        _check(self.temperature == 0 or self.temperature == 1.0, "temperature", self.temperature,
               "must be 0 with use_beam_search (beam search is deterministic)")
        _check(2 * self.best_of <= MAX_LOGPROBS, "best_of", self.best_of,
               f"must be at most {MAX_LOGPROBS // 2} with use_beam_search")
        _check(not self.has_penalties, "use_beam_search", True, "cannot be combined with penalties")
        _check(not self.logit_bias, "use_beam_search", True, "cannot be combined with logit_bias")
        self.temperature = 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def beam_width(self) -> int:
        return self.best_of


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "length_penalty")


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}={value!r} {rule}")
