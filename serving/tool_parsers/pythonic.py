"""Pythonic tool calls (vLLM's ``pythonic``; Llama 3.2, ToolACE): the whole output is a Python list of calls
with keyword arguments of literal values,

    [get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]

each call's arguments become a JSON object. Output that does not begin with "[" is content. While streaming, a
call is sent once its closing parenthesis is there."""
from __future__ import annotations

import ast
import json

from serving.tool_parsers.abstract import Parsed, ToolCall, ToolParser
from serving.tool_parsers.json_scan import Malformed, skip_blanks

_CLOSING = {"(": ")", "[": "]", "{": "}"}


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_blanks(text, 0)
        if i == len(text):
            return Parsed(text if final else "", [])
        if text[i] != "[":
            return Parsed(text, [])
        try:
            if final:
                return Parsed("", [_call(node) for node in _calls_list(text[i:])])
            return Parsed("", [_call(_expression(segment)) for segment in _complete_calls(text, i + 1)])
        except Malformed:
            return Parsed(text, []) if final else Parsed("", [])


def _calls_list(text: str) -> list[ast.expr]:
    node = _expression(text.strip())
    if not isinstance(node, ast.List):
        raise Malformed("not a list of calls")
    return node.elts


def _expression(text: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise Malformed(str(e)) from None


def _call(node: ast.expr) -> ToolCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise Malformed("not a call of a function by name with keyword arguments")
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except ValueError as e:
        raise Malformed(str(e)) from None
    if None in arguments:
        raise Malformed("**kwargs in a tool call")
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def _complete_calls(text: str, start: int) -> list[str]:
    """The text of each call of the list (which opens before start) whose closing parenthesis is there."""
    calls, stack, quote, begin, i = [], [], None, start, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _CLOSING:
            stack.append(_CLOSING[ch])
        elif ch in ")]}":
            if not stack:
                break  # the list's own "]"
            if stack.pop() != ch:
                raise Malformed(f"unbalanced {ch!r} at {i}")
            if not stack and ch == ")":
                calls.append(text[begin:i + 1].strip())
        elif ch == "," and not stack:
            begin = i + 1
        i += 1
    return calls
