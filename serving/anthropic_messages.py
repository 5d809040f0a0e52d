"""Anthropic's Messages API on the chat path: an AnthropicMessagesRequest is the chat request it means
(``chat_request``: the system prompt a system message first, tool_result blocks tool messages, an assistant's
tool_use blocks its tool calls, the tools and tool_choice as the chat API's: ``any`` is ``required``, ``tool`` a
named function; thinking the template's enable_thinking; output_config.format a json_schema response_format), so the
prompt, the forced calls, the structured output and the parsers are the chat endpoint's. ``MessageRendering``
renders the engine's outputs as a Message with content blocks (thinking, text, tool_use), whole or as Anthropic's
stream events; ``error_body`` is Anthropic's error object."""
from __future__ import annotations

import json
import uuid

from pydantic_core import from_json

from jaxpage.outputs import CompletionOutput, RequestOutput
from serving import anthropic_protocol as ap
from serving import openai_protocol as oai
from serving.chat_options import FieldError
from serving.chat_output import Message, MessageParser, MessageStream

MESSAGES_PATH = "/v1/messages"
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
# the chat request's fields as the Messages request names them (an error names the field the client sent)
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format"}


def is_messages_path(path: str) -> bool:
    """Whether a path is the Messages API's (its errors are Anthropic's error object)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def messages_param(param: str | None) -> str | None:
    return None if param is None else _PARAMS.get(param, param)


def error_body(status: int, message: str) -> dict:
    return ap.AnthropicErrorResponse(error=ap.AnthropicErrorDetail(
        type=ERROR_TYPES.get(status, "api_error"), message=message)).model_dump()


def chat_request(body: ap.AnthropicCountTokensRequest) -> oai.ChatCompletionRequest:
    """The chat request that a Messages (or count_tokens) request means; what jaxpage cannot honour is a
    FieldError."""
    messages = _system(body.system)
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, i)
    tools = [_tool(tool, i) for i, tool in enumerate(body.tools or [])]
    choice = _tool_choice(body.tool_choice, tools)
    fmt = body.output_config.format if body.output_config is not None else None
    fields = dict(
        model=body.model, messages=messages, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=not (body.tool_choice and body.tool_choice.disable_parallel_tool_use),
        response_format=None if fmt is None else {"type": "json_schema",
                                                   "json_schema": {"name": "output", "schema": fmt.schema_}},
        chat_template_kwargs=None if body.thinking is None else {"enable_thinking": body.thinking.type != "disabled"})
    if isinstance(body, ap.AnthropicMessagesRequest):
        fields.update(
            max_completion_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, priority=body.priority,
            structured_outputs=body.structured_outputs, user=body.metadata.user_id if body.metadata else None)
    return oai.ChatCompletionRequest(**fields)


def _system(system: str | list[ap.TextBlock] | None) -> list[oai.ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(block.text for block in system)
    return [oai.ChatMessage(role="system", content=text)]


def _chat_messages(message: ap.AnthropicMessage, i: int) -> list[oai.ChatMessage]:
    """One Anthropic message as chat messages: a user's tool results are tool messages (before its text, as the
    API puts them first), an assistant's tool_use blocks its tool calls; earlier thinking is dropped."""
    if isinstance(message.content, str):
        return [oai.ChatMessage(role=message.role, content=message.content)]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, ap.TextBlock):
            texts.append(oai.TextPart(type="text", text=block.text))
        elif isinstance(block, ap.ToolUseBlock) and message.role == "assistant":
            calls.append(oai.ToolCall(id=block.id, function=oai.FunctionCall(name=block.name,
                                                                             arguments=json.dumps(block.input))))
        elif isinstance(block, ap.ToolResultBlock) and message.role == "user":
            results.append(oai.ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                           content=_result_text(block, where)))
        elif isinstance(block, (ap.ToolUseBlock, ap.ToolResultBlock)):
            raise FieldError(f"{where}.type", f"{where}.type: a {message.role} message cannot hold a {block.type} "
                                              "block")
        elif isinstance(block, ap.OtherBlock):
            raise FieldError(f"{where}.type", f"{where}.type: {block.type!r} blocks are not supported (jaxpage "
                                              "serves text: text, tool_use, tool_result and thinking blocks)")
    if message.role == "assistant":
        return [oai.ChatMessage(role="assistant", content=texts or None, tool_calls=calls or None)]
    return results + ([oai.ChatMessage(role="user", content=texts)] if texts or not results else [])


def _result_text(block: ap.ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    for k, part in enumerate(block.content):
        if part.type != "text" or part.text is None:
            raise FieldError(f"{where}.content.{k}.type", f"{where}.content.{k}.type: a tool result's {part.type!r} "
                                                          "blocks are not supported (text only)")
    return "".join(part.text for part in block.content)


def _tool(tool: ap.AnthropicTool, i: int) -> oai.ChatTool:
    if tool.type not in (None, "custom"):
        raise FieldError(f"tools.{i}.type", f"tools.{i}.type: {tool.type!r} is one of Anthropic's server tools, "
                                            "which jaxpage does not run; give a client tool (name, input_schema)")
    return oai.ChatTool(function=oai.FunctionDefinition(name=tool.name, description=tool.description,
                                                        parameters=tool.input_schema))


def _tool_choice(choice: ap.AnthropicToolChoice | None, tools: list[oai.ChatTool]):
    if choice is None:
        return None
    if not tools and choice.type != "none":
        raise FieldError("tool_choice", f"tool_choice {choice.type!r} needs tools")
    if choice.type == "tool":
        if not choice.name:
            raise FieldError("tool_choice.name", "tool_choice.name: a tool_choice of type 'tool' names the tool")
        return oai.NamedToolChoice(function=oai.NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict:
    """A call's arguments as its input object; a cut call's (max_tokens) as far as it goes, as the SDK reads a
    stream's partial JSON."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(c: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessageRendering:
    """One request's Message: whole (``final``) or as the stream's events (``push`` for each output, ``done``;
    ``error`` for a failure). parser: how the text is read into thinking, text and tool calls
    (serving/chat_output.py; None: all text)."""

    def __init__(self, request_id: str, model: str, parser: MessageParser | None):
        self.request_id, self.model, self.parser = request_id, model, parser
        self.stream = MessageStream(parser) if parser is not None else None
        self.blocks: list[dict] = []  # the stream's content blocks so far (the last one may be open)
        self.open = False
        self.calls: dict[int, int] = {}  # the stream's tool call index -> its block's index
        self.input_tokens = self.output_tokens = 0
        self.last: CompletionOutput | None = None

    # --- whole -----------------------------------------------------------------------------------------
    def final(self, out: RequestOutput) -> ap.AnthropicMessagesResponse:
        [c] = out.outputs
        m = self.parser.parse(c.text, final=True) if self.parser is not None else Message(None, c.text, [])
        content: list[ap.ResponseBlock] = []
        if m.reasoning:
            content.append(ap.ResponseThinking(thinking=m.reasoning))
        if m.content or not (m.calls or m.reasoning):
            content.append(ap.ResponseText(text=m.content))
        content += [ap.ResponseToolUse(id=tool_use_id(), name=call.name, input=tool_input(call.arguments))
                    for call in m.calls]
        reason, sequence = stop_reason(c, bool(m.calls))
        return ap.AnthropicMessagesResponse(id=self.request_id, model=self.model, content=content, stop_reason=reason,
                                            stop_sequence=sequence, usage=ap.AnthropicUsage(
                                                input_tokens=len(out.prompt_token_ids), output_tokens=len(c.token_ids)))

    # --- streamed --------------------------------------------------------------------------------------
    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def start(self, out: RequestOutput) -> list[str]:
        """message_start (with the prompt's token count, from the first output) and a ping."""
        self.input_tokens = len(out.prompt_token_ids)
        message = ap.AnthropicMessagesResponse(id=self.request_id, model=self.model, usage=ap.AnthropicUsage(
            input_tokens=self.input_tokens, output_tokens=0))
        return [self._event("message_start", message=message.model_dump()), self._event("ping")]

    def push(self, out: RequestOutput) -> list[str]:
        """The events of one delta output."""
        [c] = out.outputs
        self.output_tokens += len(c.token_ids)
        self.last = c
        delta = oai.Delta(content=c.text) if self.stream is None else self.stream.push(
            c.text, final=c.finish_reason is not None)
        events = []
        if delta.reasoning_content:
            events += self._text("thinking", delta.reasoning_content)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls or []:
            events += self._call(call)
        return events

    def _open(self, block: dict) -> list[str]:
        events = self._close()
        self.blocks.append(block)
        self.open = True
        return events + [self._event("content_block_start", index=len(self.blocks) - 1, content_block=block)]

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            events = self._open({"type": "text", "text": ""} if kind == "text" else
                                {"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta",
                                                                             "thinking": text}
        return events + [self._event("content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def _call(self, call: oai.DeltaToolCall) -> list[str]:
        events = []
        if call.index not in self.calls:
            events = self._open({"type": "tool_use", "id": tool_use_id(), "name": call.function.name or "",
                                 "input": {}})
            self.calls[call.index] = len(self.blocks) - 1
        index = self.calls[call.index]
        if call.function.arguments:
            events.append(self._event("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": call.function.arguments}))
        return events

    def _close(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        return [self._event("content_block_stop", index=len(self.blocks) - 1)]

    def done(self) -> list[str]:
        """The last block's end, message_delta (the stop reason, the output's token count) and message_stop (an
        output with no block gets an empty text block)."""
        events = [] if self.blocks else self._open({"type": "text", "text": ""})
        events += self._close()
        reason, sequence = stop_reason(self.last, bool(self.calls)) if self.last else ("end_turn", None)
        return events + [self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                     usage={"output_tokens": self.output_tokens}),
                         self._event("message_stop")]

    def error(self, status: int, message: str) -> str:
        """Anthropic's error event (the stream ends after it)."""
        return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n"
