"""Random EAGLE-3 heads for a target, in the checkpoint layouts vLLM loads (the speculators library's and the
original EAGLE-3 release's), and a torch reference of a head's pass (transformers' LlamaDecoderLayer changed as
both releases change it: q/k/v over [embedding, hidden] side by side, the hidden state as the residual)."""
from __future__ import annotations

import json

import numpy as np

LAYOUTS = ("speculators", "original")


def head_layer_config(target, **changes) -> dict:
    """The head's decoder layer config: the target's shapes, one layer."""
    layer = {k: v for k, v in target.to_dict().items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size", "hidden_act")}
    return {**layer, "model_type": "llama", "num_hidden_layers": 1, **changes}


def save_random_head(path, target, aux_ids, draft_vocab_size: int, layout: str = "speculators", seed: int = 0,
                     scale: float = 0.5, norm_before_residual: bool = False, own_embedding: bool = False) -> dict:
    """A head of random weights (normal, std ``scale`` / sqrt(fan-in)) written to ``path``; the draft vocabulary
    is a random subset of the target's in increasing order (d2t offsets). Returns its tensors (torch names)."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    layer = head_layer_config(target)
    d, vocab = layer["hidden_size"], layer["vocab_size"]
    h, kvh = layer["num_attention_heads"], layer["num_key_value_heads"]
    hd = layer.get("head_dim") or d // h
    inter = layer["intermediate_size"]

    def w(rows, cols):
        return torch.tensor(rng.normal(0, scale / np.sqrt(cols), (rows, cols)), dtype=torch.float32)

    def norm(n):
        return torch.tensor(1 + 0.1 * rng.normal(size=n), dtype=torch.float32)

    prefix = "layers.0." if layout == "speculators" else "midlayer."
    ids = np.sort(rng.choice(vocab, draft_vocab_size, replace=False))
    tensors = {
        "fc.weight": w(d, len(aux_ids) * d),
        f"{prefix}self_attn.q_proj.weight": w(h * hd, 2 * d), f"{prefix}self_attn.k_proj.weight": w(kvh * hd, 2 * d),
        f"{prefix}self_attn.v_proj.weight": w(kvh * hd, 2 * d), f"{prefix}self_attn.o_proj.weight": w(d, h * hd),
        f"{prefix}mlp.gate_proj.weight": w(inter, d), f"{prefix}mlp.up_proj.weight": w(inter, d),
        f"{prefix}mlp.down_proj.weight": w(d, inter),
        f"{prefix}hidden_norm.weight": norm(d), f"{prefix}input_layernorm.weight": norm(d),
        f"{prefix}post_attention_layernorm.weight": norm(d), "norm.weight": norm(d),
        "lm_head.weight": w(draft_vocab_size, d) * 4,
        "d2t": torch.tensor(ids - np.arange(draft_vocab_size), dtype=torch.int64),
        "t2d": torch.tensor(np.isin(np.arange(vocab), ids)),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = w(vocab, d) * np.sqrt(d)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    if layout == "speculators":
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": draft_vocab_size,
                  "norm_before_residual": norm_before_residual, "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": list(aux_ids),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}], "default_proposal_method": "greedy",
                      "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}}}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size,
                  "eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def eagle3_config(path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


def _rms(x, weight, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def reference_pass(tensors: dict, layer: dict, embeds, hidden, norm_before_residual: bool = False):
    """The head's layer over positions 0..T-1 (causal), float32 torch: (final-normed output, pre-norm output)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    t = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    g = lambda name: t[f"layers.0.{name}"]  # noqa: E731
    d, h, kvh = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    hd, eps, n = layer.get("head_dim") or d // h, layer["rms_norm_eps"], embeds.shape[0]
    normed = _rms(hidden, g("hidden_norm.weight"), eps)
    residual = normed if norm_before_residual else hidden
    x = torch.cat([_rms(embeds, g("input_layernorm.weight"), eps), normed], -1)
    q, k, v = (x @ g(f"self_attn.{p}_proj.weight").T for p in "qkv")
    q, k, v = q.view(n, h, hd).transpose(0, 1), k.view(n, kvh, hd).transpose(0, 1), v.view(n, kvh, hd).transpose(0, 1)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**{k_: v_ for k_, v_ in layer.items() if k_ != "model_type"}))(
        x[None], torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = k[0].repeat_interleave(h // kvh, 0), v.repeat_interleave(h // kvh, 0)
    scores = (q[0] @ k.transpose(1, 2)) / hd ** 0.5 + torch.triu(torch.full((n, n), float("-inf")), 1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h * hd) @ g("self_attn.o_proj.weight").T
    x = residual + attn
    m = _rms(x, g("post_attention_layernorm.weight"), eps)
    x = x + (torch.nn.functional.silu(m @ g("mlp.gate_proj.weight").T) * (m @ g("mlp.up_proj.weight").T)) \
        @ g("mlp.down_proj.weight").T
    return _rms(x, t["norm.weight"], eps), x


def reference_drafts(target_model, tensors: dict, layer: dict, aux_ids, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after ``tokens`` (float32 torch): its positions 0..n-2 from the target's
    hidden states (transformers' hidden_states[i]: layer i's input) with tokens 1..n-1, then one position per
    draft from its own pre-norm output; draft ids mapped to the target's by d2t."""
    import torch

    with torch.no_grad():
        states = target_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in aux_ids], -1)[:-1]
        embed = tensors.get("embed_tokens.weight", target_model.get_input_embeddings().weight)
        embeds, hidden = embed[torch.tensor(tokens[1:])], aux @ tensors["fc.weight"].T
        drafts = []
        for _ in range(k):
            normed, pre = reference_pass(tensors, layer, embeds, hidden)
            d = int((normed[-1] @ tensors["lm_head.weight"].T).argmax())
            drafts.append(d + int(tensors["d2t"][d]))
            embeds = torch.cat([embeds, embed[drafts[-1]][None]])
            hidden = torch.cat([hidden, pre[-1:]])
    return drafts
