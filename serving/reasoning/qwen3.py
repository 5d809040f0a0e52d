"""Qwen3 (vLLM's ``qwen3``): reasoning in a ``<think>...</think>`` block, which the model opens itself (Qwen3
up to the 2507 templates) or the chat template opens at the end of the prompt (later templates, thinking on).
With ``enable_thinking: false`` those templates close an empty block in the prompt, and output that opens none
is all content, as vLLM's does (vLLM reads such output as reasoning when the prompt has no block at all; here a
model that never thinks, whatever its template, answers in content)."""
from __future__ import annotations

from serving.reasoning.abstract import END, START, ReasoningParser, split_think


class Qwen3ReasoningParser(ReasoningParser):
    def __init__(self, prompt: str):
        super().__init__(prompt)
        self.opened = prompt.rfind(START) > prompt.rfind(END)  # the prompt ends inside a think block

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        return split_think(text, final, self.opened)
