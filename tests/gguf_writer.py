"""Writes a transformers checkpoint as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py) lays it
out, with the ``gguf`` package: its tensor names, its q/k row permutation for the llama architecture, experts
merged into one [E, ...] tensor per projection, Gemma's norms stored as 1 + w, float32 tensors, and a placeholder
vocabulary (byte-level BPE; SentencePiece-style with special tokens for Gemma).
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
# Gemma 2 and 3 have a norm after attention and one on each side of the MLP
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA = ("gemma2", "gemma3")
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict, cfg: dict, arch: str) -> dict[str, np.ndarray]:
    out, experts = {}, {}
    permute, layer_names = arch == "llama", _GEMMA_LAYER if arch in GEMMA else _LAYER
    for name, a in state.items():
        if arch in GEMMA and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma's norms with their + 1
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
        out[f"blk.{layer}.{layer_names[part]}.{kind}"] = a
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
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # Gemma 3: the global layers' base
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


def _gemma_metadata(w, cfg: dict, arch: str) -> None:
    import gguf

    w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_parameters"]["full_attention"]["factor"])
        # llama.cpp's default is every 6th layer global
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def _vocabulary(w, vocab_size: int) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<{i}>" for i in range(vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([1] * vocab_size)
    w.add_token_merges([])
    w.add_eos_token_id(vocab_size - 1)


def _sentencepiece_vocabulary(w, vocab_size: int) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"\u2581t{i}" for i in range(4, vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([3] * 4 + [1] * (vocab_size - 4))
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)


def write_gguf(hf_dir: Path, path: Path, arch: str) -> Path:
    """arch: llama.cpp's architecture name (llama for Llama/Mistral/Mixtral, qwen3, qwen3moe, gemma2, gemma3)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    state = load_file(Path(hf_dir) / "model.safetensors")
    tensors = gguf_tensors(state, cfg, arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(Path(hf_dir).name)
    _metadata(writer, cfg, cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if arch in GEMMA:
        _gemma_metadata(writer, cfg, arch)
        _sentencepiece_vocabulary(writer, cfg["vocab_size"])
    else:
        _vocabulary(writer, cfg["vocab_size"])
    for name, a in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
