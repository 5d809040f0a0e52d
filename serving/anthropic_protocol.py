"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), the subset jaxpage serves, as
pydantic models: the request (system, messages of text / tool_use / tool_result / thinking blocks, tools and
tool_choice, thinking, output_config.format) and the Message it gets back, its stream's events and Anthropic's
error body.

Requests are validated here, each error naming its field; unknown fields are ignored (the SDK's newer options:
cache_control, service_tier, ...). Field names and defaults are Anthropic's (temperature 1 when none is given, as
the newest SDK's create() sends none); vLLM's extra sampling fields are accepted beside them.
serving/anthropic_messages.py turns a request into the chat request it means.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An assistant's earlier call, sent back with its result."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(BaseModel):
    """Any other block (image, document, ...): refused by the conversion, naming the block (a text block inside a
    tool result is read from here too)."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolResultBlock(BaseModel):
    """A user's block: what a call (tool_use_id) gave."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[OtherBlock] | None = None  # text blocks; others are refused where they are read
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    """An assistant's earlier thinking; chat templates leave earlier thinking out, so it is dropped."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking", "redacted_thinking"]


def _block_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if kind in ("text", "tool_use", "tool_result") else "other"


ContentBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                         | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                         | Annotated[OtherBlock, Tag("other")], Discriminator(_block_type)]


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    """A client tool (type absent or "custom"); Anthropic's server tools (bash, web search, ...) are refused."""
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    """enabled / adaptive: the chat template's thinking on (a template that reads enable_thinking), disabled: off;
    budget_tokens is not enforced (the thinking counts toward max_tokens, as Anthropic's)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # effort
    format: OutputFormat | None = None


class Metadata(BaseModel):
    user_id: str | None = None


class AnthropicCountTokensRequest(BaseModel):
    """What a prompt is made of (count_tokens takes only this)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: the served model
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None  # None: auto with tools
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    metadata: Metadata | None = None
    # vLLM's extra sampling fields
    seed: int | None = Field(None, ge=0, lt=2**32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None


# --- the response ------------------------------------------------------------------------------------------
class ResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ResponseThinking(BaseModel):
    """With --reasoning-parser: the model's thinking (no signature: jaxpage signs nothing)."""
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ResponseBlock = ResponseText | ResponseToolUse | ResponseThinking
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class AnthropicMessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ResponseBlock] = []
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
