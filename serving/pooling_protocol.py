"""The pooling endpoints' bodies (OpenAI's POST /v1/embeddings, vLLM's POST /pooling, /score and /rerank), as
pydantic models, each error naming its field; unknown fields are ignored, as by vLLM."""
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


class ScoreRequest(BaseModel):
    """vLLM's /score: one text_1 against every text_2, or the i-th of each."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    priority: int = 0


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(BaseModel):
    """vLLM's /rerank (Jina's and Cohere's shape): the documents ordered by their relevance to the query."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(0, ge=0)  # 0: every document
    priority: int = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
