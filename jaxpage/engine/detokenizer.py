"""Incremental detokenization that never emits a broken UTF-8 character, with stop strings."""
from __future__ import annotations

_PROMPT_CONTEXT = 5  # prompt tokens decoded alongside the output so word boundaries come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._searched = 0  # text before this offset holds no stop string
        self._hold = max((len(s) for s in stop or []), default=1) - 1  # chars that may begin a stop string
        self._end: int | None = None  # where the text ends once a stop string is found
        self.num_tokens = 0  # output tokens added

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (possibly empty)."""
        self.num_tokens += 1
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def find_stop(self, stops: list[str], include: bool) -> str | None:
        """The first stop string in the new text, if any; the output text then ends at (or after) it."""
        for stop in stops:
            index = self.text.find(stop, max(0, self._searched - len(stop) + 1))
            if index >= 0:
                self._end = index + len(stop) if include else index
                return stop
        self._searched = len(self.text)
        return None

    def output_text(self, final: bool) -> str:
        """The text so far; while running, the tail that could still start a stop string is held back."""
        if self._end is not None:
            return self.text[:self._end]
        return self.text if final or not self._hold else self.text[:max(0, len(self.text) - self._hold)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
