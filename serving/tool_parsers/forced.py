"""The outputs that ``tool_choice`` forces with a JSON schema (vLLM's): for ``"required"`` an array of calls,

    [{"name": "get_weather", "parameters": {"city": "Paris"}}]

(one or more, at most one without parallel tool calls), each call's parameters valid for its function's schema;
for a named function its arguments alone, valid for its schema. Their schemas, and parsers of what they force."""
from __future__ import annotations

from typing import Any

from serving.tool_parsers.abstract import Parsed, ToolCall, ToolParser
from serving.tool_parsers.json_scan import Malformed, scan_call_array, skip_blanks

NO_PARAMETERS = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or NO_PARAMETERS


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The array of calls; each function's "$defs" move to the top, where its "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    variants = []
    for function in functions:
        parameters = dict(parameters_schema(function))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools: two functions define $defs.{name} differently")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredCalls(ToolParser):
    """The output of ``tool_choice: "required"``: the array's complete calls, each once its object closes (so a
    stream never carries a call that the end of the output could leave incomplete). An array cut short (max_tokens)
    gives its complete calls, its unfinished last call dropped; all content where there is no complete call (or
    no array)."""

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_blanks(text, 0)
        if i == len(text):
            return Parsed(text if final else "", [])
        try:
            if text[i] != "[":
                raise Malformed("not an array of tool calls")
            calls, end = scan_call_array(text, i, ("parameters",), complete_only=True)
        except Malformed:
            return Parsed(text if final else "", [])
        if final and end is None and not calls:
            return Parsed(text, [])  # cut inside its first call
        return Parsed("", calls)


class NamedCall(ToolParser):
    """The output of a named tool_choice: the named function's arguments."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ToolCall(self.name, text)])
