"""SmolLM2's teacher-forced quality with int8 weights against transformers float32, in both matmul forms: the
CPU's (int8 activations per token) and the weight-only one of GPU/TPU (forced here through quant.CPU_DOT), with
jaxpage float32 as a control. Same 2,048 tokens and measures as tests/test_weight_quant.py.

    python benchmarks/weight_quant_quality.py
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.quality import SEGMENT, agreement, teacher_forced_log_probs, varied_segments
    from jaxpage.attention.kv_cache import allocate_kv_pool
    from jaxpage.models import cast_weights, config_from_hf, quant
    from jaxpage.models.loader import default_cache_dir, default_model_path, load_model

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    segments = varied_segments(tokenizer)
    with torch.no_grad():
        refs = [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy() for ids in segments]
    floats, ints = load_model(None, default_cache_dir()), load_model(None, default_cache_dir(), "int8")
    cfg = config_from_hf(floats.hf_config)
    pool = allocate_kv_pool(cfg, 1 + SEGMENT // 16, 16, jnp.float32)
    variants = {"float32": (cfg, floats.params, quant.CPU_DOT),
                "int8, int8 activations (CPU)": (dataclasses.replace(cfg, quantization="int8"), ints.params,
                                                 quant.int8_dot_dynamic),
                "int8 weight-only (GPU/TPU)": (dataclasses.replace(cfg, quantization="int8"), ints.params,
                                               quant.int8_dot_weight_only)}
    for name, (model_cfg, params, cpu_dot) in variants.items():
        quant.CPU_DOT = cpu_dot
        jax.clear_caches()  # the form is chosen while tracing
        params = cast_weights(params, "float32")
        rows = [agreement(ref, teacher_forced_log_probs(model_cfg, params, pool, ids, 16))
                for ref, ids in zip(refs, segments)]
        top1, kl = np.mean(rows, axis=0)
        print(f"{name}: top-1 {top1:.4f}, mean KL {kl:.5f} nats; per text {[tuple(map(float, r)) for r in rows]}",
              flush=True)


if __name__ == "__main__":
    main()
