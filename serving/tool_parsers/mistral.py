"""Mistral tool calls (vLLM's ``mistral``), after the special token ``[TOOL_CALLS]``, in either of Mistral's
formats: before the v11 tokenizer one JSON array of call objects,

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

from v11 on, each call its own token, name and arguments:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}

([ARGS] may be missing before the arguments). The text before the first [TOOL_CALLS] is content."""
from __future__ import annotations

import re

from serving.tool_parsers.abstract import Parsed, ToolCall, ToolParser, content_until
from serving.tool_parsers.json_scan import Malformed, scan_call_array, skip_blanks, value_end

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        content, first = content_until(text, BOT, final)
        if first < 0:
            return Parsed(content, [])
        calls: list[ToolCall] = []
        try:
            i = skip_blanks(text, first + len(BOT))
            if text.startswith("[", i):
                calls, end = scan_call_array(text, i, ("arguments",))
                if end is None and final:
                    raise Malformed("the output ends inside the array of tool calls")
            else:
                self._v11_calls(text, first, calls, final)
        except Malformed:
            if final:
                return Parsed(text, [])
        return Parsed(content, calls)

    @staticmethod
    def _v11_calls(text: str, at: int, calls: list, final: bool) -> None:
        while at >= 0:
            i = skip_blanks(text, at + len(BOT))
            name = _NAME.match(text, i)
            if name is None or name.end() == len(text):
                if final or (name is None and i < len(text)):
                    raise Malformed(f"a tool name expected at {i}")
                return
            i = name.end()
            if text.startswith(ARGS, i):
                i += len(ARGS)
            elif ARGS.startswith(text[i:]):
                if final:
                    raise Malformed("the output ends before a tool call's arguments")
                return
            i = skip_blanks(text, i)
            if not text.startswith("{", i):
                if final or i < len(text):
                    raise Malformed(f"a tool call's arguments expected at {i}")
                return
            end = value_end(text, i)
            calls.append(ToolCall(name.group(), text[i:end]))
            if end is None:
                if final:
                    raise Malformed("the output ends inside a tool call's arguments")
                return
            i = skip_blanks(text, end)
            if i < len(text) and not text.startswith(BOT, i) and not BOT.startswith(text[i:]):
                raise Malformed(f"{BOT} expected at {i}")
            at = text.find(BOT, i)
