"""The pooling endpoints' bodies (OpenAI's POST /v1/embeddings, vLLM's POST /pooling), as pydantic models, each
error naming its field; unknown fields are ignored, as by vLLM."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# a string, strings (a batch), token ids, or lists of token ids (a batch)
PoolingInput = str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: the served model
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 vector's little-endian bytes
    dimensions: int | None = Field(None, ge=1)  # the first this many, normalized (Matryoshka)
    user: str | None = None
    # vLLM's extra fields
    normalize: bool | None = None  # None: the model's
    priority: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingRequest(BaseModel):
    """vLLM's /pooling: the pooler's output as it is (not normalized)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    priority: int = 0


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
