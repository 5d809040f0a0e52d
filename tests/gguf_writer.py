"""Writes a transformers checkpoint as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py) lays it
out, with the ``gguf`` package: its tensor names, its q/k row permutation for the llama architecture, experts
merged into one [E, ...] tensor per projection, float32 tensors, and a placeholder byte-level BPE vocabulary.
Written from llama.cpp's conventions, not from jaxpage's name maps, so that loading it checks those."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

_LAYER = {  # transformers name under model.layers.N. -> llama.cpp name under blk.N.
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
}
_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
            "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict, cfg: dict, permute: bool) -> dict[str, np.ndarray]:
    out, experts = {}, {}
    for name, a in state.items():
        if name in _TOP:
            out[_TOP[name]] = a
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        layer, part, kind = m.groups()
        e = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", part)
        if e:
            experts.setdefault(f"blk.{layer}.{_EXPERTS[e.group(2)]}.{kind}", {})[int(e.group(1))] = a
            continue
        if permute and part == "self_attn.q_proj":
            a = _permute(a, cfg["num_attention_heads"])
        elif permute and part == "self_attn.k_proj":
            a = _permute(a, cfg["num_key_value_heads"])
        out[f"blk.{layer}.{_LAYER[part]}.{kind}"] = a
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[i] for i in range(len(per_expert))])
    return out


def _metadata(w, cfg: dict, num_experts: int) -> None:
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _vocabulary(w, vocab_size: int) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<{i}>" for i in range(vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([1] * vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(vocab_size - 1)


def write_gguf(hf_dir: Path, path: Path, arch: str) -> Path:
    """arch: llama.cpp's architecture name (llama for Llama/Mistral/Mixtral, qwen3, qwen3moe)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    state = load_file(Path(hf_dir) / "model.safetensors")
    tensors = gguf_tensors(state, cfg, permute=arch == "llama")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(Path(hf_dir).name)
    _metadata(writer, cfg, cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    _vocabulary(writer, cfg["vocab_size"])
    for name, a in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
