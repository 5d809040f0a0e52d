"""LLM: vLLM's offline interface over the engine."""
from __future__ import annotations

import dataclasses
import itertools

from tqdm.auto import tqdm

from jaxpage.engine.llm_engine import EngineArgs, LLMEngine
from jaxpage.entrypoints.chat_utils import render_chat
from jaxpage.lora.request import LoRARequest
from jaxpage.entrypoints.score_utils import cosine, pair_prompt, score_pairs
from jaxpage.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxpage.pooling_params import PoolingParams
from jaxpage.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **options):
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt (a string or {"prompt_token_ids": [...]}); results in input order.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        params = [dataclasses.replace(p, output_kind="final_only") for p in params]
        return self._run(prompts, params, "sampling_params", lora_request, use_tqdm, "generating")

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
               use_tqdm: bool = False, lora_request: LoRARequest | list[LoRARequest | None] | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's: each prompt's pooler output, on a pooling model (runner "pooling"); results in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = pooling_params or PoolingParams(task="encode")
        params = params if isinstance(params, list) else [params] * len(prompts)
        return self._run(prompts, params, "pooling_params", lora_request, use_tqdm, "pooling")

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = False, lora_request: LoRARequest | list[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (``outputs.embedding``), on a pooling model (runner "pooling")."""
        params = pooling_params or PoolingParams()
        for p in params if isinstance(params, list) else [params]:
            if p.task != "embed":
                raise ValueError(f"PoolingParams.task={p.task!r}: LLM.embed takes task 'embed'")
        return [EmbeddingRequestOutput.from_base(out) for out in self.encode(prompts, params, use_tqdm, lora_request)]

    def classify(self, prompts, use_tqdm: bool = False,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (``outputs.probs``), on a classification model (a
        *ForSequenceClassification checkpoint)."""
        outs = self.encode(prompts, PoolingParams(task="classify"), use_tqdm, lora_request)
        return [ClassificationRequestOutput.from_base(out) for out in outs]

    def score(self, data_1: str | list[str], data_2: str | list[str], use_tqdm: bool = False,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's: the score of each pair (one data_1 against every data_2, or the i-th of each): a cross-encoder's
        (a classifier of one label) sigmoid of its logit on the pair, or an embedding model's cosine of the two
        texts' embeddings."""
        pairs = score_pairs(data_1, data_2)
        if self.engine.classifier is not None:
            prompts = [pair_prompt(self.get_tokenizer(), a, b) for a, b in pairs]
            outs = self.encode(prompts, PoolingParams(task="score"), use_tqdm, lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm, lora_request=lora_request)))
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(cosine(embedded[a].outputs.embedding,
                                                                       embedded[b].outputs.embedding)),
                                     embedded[a].prompt_token_ids + embedded[b].prompt_token_ids)
                for i, (a, b) in enumerate(pairs)]

    def _run(self, prompts: list, params: list, params_field: str, lora_request, use_tqdm: bool, desc: str) -> list:
        """Runs every prompt with its params (and adapter: one for all, or one per prompt); the finished outputs
        in input order."""
        if len(params) != len(prompts):
            raise ValueError(f"{params_field} has {len(params)} entries for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, lora in zip(ids, prompts, params, loras):
                self.engine.add_request(request_id, prompt, p, lora_request=lora)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict = {}
        with tqdm(total=len(ids), desc=desc, disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update()
        return [finished[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages: role, content, and transformers' tool_calls
        and tool_call_id) or several, each made a prompt by the chat template (``chat_template``, else the
        tokenizer's; ``tools`` and ``chat_template_kwargs`` where the template reads them), then ``generate``."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.get_tokenizer(), list(c), chat_template, tools,
                               template_kwargs=chat_template_kwargs, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Ends the engine gracefully (LLMEngine.close: the prefix cache written to the disk tier, if any)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
