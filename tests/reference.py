"""Reference computations the tests compare against: transformers for the model, plain loops for the rest."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxpage.distributed.parallel import with_mesh
from jaxpage.models import TokenBatch, compute_logits, forward_hidden
from jaxpage.lora.worker_manager import lora_mapping

NEAR_TIE = 1e-3


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's logits [n, V], recomputing the whole sequence at every step (transformers'
    own KV cache is no faster for these sizes here, and recomputation leaves nothing cached to get wrong)."""
    ids, step_logits = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        step_logits.append(logits.numpy())
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):], np.stack(step_logits)


class GreedyRuns:
    """hf_greedy of one model, remembered per prompt for the test session: fewer new tokens than a prompt's
    longest run so far are that run's first ones, more continue it (greedy step n's token and logits depend only
    on the sequence before it, recomputed whole at every step)."""

    def __init__(self, model):
        self.model = model
        self._runs: dict[tuple[int, ...], tuple[list[int], np.ndarray]] = {}

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
        key = tuple(prompt_ids)
        tokens, logits = self._runs.get(key, ([], None))
        if len(tokens) < max_new_tokens:
            more, more_logits = hf_greedy(self.model, [*prompt_ids, *tokens], max_new_tokens - len(tokens))
            tokens, logits = tokens + more, more_logits if logits is None else np.concatenate([logits, more_logits])
            self._runs[key] = tokens, logits
        return tokens[:max_new_tokens], logits[:max_new_tokens]


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    return model(torch.tensor([token_ids])).logits[0].float().numpy()


def first_near_tie(step_logits: np.ndarray) -> int:
    """The first step whose two best reference logits lie within NEAR_TIE (len if none)."""
    top2 = np.sort(np.asarray(step_logits), axis=-1)[:, -2:]
    ties = np.flatnonzero(top2[:, 1] - top2[:, 0] < NEAR_TIE)
    return int(ties[0]) if ties.size else len(step_logits)


def assert_greedy_matches(ours: list[int], ref: list[int], ref_logits: list[np.ndarray], context: str = ""):
    """Tokens must be identical, except from a step where the reference itself was a near-tie on."""
    n = first_near_tie(ref_logits)
    assert ours[:n] == ref[:n], f"{context}: greedy tokens differ (near-tie free prefix {n})\nours={ours}\nref ={ref}"
    assert len(ours) == len(ref), f"{context}: {len(ours)} tokens, reference {len(ref)}"


def paged_logits(llm, token_ids: list[int], seed: int = 0, backend: str = "xla",
                 lora_slot: int | None = None) -> np.ndarray:
    """Teacher-forced logits of the engine's model for one sequence, through a shuffled block table; with the
    LoRA adapter in device slot ``lora_slot`` (an engine with LoRA; None: the base weights)."""
    cfg, params = llm.engine.config, llm.engine.runner.params
    bs, n = cfg.cache.block_size, len(token_ids)
    rng = np.random.default_rng(seed)
    num_blocks = -(-n // bs)
    table = rng.permutation(np.arange(1, cfg.cache.num_kv_blocks))[:num_blocks].astype(np.int32)
    pos = np.arange(n, dtype=np.int32)
    tables = np.zeros((1, cfg.max_blocks_per_seq), np.int32)
    tables[0, :num_blocks] = table
    batch = TokenBatch(np.asarray(token_ids, np.int32), pos, table[pos // bs] * bs + pos % bs,
                       np.zeros(n, np.int32), tables, np.zeros(1, np.int32),
                       None if lora_slot is None else lora_mapping(np.full(1, lora_slot, np.int32), np.zeros(n, np.int32),
                                                                   n, 1, cfg.step_model.max_loras,
                                                                   cfg.step_model.cpu_lora_kernel))
    pool = jnp.zeros_like(llm.engine.runner.kv_pool)

    def logits(params, pool, batch):
        hidden, _ = forward_hidden(cfg.step_model, params, pool, batch, backend)
        return compute_logits(cfg.step_model, params, hidden)
    # traced under the runner's tensor-parallel mesh, if any, as its step is
    return np.asarray(jax.jit(with_mesh(logits, llm.engine.runner.mesh))(params, pool, batch))


def assert_logits_close(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4, context: str = ""):
    """Agreement relative to the logits' scale: max |ours - ref| <= rtol * max |ref|."""
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= rtol * scale, f"{context}: max abs error {err:.3g} > {rtol} x {scale:.3g}"


def assert_logits_close_by_position(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-4, atol: float = 1e-6,
                                    context: str = ""):
    """Agreement position by position: max |ours - ref| <= rtol * max |ref| + atol in every row."""
    assert ours.shape == ref.shape and np.isfinite(ours).all(), f"{context}: shape {ours.shape}, or not finite"
    err = np.abs(ours - ref).max(axis=-1)
    bound = rtol * np.abs(ref).max(axis=-1) + atol
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, (f"{context}: teacher-forced logits differ at {bad.size}/{len(err)} positions "
                           f"{bad[:8].tolist()}: max|diff| {err[bad[:8]].tolist()} > bound {bound[bad[:8]].tolist()}")


def randomize_weights(model: torch.nn.Module, gen: torch.Generator, std: float = 0.15) -> None:
    """Large enough weights that logits are spread out; norms around 1; nonzero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: visited once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(std * noise)


def save_random_model(hf_config, path, seed: int, auto_class: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """A randomly initialised transformers model saved as a Hugging Face directory (config + safetensors), of
    transformers' ``auto_class`` (AutoModel: the base model; AutoModelForSequenceClassification: a classifier)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    randomize_weights(model, torch.Generator().manual_seed(seed))
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def copy_adapter(src, dst, **changes):
    """A copy in ``dst`` of the PEFT adapter in ``src`` with ``changes`` to its adapter_config.json."""
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    conf = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**conf, **changes}))
    return dst


def peft_adapter(base: torch.nn.Module, path, rank: int, alpha: int, targets: list[str], rslora: bool = False,
                 seed: int = 0) -> torch.nn.Module:
    """A PEFT LoRA adapter of random A and B (``init_lora_weights=False``: B is not zero) on a copy of ``base``,
    saved to ``path``; returns the PEFT model (eval mode)."""
    import copy

    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False, use_rslora=rslora)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    model.eval()
    model.save_pretrained(path)
    return model
