"""Llama 3.1 / 3.2 / 4 JSON tool calls (vLLM's ``llama3_json``): the whole output is one or more JSON objects,
separated by ";", optionally after ``<|python_tag|>``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

("arguments" is taken for "parameters" too). Output that does not begin with "{" (or the tag) is content."""
from __future__ import annotations

from serving.tool_parsers.abstract import Parsed, ToolParser
from serving.tool_parsers.json_scan import Malformed, scan_call, skip_blanks

TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_blanks(text, 0)
        if text.startswith(TAG, i):
            i = skip_blanks(text, i + len(TAG))
        elif not final and TAG.startswith(text[i:]):
            return Parsed("", [])  # nothing yet, or the start of the tag
        if i < len(text) and text[i] != "{":
            return Parsed(text, [])
        calls = []
        try:
            self._calls(text, i, calls, final)
        except Malformed:
            if final:
                return Parsed(text, [])
        return Parsed("", calls)

    @staticmethod
    def _calls(text: str, i: int, calls: list, final: bool) -> None:
        while i < len(text):
            call, end = scan_call(text, i, KEYS)
            if call is not None:
                calls.append(call)
            if end is None:
                if final:
                    raise Malformed("the output ends inside a tool call")
                return
            i = skip_blanks(text, end)
            if text.startswith(";", i):
                i = skip_blanks(text, i + 1)
            elif i < len(text):
                raise Malformed(f"';' expected at {i}")
        if final and not calls:
            raise Malformed("no tool call")
