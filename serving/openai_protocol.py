"""The OpenAI HTTP API's request and response bodies (the subset jaxpage serves), as pydantic models.

Requests are validated here (types and ranges, each error naming its field); the engine's SamplingParams checks
what spans fields (min_tokens <= max_tokens). Field names and defaults are OpenAI's; vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, priority, ...) are accepted as vLLM does.
Unknown fields are ignored, as by vLLM; known fields jaxpage cannot honour are rejected (see ``unsupported``).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpage.sampling_params import MAX_LOGPROBS

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields that completions and chat completions share."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = 0  # lower is scheduled first (vLLM's convention)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM: each choice carries its token ids, the response the prompt's
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: the top N at each prompt position
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    # OpenAI fields jaxpage does not implement: a request that sets one gets a 400 naming it
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # "text", "json_object", "json_schema" (serving/structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, json_object, regex, choice or grammar

    def unsupported(self) -> str | None:
        """The first field set that jaxpage cannot honour, or None."""
        for name in ("suffix",):
            if getattr(self, name):
                return name
        return None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]  # a list of strings or of id lists: a batch
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str | None = None  # OpenAI's clients always send the id they got; the template decides what it needs
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's, earlier in the chat
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the chat template's own variables


# --- responses -------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Head(BaseModel):
    """What every response and chunk has (a stream's chunks carry usage only in the last, if asked)."""
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class Choice(BaseModel):
    """What every choice has: its index, why it finished, and vLLM's stop reason and (if asked) token ids."""
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class Logprob(BaseModel):
    """vLLM's Logprob, in its prompt_logprobs field."""
    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's (asked with prompt_logprobs)
    prompt_token_ids: list[int] | None = None  # a batch's (return_token_ids): the choice's prompt's, as vLLM's


class CompletionResponse(Head):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    prompt_token_ids: list[int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None beside tool calls, or reasoning without an answer
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(Head):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # vLLM's (asked with prompt_logprobs)


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # a fragment


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # in a call's first delta, with its type and name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Choice):
    delta: Delta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Head):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxpage"
    root: str | None = None  # vLLM's: the model's path (an adapter's directory)
    parent: str | None = None  # vLLM's: an adapter's base model; None for the base model
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None  # jaxpage's own: "auto", "int8" or "fp8"
    # the weights' (jaxpage's own, as GetModelInfo): quantization None, "int8" or the checkpoint's quant_method;
    # quantized_weights "int8", "fp8", "int4"; a scale per quantization_group_size inputs (None: per channel)
    quantization: str | None = None
    quantized_weights: str | None = None
    quantization_group_size: int | None = None
    quantization_zero_point: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter (its lora_int_id is accepted and not needed: the name says which)."""
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template (the server's, else the model's)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    add_special_tokens: bool | None = None  # vLLM's defaults: on for a prompt, off for messages (the template's)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
