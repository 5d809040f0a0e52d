"""The Responses API on the chat path: a ResponsesRequest is the chat request it means (``chat_request``: the
instructions a system message first, the input items as messages, function tools and ``tool_choice`` as the chat
API's, ``text.format`` as ``response_format``), so the prompt, the tools, the structured output and the parsers
are the chat endpoint's; ``ResponseRendering`` renders the engine's outputs as a Response with its output items
(reasoning, message, function calls), whole or as the Responses stream's events."""
from __future__ import annotations

import dataclasses
import json
import uuid

from jaxpage.outputs import CompletionOutput, RequestOutput
from serving import openai_protocol as oai
from serving import responses_protocol as rp
from serving.chat_options import FieldError
from serving.chat_output import MessageParser, MessageStream

# the chat request's fields as the Responses request names them (an error names the field the client sent)
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head = param.split(".")[0]
    return "input" if head == "messages" else _PARAMS.get(param, param)


def chat_request(body: rp.ResponsesRequest) -> oai.ChatCompletionRequest:
    """The chat request that a Responses request means; fields jaxpage cannot honour are FieldErrors."""
    if body.previous_response_id is not None:
        raise FieldError("previous_response_id", "previous_response_id: jaxpage stores no responses (store is "
                                                 "always false); send the whole conversation as input")
    if body.background:
        raise FieldError("background", "background: jaxpage answers in the foreground only")
    messages = [oai.ChatMessage(role="system", content=body.instructions)] if body.instructions is not None else []
    messages += input_messages(body.input)
    if not messages:
        raise FieldError("input", "input: an empty list")
    choice = body.tool_choice
    if isinstance(choice, rp.NamedFunctionChoice):
        choice = oai.NamedToolChoice(function=oai.NamedFunction(name=choice.name))
    tools = [oai.ChatTool(function=oai.FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in body.tools
             or []]
    return oai.ChatCompletionRequest(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls, response_format=response_format(body.text), seed=body.seed,
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty, priority=body.priority,
        user=body.user)


def input_messages(given: list) -> list[oai.ChatMessage]:
    """The input items as chat messages: a developer message is a system one; an earlier function_call joins the
    assistant message before it (one turn), its output is a tool message; earlier reasoning is dropped."""
    messages: list[oai.ChatMessage] = []
    for item in given:
        if isinstance(item, rp.MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(oai.ChatMessage(role=role, content=item.text()))
        elif isinstance(item, rp.FunctionCallItem):
            call = oai.ToolCall(id=item.call_id, function=oai.FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(oai.ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, rp.FunctionCallOutputItem):
            messages.append(oai.ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
    return messages


def response_format(text: rp.TextConfig | None) -> dict | None:
    """text.format as the chat API's response_format."""
    fmt = text.format if text is not None else rp.TextFormat()
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise FieldError("text.format.schema", "text.format.schema: a json_schema format needs the schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


@dataclasses.dataclass
class _Item:
    """One output item as it is streamed."""
    kind: str  # "reasoning", "message" or "function_call"
    id: str
    index: int  # its output_index
    text: str = ""  # the reasoning, the message's text or the call's arguments
    name: str = ""
    call_id: str = ""
    closed: bool = False

    def model(self, status: str) -> rp.OutputItem:
        if self.kind == "reasoning":
            return rp.ReasoningOutput(id=self.id, status=status,
                                      content=[rp.ReasoningText(text=self.text)] if status != "in_progress" else [])
        if self.kind == "message":
            return rp.OutputMessage(id=self.id, status=status,
                                    content=[rp.OutputText(text=self.text)] if status != "in_progress" else [])
        return rp.FunctionCallOutput(id=self.id, call_id=self.call_id, name=self.name, status=status,
                                     arguments=self.text if status != "in_progress" else "")


_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def _new_item(kind: str, index: int, name: str = "") -> _Item:
    call_id = f"call_{uuid.uuid4().hex[:24]}" if kind == "function_call" else ""
    return _Item(kind, f"{_PREFIX[kind]}_{uuid.uuid4().hex}", index, name=name, call_id=call_id)


class ResponseRendering:
    """One request's Response: whole (``final``) or as the stream's events (``start``, ``push`` for each
    output, ``done``; ``error`` for a failure), each numbered by sequence_number. parser: how the text is read
    into reasoning, message and calls (serving/chat_output.py; None: all message text)."""

    def __init__(self, request_id: str, model: str, body: rp.ResponsesRequest, parser: MessageParser | None):
        self.request_id, self.model, self.body, self.parser = request_id, model, body, parser
        self.response = rp.Response(id=request_id, status="in_progress", model=model, **_echoed(body))
        self.sequence = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # the stream's tool call index -> its item
        self.stream = MessageStream(parser) if parser is not None else None
        self.input_tokens = self.output_tokens = 0
        self.finish: str | None = None

    # --- whole -----------------------------------------------------------------------------------------
    def final(self, out: RequestOutput) -> rp.Response:
        [c] = out.outputs
        reasoning, content, calls = None, c.text, []
        if self.parser is not None:
            m = self.parser.parse(c.text, final=True)
            reasoning, content, calls = m.reasoning, m.content, m.calls
        items = []
        if reasoning:
            items.append(dataclasses.replace(_new_item("reasoning", len(items)), text=reasoning))
        if content or not (calls or reasoning):
            items.append(dataclasses.replace(_new_item("message", len(items)), text=content))
        for call in calls:
            items.append(dataclasses.replace(_new_item("function_call", len(items), call.name), text=call.arguments))
        self.input_tokens, self.output_tokens = len(out.prompt_token_ids), len(c.token_ids)
        self.finish = c.finish_reason
        return self._finished([item.model("completed") for item in items])

    def _finished(self, output: list[rp.OutputItem]) -> rp.Response:
        incomplete = self.finish == "length"
        return self.response.model_copy(update=dict(
            status="incomplete" if incomplete else "completed", output=output,
            incomplete_details=rp.IncompleteDetails() if incomplete else None,
            usage=rp.ResponseUsage(input_tokens=self.input_tokens, output_tokens=self.output_tokens,
                                   total_tokens=self.input_tokens + self.output_tokens)))

    # --- streamed --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(fields)}\n\n"

    def start(self) -> list[str]:
        response = self.response.model_dump()
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def push(self, out: RequestOutput) -> list[str]:
        """The events of one delta output."""
        [c] = out.outputs
        self.input_tokens = len(out.prompt_token_ids)
        self.output_tokens += len(c.token_ids)
        self.finish = c.finish_reason or self.finish
        delta = self._delta(c)
        events = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            events += self._call(call)
        return events

    def _delta(self, c: CompletionOutput) -> oai.Delta:
        if self.stream is None:
            return oai.Delta(content=c.text)
        return self.stream.push(c.text, final=c.finish_reason is not None)

    def _open(self, kind: str, name: str = "") -> tuple[_Item, list[str]]:
        events = self._close()
        item = _new_item(kind, len(self.items), name)
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=item.index,
                                  item=item.model("in_progress").model_dump()))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=_part(kind, "")))
        return item, events

    def _text(self, kind: str, text: str) -> list[str]:
        item, events = (self.items[-1], []) if self.items and self.items[-1].kind == kind else self._open(kind)
        item.text += text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(kind_event, item_id=item.id, output_index=item.index, content_index=0, delta=text,
                                  **extra))
        return events

    def _call(self, call: oai.DeltaToolCall) -> list[str]:
        events = []
        if call.index not in self.calls:
            self.calls[call.index], events = self._open("function_call", call.function.name or "")
        item = self.calls[call.index]
        if call.function.arguments:
            item.text += call.function.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=call.function.arguments))
        return events

    def _close(self) -> list[str]:
        """The events that end the last item, if one is open (an item ends when the next begins)."""
        if not self.items or self.items[-1].closed:
            return []
        item = self.items[-1]
        item.closed = True
        at = dict(item_id=item.id, output_index=item.index)
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **at, arguments=item.text)]
        else:
            reasoning = item.kind == "reasoning"
            done = "response.reasoning_text.done" if reasoning else "response.output_text.done"
            extra = {} if reasoning else {"logprobs": []}
            events = [self._event(done, **at, content_index=0, text=item.text, **extra),
                      self._event("response.content_part.done", **at, content_index=0,
                                  part=_part(item.kind, item.text))]
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=item.model("completed").model_dump()))
        return events

    def done(self) -> list[str]:
        """The last item's end and response.completed (an output with no item gets an empty message)."""
        events = [] if self.items else self._open("message")[1]
        events += self._close()
        response = self._finished([item.model("completed") for item in self.items])
        return [*events, self._event("response.completed", response=response.model_dump())]

    def error(self, message: str, param: str | None, code: str | None) -> str:
        """OpenAI's error event (the stream ends after it)."""
        return self._event("error", message=message, param=responses_param(param), code=code)


def _part(kind: str, text: str) -> dict:
    """A content part of a reasoning or message item."""
    return (rp.ReasoningText(text=text) if kind == "reasoning" else rp.OutputText(text=text)).model_dump()


def _echoed(body: rp.ResponsesRequest) -> dict:
    """The request's settings that a Response repeats."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return dict(instructions=body.instructions, max_output_tokens=body.max_output_tokens,
                temperature=body.temperature, top_p=body.top_p,
                tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
                tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
                parallel_tool_calls=body.parallel_tool_calls,
                text={"format": (body.text.format if body.text else rp.TextFormat()).model_dump(by_alias=True,
                                                                                                 exclude_none=True)},
                metadata=body.metadata, user=body.user)
