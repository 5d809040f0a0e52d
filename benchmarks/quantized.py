"""Checkpoints published quantized: weight memory, the KV pool they leave, agreement with float and tok/s.

    python -m benchmarks.quantized [--streams 1 8 32] [--rounds 2] [--tokens 64] [--budget-gib 1] [--json F]
                                   [--only NAME ...]
    jaxpage bench quantized [...]

SmolLM2-135M-Instruct (the embedded GGUF file, read by transformers in float32) saved as a float directory and
as compressed-tensors checkpoints of compressed-tensors' presets (tests/quantized_checkpoints.py: W8A8 int8 and
FP8 dynamic, weights per output channel; W4A16, int4 in groups of 64 columns; the tied head float), as AWQ (the
W4A16_ASYM integers, zero points per group of 64), as block-scaled FP8 (quant_method fp8, blocks of 64 x 64), and
the GGUF file itself with its Q4_1 Linears kept (quantization="gguf", blocks of 32), and that file requantized as
llama.cpp's Q4_K_M lays SmolLM2 out (tests/gguf_k_quants.q4_k_m: Q5_0 / Q8_0 where a row is not a multiple of
256, Q4_K and Q6_K in ffn_down), kept. ``--only`` runs the named engines beside float bf16. For each: the weights'
bytes as stored (the safetensors files, or the GGUF file) and on the device (the engine's parameters, and those of
its decoder layers alone, where the quantized weights are), the KV blocks a ``--budget-gib`` device would have
left after the weights, teacher-forced top-1 agreement with float32 transformers over held-out chat text, and
output tok/s at each stream count (greedy, ``--tokens`` tokens each, distinct prompts), each round running every
engine in turn (the order rotated), the median over rounds. Float is served in bfloat16 (the CPU default for this
bfloat16 checkpoint) and in float32; the quantized checkpoints with float32 activations (the CPU's int8 product
quantizes them per token; FP8 and int4 weights are dequantized in the product).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = ["Explain how a bicycle gear works.", "Write a short poem about the sea.", "What is a prime number?",
           "Give three tips for learning a language.", "Describe the water cycle.", "Why is the sky blue?",
           "How do vaccines work?", "Summarize the plot of a fairy tale you know."]
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512, kv_cache_memory=256 << 20,
              progress=False)


def checkpoints(root: Path) -> tuple[dict[str, tuple[Path, str]], object, object]:
    """name -> (directory, dtype) of every engine compared; the float32 transformers model; its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpage.models.loader import default_model_path
    from tests.gguf_k_quants import q4_k_m
    from tests.quantized_checkpoints import requantized_gguf, save_awq, save_compressed, save_fp8_blocks

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for scheme in ("NONE", "W8A8", "FP8_DYNAMIC", "W4A16", "W4A16_ASYM"):
        save_compressed(model, root / scheme, scheme) if scheme != "NONE" else _save_float(model, root / scheme)
    save_awq(root / "W4A16_ASYM", root / "AWQ")
    save_fp8_blocks(model, root / "FP8_BLOCK", (64, 64))
    for name in ("NONE", "W8A8", "FP8_DYNAMIC", "W4A16", "AWQ", "FP8_BLOCK"):
        tokenizer.save_pretrained(root / name)
    q4_k_m_file = requantized_gguf(gguf, root / "smollm2-q4_k_m.gguf", q4_k_m(30))
    return {"float bf16": (root / "NONE", "bfloat16", None), "float f32": (root / "NONE", "float32", None),
            "W8A8 int8": (root / "W8A8", "auto", None), "FP8 dynamic": (root / "FP8_DYNAMIC", "auto", None),
            "FP8 blocks": (root / "FP8_BLOCK", "auto", None), "W4A16 int4": (root / "W4A16", "auto", None),
            "AWQ int4": (root / "AWQ", "auto", None), "GGUF Q4_1 kept": (gguf, "auto", "gguf"),
            "GGUF Q4_K_M kept": (q4_k_m_file, "auto", "gguf")}, model, tokenizer


def _save_float(model, path: Path) -> None:
    from tests.quantized_checkpoints import plain_copy

    plain = plain_copy(model)
    plain.config.dtype = "bfloat16"  # SmolLM2 is published in bfloat16: the CPU serves it in bfloat16 by default
    plain.save_pretrained(path)


def agreement(llm, reference, tokenizer) -> float:
    """Teacher-forced top-1 agreement with float32 transformers over chat prompts and a reply of theirs."""
    import torch

    from tests.reference import paged_logits

    same = total = 0
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        with torch.no_grad():
            ids = reference.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0].tolist()
            want = reference(torch.tensor([ids])).logits[0].argmax(-1).numpy()
        got = paged_logits(llm, ids).argmax(-1)
        same, total = same + int((got == want).sum()), total + len(ids)
    return same / total


def tok_per_s(llm, tokenizer, streams: int, tokens: int, seed: int) -> float:
    from jaxpage import SamplingParams

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({seed}.{i})"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def memory(llm, path: Path, budget: int) -> dict:
    import jax

    from jaxpage.attention.kv_cache import bytes_per_block

    cfg = llm.engine.config
    params = llm.engine.runner.params
    device = sum(a.nbytes for a in jax.tree.leaves(params))
    per_block = bytes_per_block(cfg.model, cfg.cache.block_size, cfg.kv_dtype)
    stored = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"stored_bytes": stored, "device_bytes": device,
            "decoder_layer_bytes": sum(a.nbytes for a in jax.tree.leaves(params["layers"])),
            "kv_blocks_left": max(0, budget - device) // per_block, "kv_dtype": cfg.kv_dtype}


def run(streams: list[int], rounds: int, tokens: int, budget_gib: float, only: list[str] | None = None) -> dict:
    from jaxpage import LLM

    root = Path(tempfile.mkdtemp(prefix="jaxpage-quantized-"))
    engines, reference, tokenizer = checkpoints(root)
    unknown = set(only or ()) - set(engines)
    if unknown:
        raise SystemExit(f"--only: unknown engines {sorted(unknown)}; known: {', '.join(engines)}")
    engines = {name: e for name, e in engines.items() if only is None or name in {"float bf16", *only}}
    llms = {name: LLM(str(path), cache_dir=str(root / "cache"), dtype=dtype, quantization=quantization, **ENGINE)
            for name, (path, dtype, quantization) in engines.items()}
    results = {name: {**memory(llm, engines[name][0], int(budget_gib * 2**30)),
                      "dtype": llm.engine.config.dtype, "quantization": llm.engine.config.model.quantization,
                      "top1_agreement": agreement(llm, reference, tokenizer), "tok_per_s": {}}
               for name, llm in llms.items()}
    for name, llm in llms.items():  # compile every bucket the timed runs reach before timing
        tok_per_s(llm, tokenizer, max(streams), 4, seed=-1)
    for r in range(rounds):
        order = list(llms)[r % len(llms):] + list(llms)[:r % len(llms)]
        for n in streams:
            for name in order:
                results[name]["tok_per_s"].setdefault(str(n), []).append(
                    tok_per_s(llms[name], tokenizer, n, tokens, seed=r))
    for res in results.values():
        res["tok_per_s_median"] = {n: statistics.median(v) for n, v in res["tok_per_s"].items()}
    return {"streams": streams, "rounds": rounds, "tokens": tokens, "budget_gib": budget_gib, "engines": results}


def table(out: dict) -> str:
    base = out["engines"]["float bf16"]
    lines = ["| checkpoint | served as | stored MB | on device MB | decoder layers MB | KV blocks left of "
             f"{out['budget_gib']:g} GiB | top-1 vs float32 | " + " | ".join(f"tok/s at {n}" for n in out["streams"])
             + " |", "|---" * (7 + len(out["streams"])) + "|"]
    for name, r in out["engines"].items():
        speeds = " | ".join(f"{r['tok_per_s_median'][str(n)]:.0f} "
                            f"({r['tok_per_s_median'][str(n)] / base['tok_per_s_median'][str(n)]:.2f}x)"
                            for n in out["streams"])
        layers = r["decoder_layer_bytes"]
        lines.append(f"| {name} | {r['dtype']}{', ' + r['quantization'] if r['quantization'] else ''} | "
                     f"{r['stored_bytes'] / 1e6:.0f} | {r['device_bytes'] / 1e6:.0f} | "
                     f"{layers / 1e6:.0f} ({layers / base['decoder_layer_bytes']:.2f}x) | "
                     f"{r['kv_blocks_left']} | "
                     f"{r['top1_agreement']:.3f} | {speeds} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", nargs="+", help="these engines (the table's names) beside float bf16")
    args = parser.parse_args(argv)
    out = run(args.streams, args.rounds, args.tokens, args.budget_gib, args.only)
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
