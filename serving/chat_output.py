"""A chat choice's text as an assistant message: the reasoning parser's split first, then the tool parser's on the
rest, whole (``MessageParser.parse``) or as OpenAI's stream deltas (``MessageStream``: each chunk sends what the
parse of the text so far adds to what was sent; a tool call its index, id, type and name first, then fragments
of its arguments)."""
from __future__ import annotations

import dataclasses
import uuid

from serving import openai_protocol as oai
from serving.reasoning import ReasoningParser
from serving.tool_parsers import ToolCall, ToolParser


@dataclasses.dataclass
class Message:
    reasoning: str | None
    content: str
    calls: list[ToolCall]


class MessageParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None):
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls

    def parse(self, text: str, final: bool) -> Message:
        reasoning, rest = (None, text) if self.reasoning is None else self.reasoning.split(text, final)
        if self.tools is None:
            return Message(reasoning, rest, [])
        parsed = self.tools.parse(rest, final)
        return Message(reasoning, parsed.content, parsed.calls[:self.max_calls])


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(calls: list[ToolCall]) -> list[oai.ToolCall] | None:
    return [oai.ToolCall(id=call_id(), function=oai.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls] or None


def assistant_message(m: Message) -> oai.AssistantMessage:
    """OpenAI's message: content null beside tool calls or reasoning when there is none."""
    content = m.content if m.content or not (m.calls or m.reasoning is not None) else None
    return oai.AssistantMessage(content=content, reasoning_content=m.reasoning, tool_calls=tool_calls(m.calls))


class MessageStream:
    """One choice's stream: its text so far, and what of its parse was sent."""

    def __init__(self, parser: MessageParser):
        self.parser = parser
        self.text = ""
        self.reasoning = self.content = ""
        self.arguments: list[str] = []  # per call sent: its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.arguments)

    def push(self, text: str, final: bool) -> oai.Delta:
        """The delta that the choice's next text (and, when final, its end) adds."""
        self.text += text
        m = self.parser.parse(self.text, final)
        reasoning, self.reasoning = _added(m.reasoning or "", self.reasoning)
        content, self.content = _added(m.content, self.content)
        calls = [d for i, call in enumerate(m.calls) if (d := self._call_delta(i, call)) is not None]
        return oai.Delta(reasoning_content=reasoning or None, content=content or None, tool_calls=calls or None)

    def _call_delta(self, i: int, call: ToolCall) -> oai.DeltaToolCall | None:
        if i == len(self.arguments):
            self.arguments.append(call.arguments)
            return oai.DeltaToolCall(index=i, id=call_id(), type="function",
                                     function=oai.DeltaFunctionCall(name=call.name, arguments=call.arguments))
        added, self.arguments[i] = _added(call.arguments, self.arguments[i])
        return oai.DeltaToolCall(index=i, function=oai.DeltaFunctionCall(arguments=added)) if added else None


def _added(now: str, sent: str) -> tuple[str, str]:
    """What now adds to what was sent, and what is then sent (nothing, when now does not extend it: a stream
    cannot take back what it sent)."""
    return (now[len(sent):], now) if now.startswith(sent) else ("", sent)
