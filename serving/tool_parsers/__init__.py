"""Tool-call parsers of the chat API, one module each, by vLLM's ``--tool-call-parser`` names; and the formats
that ``tool_choice: "required"`` and a named function force (forced.py)."""
from __future__ import annotations

from serving.tool_parsers.abstract import Parsed, ToolCall, ToolParser
from serving.tool_parsers.hermes import HermesToolParser
from serving.tool_parsers.llama3_json import Llama3JsonToolParser
from serving.tool_parsers.mistral import MistralToolParser
from serving.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                             "mistral": MistralToolParser, "pythonic": PythonicToolParser}

__all__ = ["TOOL_PARSERS", "Parsed", "ToolCall", "ToolParser"]
