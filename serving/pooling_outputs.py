"""The pooling endpoints' inputs as engine prompts, and their outputs as OpenAI's (embeddings) and vLLM's (pooling)
responses."""
from __future__ import annotations

import base64

import numpy as np

from jaxpage.outputs import PoolingRequestOutput
from serving import pooling_protocol as pp


def pooling_prompts(value) -> list[str | dict] | None:
    """The prompts of an input (one engine request each): a string or token ids is one, a list of either a batch;
    None for an empty input."""
    if value == [] or value == "":
        return None
    batch = value if isinstance(value, list) and isinstance(value[0], (str, list)) else [value]
    if any(len(p) == 0 for p in batch):
        return None
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in batch]


def encoded(vector, encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of its float32 little-endian bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return [float(x) for x in vector]


def _usage(outs: list[PoolingRequestOutput]) -> pp.PoolingUsage:
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return pp.PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def embedding_response(request_id: str, model: str, outs: list[PoolingRequestOutput],
                       encoding_format: str) -> pp.EmbeddingResponse:
    return pp.EmbeddingResponse(id=request_id, model=model, usage=_usage(outs), data=[
        pp.EmbeddingData(index=i, embedding=encoded(out.outputs.data, encoding_format)) for i, out in enumerate(outs)])


def pooling_response(request_id: str, model: str, outs: list[PoolingRequestOutput],
                     encoding_format: str) -> pp.PoolingResponse:
    return pp.PoolingResponse(id=request_id, model=model, usage=_usage(outs), data=[
        pp.PoolingData(index=i, data=encoded(out.outputs.data, encoding_format)) for i, out in enumerate(outs)])
