"""JSON tool calls read as far as the text goes: a call object ({"name": ..., "arguments": {...}}) or an array of
them, its name once the name is whole and its arguments as the raw text of their value (a prefix while it is
being written), so a stream of them only grows. Whole values are read by the json module's decoder."""
from __future__ import annotations

import json

from serving.tool_parsers.abstract import ToolCall

_DECODER = json.JSONDecoder()
_BLANKS = " \t\r\n"


class Malformed(ValueError):
    """The text is not (the beginning of) what the format says."""


def skip_blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in _BLANKS:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value at start ends, or None while it is incomplete (or not JSON)."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return None


def scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The object at start (text[start] is "{"), field by field: key -> (value start, value end or None while
    incomplete), and the end of the object (None while incomplete)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = skip_blanks(text, start + 1)
    if text.startswith("}", i):
        return fields, i + 1
    while i < len(text):
        if text[i] != '"':
            raise Malformed(f"a key expected at {i}")
        key_end = value_end(text, i)
        if key_end is None:
            return fields, None
        key = json.loads(text[i:key_end])
        i = skip_blanks(text, key_end)
        if i == len(text):
            return fields, None
        if text[i] != ":":
            raise Malformed(f"':' expected at {i}")
        i = skip_blanks(text, i + 1)
        end = value_end(text, i) if i < len(text) else None
        fields[key] = (i, end)
        if end is None:
            return fields, None
        i = skip_blanks(text, end)
        if text.startswith("}", i):
            return fields, i + 1
        if i < len(text) and text[i] != ",":
            raise Malformed(f"',' or '}}' expected at {i}")
        i = skip_blanks(text, i + 1)
    return fields, None


def scan_call(text: str, start: int, argument_keys: tuple[str, ...]) -> tuple[ToolCall | None, int | None]:
    """The call object at start: the call (None until its name is whole) and where the object ends (None while
    incomplete). Its arguments are the first of argument_keys present ("{}" when the object has none)."""
    if not text.startswith("{", start):
        raise Malformed(f"'{{' expected at {start}")
    fields, end = scan_object(text, start)
    name = fields.get("name")
    if name is None or name[1] is None:
        if end is not None:
            raise Malformed("a tool call without a name")
        return None, None
    name = json.loads(text[name[0]:name[1]])
    if not isinstance(name, str):
        raise Malformed("a tool call's name is not a string")
    key = next((k for k in argument_keys if k in fields), None)
    if key is None:
        return ToolCall(name, "{}" if end is not None else ""), end
    value_start, value_stop = fields[key]
    return ToolCall(name, text[value_start:value_stop]), end


def scan_call_array(text: str, start: int, argument_keys: tuple[str, ...],
                    complete_only: bool = False) -> tuple[list[ToolCall], int | None]:
    """The array of call objects at start (text[start] is "["): its calls so far (with ``complete_only``, those whose
    object is closed) and its end (None while incomplete)."""
    calls: list[ToolCall] = []
    i = skip_blanks(text, start + 1)
    if text.startswith("]", i):
        return calls, i + 1
    while i < len(text):
        call, end = scan_call(text, i, argument_keys)
        if call is not None and (end is not None or not complete_only):
            calls.append(call)
        if end is None:
            return calls, None
        i = skip_blanks(text, end)
        if text.startswith("]", i):
            return calls, i + 1
        if i < len(text) and text[i] != ",":
            raise Malformed(f"',' or ']' expected at {i}")
        i = skip_blanks(text, i + 1)
    return calls, None
