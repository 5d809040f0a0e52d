"""Multi-LoRA's cost: tokens/s of a batch of greedy streams on SmolLM2-135M-Instruct with 0, 1, 4 and 8 distinct
LoRA adapters (rank ``--rank``, every projection adapted, random weights written as PEFT files) on an engine with
``--max-loras`` slots, against the same batch on an engine without LoRA; the runs interleaved round by round in
one process, so the ratios are side by side.

    python benchmarks/lora_throughput.py [--streams 32] [--prompt 32] [--tokens 32] [--rounds 2] [--rank 16]
        [--max-loras 8] [--dtype auto] [--cache-dir DIR] [--json benchmarks/results/lora_throughput.json]

The ratios are each round's against the base engine's batch of the same round, their median reported. Also
reported: each engine's start-up (weights loaded, every bucket compiled), the LoRA engine's with its step
variants per adapter slots bucket.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxpage.engine.llm_engine import EngineArgs, LLMEngine  # noqa: E402
from jaxpage.lora.request import LoRARequest  # noqa: E402
from jaxpage.sampling_params import SamplingParams  # noqa: E402

MODULES = {"self_attn.q_proj": ("D", "Q"), "self_attn.k_proj": ("D", "KV"), "self_attn.v_proj": ("D", "KV"),
           "self_attn.o_proj": ("Q", "D"), "mlp.gate_proj": ("D", "F"), "mlp.up_proj": ("D", "F"),
           "mlp.down_proj": ("F", "D")}


def write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of random weights for every projection of every layer."""
    from safetensors.numpy import save_file

    sizes = {"D": cfg.hidden_size, "Q": cfg.num_heads * cfg.head_dim, "KV": cfg.num_kv_heads * cfg.head_dim,
             "F": cfg.intermediate_size}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in MODULES.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.02, (rank, sizes[fan_in])).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (sizes[fan_out], rank)).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_rslora": False, "bias": "none",
        "target_modules": sorted(m.split(".")[-1] for m in MODULES)}))


def run_batch(engine: LLMEngine, prompts: list[list[int]], loras: list, tokens: int) -> float:
    """Generated tokens per second of one batch, from its admission to its last token."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="final_only")
    started = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the default, bfloat16 on this CPU)")
    parser.add_argument("--cache-dir", help="the engines' compilation cache (an empty folder: a cold start-up)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    options = dict(max_num_seqs=args.streams, max_num_batched_tokens=max(64, args.streams), max_model_len=512,
                   dtype=args.dtype, kv_cache_memory=256 << 20, progress=False, cache_dir=args.cache_dir)
    started = time.perf_counter()
    base = LLMEngine.from_args(EngineArgs(**options))
    base_ready = time.perf_counter()
    lora = LLMEngine.from_args(EngineArgs(**options, enable_lora=True, max_loras=args.max_loras,
                                          max_lora_rank=args.rank))
    warm_up_s = {"base engine": base_ready - started, "lora engine": time.perf_counter() - base_ready}
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    requests = []
    for i in range(max(8, args.max_loras)):
        write_adapter(tmp / f"a{i}", lora.config.model, args.rank, seed=i)
        requests.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, lora.config.model.vocab_size, args.prompt).tolist() for _ in range(args.streams)]
    cases = {"base engine": (base, 0), **{f"{n} adapters": (lora, n) for n in (0, 1, 4, 8) if n <= args.max_loras}}
    runs = {name: [] for name in cases}
    for name, (engine, n) in cases.items():  # one untimed batch each: slots written, adapters read
        run_batch(engine, prompts[:n or 1], [requests[i % n] if n else None for i in range(n or 1)], 2)
    for _ in range(args.rounds):
        for name, (engine, n) in cases.items():
            loras = [requests[i % n] if n else None for i in range(args.streams)]
            runs[name].append(run_batch(engine, prompts, loras, args.tokens))
    print(f"start-up (load and compile): {warm_up_s['base engine']:.1f} s base, {warm_up_s['lora engine']:.1f} s "
          "with LoRA")
    result = {"dtype": lora.config.dtype,
              "streams": args.streams, "prompt_tokens": args.prompt, "new_tokens": args.tokens, "rank": args.rank,
              "max_loras": args.max_loras, "rounds": args.rounds, "warm_up_s": warm_up_s,
              "machine": platform.machine(), "tokens_per_s": {k: statistics.median(v) for k, v in runs.items()},
              "raw": runs}
    # each round's ratio to the base engine's batch of that round (side by side), then their median
    base_runs = runs["base engine"]
    result["vs_base"] = {k: statistics.median(r / b for r, b in zip(v, base_runs)) for k, v in runs.items()}
    for name in cases:
        print(f"{name:>12}: {result['tokens_per_s'][name]:8.1f} tokens/s  {result['vs_base'][name]:.3f}x the base "
              "(median of the rounds' ratios)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
