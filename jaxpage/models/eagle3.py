"""EAGLE-3 draft heads (Li et al., 2025; vLLM's ``eagle3`` method): one decoder layer over the target's auxiliary
hidden states, read from the speculators library's layout or the original EAGLE-3 release's.

At position p the head takes the embedding of token p + 1 and a hidden state of position p: for a position the
target computed, the target's auxiliary hidden states (the residual stream entering the layers
``aux_layer_ids``, side by side) projected by ``fc``; for a position only drafts reached, the head's own output
at p - 1 (before its final norm, or after it with ``norm_output``). Its first layer normalizes the embedding and
the hidden state apart, attends over both side by side ([2 D] into q/k/v), and keeps the hidden state as the
residual. It predicts token p + 2 over a draft vocabulary whose ids map to the target's by ``d2t`` (offsets)."""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpage.config import ModelConfig, require
from jaxpage.models.attention import Attention, StepContext, layer_constants
from jaxpage.models.batch import TokenBatch
from jaxpage.models.layers import MLP, Embedding, Linear, MergedColumnParallelLinear, QKVParallelLinear, RMSNorm


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A head's shapes and options (the speculators library's names)."""

    model: ModelConfig  # its decoder layer's shapes: one layer, the target's vocabulary and positions
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # the target layers whose input (the residual stream) it reads
    target_hidden_size: int
    norm_before_residual: bool = False  # the residual is the normed hidden state
    norm_before_fc: bool = False  # one RMSNorm over the auxiliary hidden states before fc
    norm_output: bool = False  # the next step takes the final-normed output (EAGLE 3.1)

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size


FIELD = "speculative_config.model"


def read_head_config(path: Path, target: ModelConfig) -> Eagle3Config:
    """The head's config.json: speculators' (``speculators_model_type`` "eagle3", the layer under
    ``transformer_layer_config``) or the original release's (a Llama config of one layer with
    ``draft_vocab_size``). A head jaxpage cannot run is a ValueError naming the field."""
    from transformers import AutoConfig

    from jaxpage.models import llama

    raw = json.loads((path / "config.json").read_text())
    speculators = "speculators_model_type" in raw
    if speculators:
        require(raw["speculators_model_type"] == "eagle3", f"{FIELD} speculators_model_type",
                raw["speculators_model_type"], "must be 'eagle3'")
        require(not raw.get("fc_norm"), f"{FIELD} fc_norm", raw.get("fc_norm"), "is not built (per-layer norms)")
    layer = dict(raw["transformer_layer_config"]) if speculators else dict(raw)
    model_type = layer.pop("model_type", "llama")
    require(model_type == "llama", f"{FIELD} model_type", model_type, "must be 'llama' (Llama-family heads only)")
    require(layer.get("num_hidden_layers", 1) == 1, f"{FIELD} num_hidden_layers", layer.get("num_hidden_layers"),
            "must be 1 (one decoder layer)")
    hf = AutoConfig.for_model("llama", **{k: v for k, v in layer.items() if k != "architectures"})
    model = dataclasses.replace(llama.read_config(hf), num_layers=1, vocab_size=target.vocab_size,
                                max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False)
    target_hidden = raw.get("target_hidden_size") or model.hidden_size
    n = target.num_layers
    ids = tuple(raw.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3))  # vLLM's default
    # id n (the last layer's output) is not taken: whether it is read before or after the final norm differs
    # between transformers' hidden states (after) and a residual stream (before), so a head trained on it is refused
    require(len(set(ids)) == len(ids) and all(0 <= i < n for i in ids), f"{FIELD} eagle_aux_hidden_state_layer_ids",
            list(ids), f"must be distinct layer ids in [0, {n - 1}] of the target's {n} layers")
    require(target_hidden == target.hidden_size, f"{FIELD} target_hidden_size", target_hidden,
            f"must be the target's hidden size {target.hidden_size}")
    return Eagle3Config(model, int(raw["draft_vocab_size"]), ids, target_hidden,
                        bool(raw.get("norm_before_residual", False)), bool(raw.get("norm_before_fc", False)),
                        bool(raw.get("norm_output", False)))


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        d = cfg.hidden_size
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)  # the embedding's (transformers' input_layernorm)
        self.attn = Attention(cfg, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias)
        self.attn.qkv = QKVParallelLinear(2 * d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.qkv_bias)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_act)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embeds, hidden, pool, layer, ctx):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        h, pool = self.attn(jnp.concatenate([self.attn_norm(embeds), normed], axis=-1), pool, layer, ctx)
        x, normed = self.mlp_norm.add_and_norm(residual, h)
        return x + self.mlp(normed), pool


class Eagle3Head(nnx.Module):
    def __init__(self, head: Eagle3Config):
        cfg = head.model
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.input_norm = RMSNorm(head.aux_width, cfg.rms_norm_eps) if head.norm_before_fc else None
        self.fc = Linear((head.aux_width,), (cfg.hidden_size,), (None, None))
        self.layer = Eagle3Layer(cfg, head.norm_before_residual)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear((cfg.hidden_size,), (head.draft_vocab_size,), (None, None))
        self.head = head

    def __call__(self, pool, batch: TokenBatch, hidden: jax.Array, from_target: bool, backend: str,
                 block_size: int):
        """(final-normed output [T, D], the next step's hidden input [T, D], pool). hidden: the target's auxiliary
        hidden states [T, A * D] (``from_target``) or the head's own outputs [T, D]."""
        cfg = self.head.model
        if from_target:
            hidden = self.fc(hidden if self.input_norm is None else self.input_norm(hidden))
        ctx = StepContext.make(cfg, batch, backend, block_size)
        consts = jax.tree.map(lambda a: jnp.asarray(a[0]), layer_constants(cfg))
        x, pool = self.layer(self.embed(batch.token_ids), hidden.astype(self.fc.kernel.dtype), pool, consts, ctx)
        out = self.final_norm(x)
        return out, (out if self.head.norm_output else x), pool


@functools.lru_cache(maxsize=8)
def head_graph(head: Eagle3Config):
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.graphdef(nnx.eval_shape(lambda: Eagle3Head(head)))


def abstract_head_params(head: Eagle3Config, dtype) -> dict:
    """The head's weights as Eagle3Runner holds them, shapes only (for compiling ahead of time)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Eagle3Head(head))))
    return {"head": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), state),
            "d2t": jax.ShapeDtypeStruct((head.draft_vocab_size,), jnp.int32)}


def target_logits(head: Eagle3Config, draft_logits: jax.Array, d2t: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [S, Vd] as the target vocabulary's [S, V] float32: -inf off the draft
    vocabulary (a token the head cannot propose has probability 0)."""
    out = jnp.full((draft_logits.shape[0], head.model.vocab_size), -jnp.inf, jnp.float32)
    return out.at[:, jnp.arange(head.draft_vocab_size) + d2t].set(draft_logits.astype(jnp.float32))


def head_params(head: Eagle3Config, state: dict[str, np.ndarray], target_embedding: np.ndarray) -> dict:
    """The head's weights in Eagle3Head's layout (numpy), from its checkpoint's tensors (transformers' names;
    the original release's ``midlayer.`` is speculators' ``layers.0.``), and ``d2t``. Without an
    ``embed_tokens.weight`` of its own the head shares the target's embedding (vLLM does the same)."""
    state = {k.replace("midlayer.", "layers.0.").removeprefix("model."): v for k, v in state.items()}
    cfg = head.model
    d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def take(name: str, shape: tuple | None = None) -> np.ndarray:
        require(name in state, FIELD, name, "is missing from the head's checkpoint")
        a = state[name]
        require(shape is None or a.shape == shape, f"{FIELD} {name}", list(a.shape),
                f"must be of shape {list(shape or ())}")
        return a

    attn = {"qkv": {"kernel": QKVParallelLinear.fuse(
                *(take(f"layers.0.self_attn.{p}_proj.weight", (n * hd, 2 * d)).T.reshape(2 * d, n, hd)
                  for p, n in (("q", h), ("k", kvh), ("v", kvh))))},
            "o": {"kernel": take("layers.0.self_attn.o_proj.weight", (d, h * hd)).T.reshape(h, hd, d)}}
    mlp = {"gate_up": {"kernel": MergedColumnParallelLinear.fuse(take("layers.0.mlp.gate_proj.weight").T,
                                                               take("layers.0.mlp.up_proj.weight").T)},
           "down": {"kernel": take("layers.0.mlp.down_proj.weight").T}}
    embed = state.get("embed_tokens.weight", target_embedding)
    require(embed.shape == (cfg.vocab_size, d), f"{FIELD} embed_tokens.weight", list(embed.shape),
            f"must be of shape {[cfg.vocab_size, d]} (the target's vocabulary by the head's hidden size)")
    params = {
        "embed": {"embedding": embed},
        "fc": {"kernel": take("fc.weight", (d, head.aux_width)).T},
        "layer": {"hidden_norm": {"weight": take("layers.0.hidden_norm.weight")},
                  "attn_norm": {"weight": take("layers.0.input_layernorm.weight")},
                  "attn": attn, "mlp_norm": {"weight": take("layers.0.post_attention_layernorm.weight")}, "mlp": mlp},
        "final_norm": {"weight": take("norm.weight")},
        "lm_head": {"kernel": take("lm_head.weight", (head.draft_vocab_size, d)).T},
    }
    if head.norm_before_fc:
        params["input_norm"] = {"weight": take("input_norm.weight")}
    d2t = np.asarray(state.get("d2t", np.zeros(head.draft_vocab_size)), np.int64)
    ids = np.arange(head.draft_vocab_size) + d2t
    require(d2t.shape == (head.draft_vocab_size,) and ids.min() >= 0 and ids.max() < cfg.vocab_size
            and len(np.unique(ids)) == len(ids), f"{FIELD} d2t", list(d2t.shape),
            f"must map the {head.draft_vocab_size} draft ids to distinct target ids below {cfg.vocab_size}")
    return {"head": params, "d2t": d2t.astype(np.int32)}


def load_head(path: str, target: ModelConfig, target_embedding: np.ndarray) -> tuple[Eagle3Config, dict]:
    """An EAGLE-3 head's config and weights (``head_params``) from its directory; a head that cannot be read or
    run is a ValueError naming speculative_config.model."""
    from jaxpage.models.loader import read_safetensors

    where = Path(path)
    require(where.is_dir() and (where / "config.json").is_file(), FIELD, path,
            "must be an EAGLE-3 head's directory (config.json and *.safetensors)")
    try:
        head = read_head_config(where, target)
        return head, head_params(head, read_safetensors(where), target_embedding)
    except (OSError, KeyError, TypeError) as e:
        raise ValueError(f"{FIELD}={path!r}: {e}") from e
