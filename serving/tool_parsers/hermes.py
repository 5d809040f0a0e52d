"""Hermes 2 Pro / Hermes 3 and Qwen2.5 tool calls (vLLM's ``hermes``): each call a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the text before the first tag is content. The last call's closing tag may be missing (the model stopped)."""
from __future__ import annotations

from serving.tool_parsers.abstract import Parsed, ToolParser, content_until
from serving.tool_parsers.json_scan import Malformed, scan_call, skip_blanks

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        content, first = content_until(text, START, final)
        if first < 0:
            return Parsed(content, [])
        calls = []
        try:
            self._calls(text, first, calls, final)
        except Malformed:
            if final:
                return Parsed(text, [])
        return Parsed(content, calls)

    @staticmethod
    def _calls(text: str, at: int, calls: list, final: bool) -> None:
        while at >= 0:
            i = skip_blanks(text, at + len(START))
            if i == len(text):
                break
            call, end = scan_call(text, i, ("arguments",))
            if call is not None:
                calls.append(call)
            if end is None:
                break
            i = skip_blanks(text, end)
            if text.startswith(END, i):
                i += len(END)
            elif not END.startswith(text[i:i + len(END)]):
                raise Malformed(f"{END} expected at {i}")
            at = text.find(START, i)
        else:
            return
        if final:
            raise Malformed("the output ends inside a tool call")
