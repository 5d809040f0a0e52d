"""DeepSeek-R1 (vLLM's ``deepseek_r1``): the output reasons first, up to ``</think>``, then answers; its chat
template puts ``<think>`` in the prompt, so the model may not write it (when it does, it is dropped). Output
without ``</think>`` is all reasoning."""
from __future__ import annotations

from serving.reasoning.abstract import ReasoningParser, split_think


class DeepSeekR1ReasoningParser(ReasoningParser):
    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        return split_think(text, final, opened=True)
