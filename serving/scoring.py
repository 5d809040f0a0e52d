"""Pair scores for both front ends (HTTP's /score and /rerank, gRPC's Score): a cross-encoder's (a one-label
classifier: the sigmoid of its logit on the pair's encoding), else an embedding model's (the cosine of the two
texts' vectors, each text embedded once)."""
from __future__ import annotations

from typing import Awaitable, Callable

from jaxpage.entrypoints.score_utils import cosine, pair_prompt
from jaxpage.pooling_params import PoolingParams

# (prompts, params) -> each prompt's PoolingRequestOutput, in order (None: the caller went away)
RunPrompts = Callable[[list, PoolingParams], Awaitable[list | None]]


async def pair_scores(engine, pairs: list[tuple[str, str]], run: RunPrompts) -> tuple[list[float], int] | None:
    """Each pair's score and the prompt tokens computed (engine: the LLMEngine); ValueError without a tokenizer."""
    if engine.classifier is not None:
        outs = await run([pair_prompt(engine.tokenizer, a, b) for a, b in pairs], PoolingParams(task="score"))
        return None if outs is None else ([float(o.outputs.data[0]) for o in outs],
                                          sum(len(o.prompt_token_ids) for o in outs))
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    outs = await run(texts, PoolingParams())
    if outs is None:
        return None
    vectors = {text: out.outputs.data for text, out in zip(texts, outs)}
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(o.prompt_token_ids) for o in outs)
