"""OpenAI's Responses API (POST /v1/responses), the subset jaxpage serves, as pydantic models: the request (input as
text or items, instructions, function tools, text.format) and the response with its output items.

Requests are validated here, each error naming its field; unknown fields are ignored as by vLLM. Field names
and defaults are OpenAI's (serving/responses_api.py turns a request into the chat request it means).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from serving.openai_protocol import FunctionDefinition


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]  # a user's or system's text, or an assistant's earlier output
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText]  # a string is one input_text part

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:  # one shape, so that an error names the bad part's field
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value

    def text(self) -> str:
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """An earlier call of the model's, sent back with its result (a function_call_output item)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningInputItem(BaseModel):
    """The model's earlier reasoning sent back; chat templates leave earlier thinking out, so it is dropped."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningInputItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape: the definition's fields beside its type (not under "function")."""
    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: "text", "json_object", or "json_schema" with the schema beside its name (not nested)."""
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat = TextFormat()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    input: list[InputItem]  # a string is one user message
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True  # OpenAI's default; nothing is stored, so the response says store false (as vLLM's default)
    previous_response_id: str | None = None  # refused: nothing is stored
    background: bool = False  # refused
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    seed: int | None = Field(None, ge=0, lt=2**32)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    priority: int = 0

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value


# --- the response ------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCallOutput(BaseModel):
    """An output item: a call of one of the request's tools."""
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """With --reasoning-parser: the model's thinking, apart from the message."""
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted by jaxpage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = []
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text: dict = {"format": {"type": "text"}}
    store: bool = False
    previous_response_id: None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
