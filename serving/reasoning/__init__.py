"""Reasoning parsers of the chat API (``--reasoning-parser``, vLLM's names): ``reasoning_content`` apart from
``content``."""
from __future__ import annotations

from serving.reasoning.abstract import ReasoningParser
from serving.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from serving.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"deepseek_r1": DeepSeekR1ReasoningParser,
                                                       "qwen3": Qwen3ReasoningParser}

__all__ = ["REASONING_PARSERS", "ReasoningParser"]
