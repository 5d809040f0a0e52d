"""The one-shot device check: everything the GPU path claims, measured in one command on one GPU.

    python -m benchmarks.device_check --out DIR            # on one H200 (or H100): under 8 minutes
    python -m benchmarks.device_check --out DIR --smoke    # anywhere: tiny shapes, kernels interpreted
    jaxpage bench device-check --out DIR [--json F]        # the same, from the CLI

1. Self-checks: paged_decode_attention_gpu and ragged_paged_attention_gpu, compiled, against the pure-jnp
   references (Llama-3-8B heads in bfloat16, SmolLM2 heads in float32; ragged lengths, decodes mixed with
   prompt chunks of 40-100 tokens). A failure stops the run (exit 1) after writing what it found.
2. The kernel benchmark (benchmarks/kernels.py): our decode kernel against JAX's own Pallas GPU
   paged_attention and the engine's XLA path, in GB/s of the K/V they must read, against the measured
   device copy bandwidth.
3. The engine on a Llama-3-8B-shaped model with random bfloat16 weights (jaxpage/testing/random_model.py): the paged
   engine against the contiguous baselines (benchmarks/baselines.py, the same jitted step and the same KV
   memory) at 1, 32 and 256 concurrent streams of 128 prompt + 128 output tokens. Each figure is also a fraction
   of its floor: the output tokens/s of decode steps that only read the weights once and each stream's K/V (at
   the mean decode context) at the copy bandwidth section 2 measured; the weight bytes are recorded.
4. The step's layer-loop drivers (benchmarks/gpu_step_profile.py --layouts: host loop, scan, scan with XLA's
   dynamic-slice fusion, unrolled) on the same model: decode steps at 1 and 32 streams, the wall of
   ``LLMEngine.step`` against the GPU's busy time in it (the idle fraction), with async scheduling as served.
5. The prefill limits (vLLM's names) on the GPU: the paged engine on 256 streams under serve's limits, chosen on a
   CPU, and with them lifted, ABAB: output tokens/s against inter-token latency p50/p99.
6. The vLLM paper's comparison (benchmarks/throughput.py's setup): ShareGPT-like lengths at t=0, 2048-token
   reservations, the same KV memory for every system, a warm-up window then a measured one; beside section 3,
   where every request fits.
7. The quantized checkpoints' products (jaxpage.models.quant) on Llama-3-8B's up projection [4096, 14336] at
   1, 32 and 256 rows: bfloat16, int8 weight-only, int4 in groups of 64, FP8 per channel and in blocks of 128,
   each FP8 one as float8 x float8 (``fp8_native_dot``, the form a GPU with FP8 runs) and upcast: us a call and
   GB/s of the weights' stored bytes.
``--sections`` runs some of them (a rerun of what a first run's time limit skipped); ``--budget-s`` is the whole
run's: a section not started within it is recorded as skipped.
Writes DIR/device_check.json (everything; also to --json F) and DIR/device_check.md (the short table), and prints
the table.
Each section has a time budget; what does not fit is recorded as skipped, never silently dropped.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels, throughput
from jaxpage import SamplingParams
from jaxpage.attention.kv_cache import bytes_per_block
from jaxpage.engine.arg_utils import EngineArgs
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.models.loader import default_cache_dir
from jaxpage.testing import random_model, workloads
from jaxpage.worker.compile_cache import enable_compilation_cache
from pallas_kernels import ragged_paged_attention_gpu, ragged_paged_attention_reference

FULL = dict(heads=((32, 8, 128, 16, "bfloat16"), (9, 3, 64, 16, "float32")), model=random_model.LLAMA3_8B,
            dtype="bfloat16", streams=(1, 32, 256), prompt=128, output=128, max_num_batched_tokens=256,
            chunks=[(0, 45), (19, 41), (300, 100)], decodes=[(1000, 1), (15, 1), (0, 1), (2047, 1)],
            kernel_bench=["--budget-s", "150", "--no-check"], engine_budget_s=330.0,
            prefill=[(1024, 512), (0, 512), (2000, 300), (64, 700)], prefill_calls=20,
            prefill_rows=(16, 64, 128))
SMOKE = dict(heads=((8, 2, 64, 16, "float32"),), model=random_model.TINY, dtype="float32", streams=(1, 4),
             prompt=8, output=4, max_num_batched_tokens=8, chunks=[(0, 20), (5, 17)], decodes=[(40, 1), (0, 1)],
             kernel_bench=["--smoke", "--batches", "1", "--contexts", "64", "--samples", "1", "--calls", "1",
                           "--no-check"], engine_budget_s=120.0,
             prefill=[(16, 20), (0, 12)], prefill_calls=1, prefill_rows=(64,), layout_steps=2, budget_s=600.0,
             paper=dict(slots=3, max_len=64, requests=6, scale=0.08, max_num_seqs=8, warmup=0.0, duration=0.0))
SECTIONS = ("checks", "kernels", "prefill", "engine", "layouts", "defaults", "paper", "quant")
QUANT = {"full": dict(k=4096, n=14336, rows=(1, 32, 256), calls=20, samples=5),
         "smoke": dict(k=256, n=384, rows=(1, 4), calls=1, samples=1)}
LIFTED = {"long_prefill_token_threshold": 0, "max_num_partial_prefills": 256, "max_long_partial_prefills": 256}


# --- 1. self-checks ---------------------------------------------------------------------------------------
def ragged_inputs(rng, heads, kv_heads, head_dim, block_size, dtype, seqs):
    """A flat batch of (context already in the pool, new tokens) per sequence, on random distinct pages."""
    width = max(c + n for c, n in seqs) // block_size + 1
    num_blocks = 1 + len(seqs) * width
    tables = (1 + rng.permutation(len(seqs) * width)).reshape(len(seqs), width).astype(np.int32)
    token_seq = np.concatenate([np.full(n, row) for row, (_, n) in enumerate(seqs)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs]).astype(np.int32)
    slots = (tables[token_seq, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    t = len(token_seq)
    q, k, v = (rng.standard_normal((t, h, head_dim)) for h in (heads, kv_heads, kv_heads))
    pool = rng.standard_normal((2, num_blocks, 2, kv_heads, block_size, head_dim))
    arrays = [jnp.asarray(a, dtype) for a in (q, k, v, pool)]
    return (*arrays, jnp.int32(1), *(jnp.asarray(a) for a in (token_seq, positions, slots, tables)))


def check_ragged(heads, kv_heads, head_dim, block_size, dtype, seqs, interpret) -> dict:
    args = ragged_inputs(np.random.default_rng(0), heads, kv_heads, head_dim, block_size, jnp.dtype(dtype), seqs)
    scale = head_dim ** -0.5
    out, pool = jax.jit(lambda *a: ragged_paged_attention_gpu(*a, scale=scale, interpret=interpret))(*args)
    ref, ref_pool = jax.jit(lambda *a: ragged_paged_attention_reference(*a, scale=scale))(*args)
    err = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
    pool_equal = bool((pool == ref_pool).all())
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    return {"max_abs_err": err, "pool_equal": pool_equal, "ok": err <= tol and pool_equal}


def self_checks(setup: dict, interpret: bool) -> dict:
    checks = {}
    for heads, kv_heads, head_dim, block_size, dtype in setup["heads"]:
        name = f"h{heads}-kvh{kv_heads}-d{head_dim}-bs{block_size}-{dtype}"
        decode = kernels.check((heads, kv_heads, head_dim, block_size), jnp.dtype(dtype), interpret,
                                    block_size, jax.random.key(1))
        checks[f"decode {name}"] = {k: v for k, v in decode.items() if isinstance(v, dict)}
        checks[f"ragged {name}"] = check_ragged(heads, kv_heads, head_dim, block_size, dtype,
                                                setup["decodes"] + setup["chunks"], interpret)
    return checks


def checks_ok(checks: dict) -> bool:
    return all(c["ok"] if "ok" in c else checks_ok(c) for c in checks.values())


# --- 2b. the prefill path: query blocks against one query per program's worth of sharing, and the XLA path --
def prefill_bench(setup: dict, interpret: bool) -> dict:
    """Microseconds per call of the ragged kernel on a batch of prompt chunks (behind existing context) at a
    few query-block sizes (``prefill_rows``: tokens x G rows per program; 16 is about what one token per
    program had before query blocks), and of the XLA path (write_kv + paged_attention_xla); the pool donated
    and threaded through the calls, as in the engine."""
    from jaxpage.attention.backends import write_and_attend

    heads, kv_heads, head_dim, block_size, dtype = setup["heads"][0]
    args = ragged_inputs(np.random.default_rng(1), heads, kv_heads, head_dim, block_size, jnp.dtype(dtype),
                         setup["prefill"])
    scale = head_dim ** -0.5
    group = heads // kv_heads
    methods = {f"pallas_q{q}": functools.partial(ragged_paged_attention_gpu, scale=scale, interpret=interpret,
                                                 queries_per_block=q)
               for q in sorted({max(1, rows // group) for rows in setup["prefill_rows"]})}
    methods["xla_engine"] = lambda *a: write_and_attend("xla", *a, scale=scale)
    result = {"heads": setup["heads"][0], "chunks": setup["prefill"], "tokens": int(args[0].shape[0])}
    for name, fn in methods.items():
        call = jax.jit(lambda pool, *a, fn=fn: fn(*a[:3], pool, *a[3:]), donate_argnums=(0,))
        pool = jnp.copy(args[3])
        pool = call(pool, *args[:3], *args[4:])[1]  # compile
        started = time.perf_counter()
        for _ in range(setup["prefill_calls"]):
            out, pool = call(pool, *args[:3], *args[4:])
        jax.block_until_ready(out)
        result[name + "_us"] = (time.perf_counter() - started) / setup["prefill_calls"] * 1e6
    return result


# --- 3. the engine ----------------------------------------------------------------------------------------
def paged_setup(setup: dict, scan_layers: bool = True, max_len: int | None = None, slots: int | None = None,
                max_num_seqs: int | None = None):
    """The random-weight model's paged runner, compiled, with a slot of max_len (default: a stream's prompt and
    output) for each of ``slots`` (default: the most streams): (loaded, runner, the throughput.py args it was
    built from, the weights)."""
    model = setup["model"]
    max_len = max_len or -(-(setup["prompt"] + setup["output"]) // 16) * 16
    slots = slots or max(setup["streams"])
    args = types.SimpleNamespace(dtype=setup["dtype"], block_size=16, max_len=max_len, scan_layers=scan_layers,
                                 max_num_batched_tokens=setup["max_num_batched_tokens"], preemption_mode="recompute",
                                 sequential=False, systems=list(throughput.SYSTEMS),
                                 prefill_into_padding=EngineArgs.prefill_into_padding,
                                 **throughput.prefill_limits_defaults())
    loaded = types.SimpleNamespace(tokenizer=None, eos_token_ids=(), name=f"random {model.num_layers}-layer")
    params = random_model.random_params(model, jnp.dtype(setup["dtype"]))
    runner = throughput.paged_runner(loaded, model, params, args, slots * (max_len // 16) + 1, max_num_seqs or slots)
    return loaded, runner, args, params


def decode_floor(weight_bytes: int, kv_bytes_per_token: float, copy_gbps: float, streams: int,
                 context: float) -> float:
    """Output tokens/s of decode steps that each read the weights once and every stream's K/V of ``context``
    tokens, at ``copy_gbps``, and nothing else: the floor an engine's figure is a fraction of."""
    return streams * copy_gbps * 1e9 / (weight_bytes + streams * context * kv_bytes_per_token)


def engine_benchmark(setup: dict, started: float, budget_s: float, report=lambda partial: None,
                     copy_gbps: float | None = None) -> dict:
    """Paged vs the contiguous baselines on one random-weight model; the runner and the caches (256 slots of
    max_len tokens each: every stream count fits) are compiled once and shared by the stream counts.
    ``report`` gets the partial result after each stream count, so a run cut off by its lease keeps them.
    With ``copy_gbps`` (section 2's), each stream count's floor and each system's fraction of it."""
    model, dtype = setup["model"], setup["dtype"]
    t = time.perf_counter()
    loaded, runner, args, params = paged_setup(setup)
    max_len, slots = args.max_len, max(setup["streams"])
    caches = throughput.contiguous_caches(model, params, args, slots, runner.config.attention_backend)
    result = {"model": dict(layers=model.num_layers, hidden=model.hidden_size, heads=model.num_heads,
                            kv_heads=model.num_kv_heads, head_dim=model.head_dim, vocab=model.vocab_size),
              "dtype": dtype, "attention_backend": runner.config.attention_backend, "max_len": max_len,
              "weight_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(params)),
              "kv_bytes_per_token": bytes_per_block(model, 16, jnp.dtype(dtype)) / 16, "copy_gbps": copy_gbps,
              "decode_context": setup["prompt"] + setup["output"] / 2,
              "compile_and_init_s": time.perf_counter() - t, "streams": {}, "skipped": []}
    for n in setup["streams"]:
        if time.perf_counter() - started > budget_s:
            result["skipped"].append({"streams": n, "why": "time budget"})
            continue
        w = workloads.fixed(n, setup["prompt"], setup["output"], model.vocab_size, 0, max_len)
        print(f"engine: {n} streams ({w.describe()})", flush=True)
        run = throughput.compare(loaded, args, w, {"paged": runner}, caches, throughput.SYSTEMS)
        result["streams"][n] = {name: {k: run[name][k] for k in ("output_tokens_per_s", "requests_per_s",
                                                                 "seconds", "peak_concurrency")}
                                for name in throughput.SYSTEMS}
        if copy_gbps:
            floor = decode_floor(result["weight_bytes"], result["kv_bytes_per_token"], copy_gbps, n,
                                 result["decode_context"])
            result["streams"][n]["floor_tokens_per_s"] = floor
            for name in throughput.SYSTEMS:
                result["streams"][n][name]["frac_of_floor"] = run[name]["output_tokens_per_s"] / floor
        report(result)
    return result


def layouts_section(smoke: bool, out: Path, deadline: float) -> dict:
    """Section 4 in a process of its own (``gpu_step_profile --layouts``: it builds its engines with this module's
    ``paged_setup``), which frees the sections' device memory before it and keeps a driver that crashes the
    runtime from ending this run; given the time left."""
    left = max(deadline - time.perf_counter(), 1.0)
    command = [sys.executable, "-m", "benchmarks.gpu_step_profile", "--layouts", "--out", str(out),
               "--budget-s", f"{left:.0f}"] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    returncode = None
    try:
        proc = subprocess.run(command, env=env, timeout=left + 120, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        pass
    path = out / "gpu_layouts.json"
    found = json.loads(path.read_text()) if path.exists() else {"layouts": {}, "skipped": []}
    if returncode != 0:
        found["error"] = "the layouts process ended early (see its output above)"
    return found


def engine_for(loaded, runner, **limits) -> LLMEngine:
    config = runner.config
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, **limits))
    return LLMEngine(config, runner, tokenizer=None, eos_token_ids=(),
                     model_name=loaded.name)


def add_requests(engine: LLMEngine, n: int, prompt: int, output: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(100, vocab, prompt).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))


def policy_run(loaded, runner, limits: dict, streams: int, prompt: int, output: int, vocab: int) -> dict:
    """``streams`` requests at t=0 under the scheduling ``limits``: output tokens/s, and the inter-token latency
    (each request's gaps between consecutive outputs, pooled) that the limits trade it against."""
    engine = engine_for(loaded, runner, **limits)
    add_requests(engine, streams, prompt, output, vocab, seed=1)
    steps, peak, started = 0, 0, time.perf_counter()
    last, gaps = {}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in last:
                gaps.append(now - last[out.request_id])
            last[out.request_id] = now
        steps += 1
        peak = max(peak, engine.scheduler.num_running_seqs())
    seconds = time.perf_counter() - started
    itl = np.asarray(gaps or [np.nan]) * 1e3
    return {"limits": limits or "serve's defaults", "output_tokens_per_s": streams * output / seconds,
            "seconds": seconds, "steps": steps, "peak_running": peak,
            "itl_ms_p50": float(np.percentile(itl, 50)), "itl_ms_p99": float(np.percentile(itl, 99))}


def defaults_section(setup: dict) -> dict:
    """Section 5: the paged engine on the most streams at t=0 under serve's prefill limits (chosen on a CPU) and
    with them lifted (the token budget only, as vLLM V1 schedules by default), twice each in turn (ABAB): output
    tokens/s against inter-token latency, the trade a GPU default is chosen by."""
    loaded, runner, _, _ = paged_setup(setup)
    n, model = max(setup["streams"]), setup["model"]
    runs = [policy_run(loaded, runner, limits, n, setup["prompt"], setup["output"], model.vocab_size)
            for limits in ({}, LIFTED, {}, LIFTED)]
    return {"streams": n, "runs": runs}


def paper_benchmark(setup: dict) -> dict:
    """Section 6: throughput.py's comparison on the random-weight model: ``paper["slots"]`` reservations of
    ``paper["max_len"]`` tokens are every system's KV memory; the paged engine runs up to ``max_num_seqs``."""
    p, model = setup["paper"], setup["model"]
    t = time.perf_counter()
    loaded, runner, args, params = paged_setup(setup, max_len=p["max_len"], slots=p["slots"],
                                               max_num_seqs=p["max_num_seqs"])
    caches = throughput.contiguous_caches(model, params, args, p["slots"], runner.config.attention_backend)
    result = {"setup": p, "compile_and_init_s": time.perf_counter() - t}
    w = workloads.sharegpt(p["requests"], p["max_len"], model.vocab_size, 0, scale=p["scale"])
    print(f"paper: {w.describe()}", flush=True)
    run = throughput.compare(loaded, args, w, {"paged": runner}, caches, throughput.SYSTEMS,
                             p["duration"] or None, p["warmup"])
    for name in throughput.SYSTEMS:
        result[name] = {k: v for k, v in run[name].items() if k != "trace"}
    result["paged_speedup_vs_best_baseline"] = run.get("paged_speedup_vs_best_baseline")
    return result


# --- 7. quantized products -------------------------------------------------------------------------------
def quant_products(k: int, n: int, key) -> dict:
    """name -> (the product x -> y, the weights' stored bytes) of each scheme on a random [k, n] kernel."""
    from jaxpage.models import quant

    w = jax.random.normal(key, (k, n), jnp.float32) * 0.02
    values, scale = quant.quantize_int8(np.asarray(w), (0,))
    int8 = jnp.asarray(values), jnp.asarray(scale)
    fp8 = (w / 0.001).astype(jnp.float8_e4m3fn), jnp.full((n,), 0.001, jnp.float32)
    fp8_blocks = fp8[0], jnp.full((k // 128, n), 0.001, jnp.float32)
    int4 = (jnp.asarray(quant.pack_int4(np.clip(values // 16, -8, 7), 0)), jnp.full((k // 64, n), 0.01, jnp.float32),
            jnp.zeros((k // 64, n), jnp.float32))
    bf16 = w.astype(jnp.bfloat16)
    return {"bfloat16": (lambda x: x @ bf16, bf16.nbytes),
            "int8 weight-only": (lambda x: quant.int8_dot_weight_only(x, *int8, 1), values.nbytes + scale.nbytes),
            "int4 groups of 64": (lambda x: quant.grouped_dot(x, *int4, 1), sum(a.nbytes for a in int4)),
            "fp8 native": (lambda x: quant.fp8_native_dot(x, *fp8, 1), sum(a.nbytes for a in fp8)),
            "fp8 upcast": (lambda x: quant.int8_dot_weight_only(x, *fp8, 1), sum(a.nbytes for a in fp8)),
            "fp8 blocks native": (lambda x: quant.fp8_native_dot(x, *fp8_blocks, 1),
                                  sum(a.nbytes for a in fp8_blocks)),
            "fp8 blocks upcast": (lambda x: quant.grouped_dot(x, *fp8_blocks, None, 1),
                                  sum(a.nbytes for a in fp8_blocks))}


def quant_section(smoke: bool) -> dict:
    """Each scheme's product at each row count: median us a call and GB/s of its stored weight bytes."""
    shape = QUANT["smoke" if smoke else "full"]
    products = quant_products(shape["k"], shape["n"], jax.random.key(0))
    out = {"k": shape["k"], "n": shape["n"], "results": []}
    for rows in shape["rows"]:
        sets = [(jax.random.normal(jax.random.key(rows + i), (rows, shape["k"]), jnp.bfloat16),) for i in range(2)]
        for name, (fn, nbytes) in products.items():
            try:
                seconds = kernels.time_method(jax.jit(fn), sets, shape["calls"], shape["samples"])
                out["results"].append({"scheme": name, "rows": rows, "us": seconds * 1e6,
                                       "weight_bytes": nbytes, "gbps": nbytes / seconds / 1e9})
            except Exception as e:  # noqa: BLE001 - a scheme this GPU cannot run is recorded, the others go on
                out["results"].append({"scheme": name, "rows": rows, "error": str(e)[:300]})
    return out


# --- the report -------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [f"# Device check: {result['device']} ({result['platform']}), JAX {result['jax']}"
             f"{', SMOKE (interpreted, tiny)' if result['smoke'] else ''}", "",
             "| self-check | max abs err | ok |", "| --- | --- | --- |"]
    for name, c in result.get("self_checks", {}).items():
        for sub, r in (c.items() if "ok" not in c else [("", c)]):
            lines.append(f"| {name} {sub} | {r['max_abs_err']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    bench = result.get("kernel_bench")
    if bench:
        lines += ["", f"Decode kernels, GB/s (% of the {bench['copy_gbps']:.0f} GB/s copy bandwidth):", "",
                  "| batch | context | ours | JAX's Pallas | XLA path |", "| --- | --- | --- | --- | --- |"]
        by = {}
        for r in bench["results"]:
            by.setdefault((r["batch"], r["context"]), {})[r["method"]] = r
        for (batch, context), m in by.items():
            cells = [f"{m[k]['gbps']:.0f} ({100 * m[k]['frac_of_copy']:.0f}%)" if "gbps" in m.get(k, {}) else "error"
                     for k in ("pallas_ours", "pallas_jax", "xla_engine")]
            lines.append(f"| {batch} | {context} | " + " | ".join(cells) + " |")
        for r in bench["results"]:
            d = r.get("device")
            if d:
                lines.append(f"batch {r['batch']} context {r['context']}: {r['median_us']:.1f} us a call, "
                             f"{d['device_us_per_call']:.1f} us of it on the GPU: " + ", ".join(
                                 f"{k['name'][:40]} {k['us_per_call']:.1f} us x{k['launches_per_call']:.0f}"
                                 for k in d["kernels"][:4]))
    prefill = result.get("prefill")
    if prefill:
        timed = {k[:-3]: v for k, v in prefill.items() if k.endswith("_us")}
        lines += ["", f"Ragged kernel on {prefill['tokens']} prompt tokens (chunks {prefill['chunks']}), us per call: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in timed.items())]
    engine = result.get("engine")
    if engine:
        lines += ["", f"Engine, output tokens/s ({engine['dtype']}, {engine['model']['layers']} layers, "
                      f"{engine['weight_bytes'] / 1e6:,.1f} MB of weights, "
                      f"attention {engine['attention_backend']}):", "",
                  "| streams | paged | static contiguous | slot contiguous | floor |",
                  "| --- | --- | --- | --- | --- |"]
        for n, r in engine["streams"].items():
            cells = [f"{r[s]['output_tokens_per_s']:.0f}" + (f" ({100 * r[s]['frac_of_floor']:.0f}%)"
                                                            if "frac_of_floor" in r[s] else "")
                     for s in throughput.SYSTEMS]
            floor = f"{r['floor_tokens_per_s']:.0f}" if "floor_tokens_per_s" in r else "-"
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {floor} |")
        if engine.get("copy_gbps"):
            lines.append(f"(floor: decode steps reading the weights once and each stream's K/V at "
                         f"{engine['decode_context']:.0f} tokens, at {engine['copy_gbps']:.0f} GB/s; the tokens/s "
                         "include the prompts' prefill, so a fraction understates decode's)")
        lines += [f"(skipped: {s['streams']} streams, {s['why']})" for s in engine["skipped"]]
    layouts = result.get("layouts")
    if layouts:
        lines += ["", "Decode steps by layer-loop driver (LLMEngine.step wall / GPU busy, ms; GPU idle %):", "",
                  "| driver | streams | wall | busy | idle % |", "| --- | --- | --- | --- | --- |"]
        for loop, entry in layouts["layouts"].items():
            for d in entry.get("decode", []):
                lines.append(f"| {loop} | {d['streams']} | {d.get('wall_ms_median', d['untraced_wall_ms_median']):.2f}"
                             f" | {d.get('gpu_busy_ms', float('nan')):.2f} | "
                             f"{100 * d.get('gpu_idle_frac', float('nan')):.0f} |")
            if "error" in entry:
                lines.append(f"| {loop} | error: {entry['error'][:120]} | | | |")
        lines += [f"(skipped: {s['layout']}, {s['why']})" for s in layouts["skipped"]]
    defaults = result.get("defaults")
    if defaults:
        lines += ["", f"Prefill limits at {defaults['streams']} streams (ABAB): " + "; ".join(
            f"{'serve' if isinstance(r['limits'], str) else 'lifted'} {r['output_tokens_per_s']:.0f} tok/s, "
            f"ITL p50 {r['itl_ms_p50']:.1f} / p99 {r['itl_ms_p99']:.1f} ms, peak {r['peak_running']}"
            for r in defaults["runs"])]
    paper = result.get("paper")
    if paper:
        lines += ["", f"The paper's setup ({paper['setup']['slots']} x {paper['setup']['max_len']}-token reservations"
                      f" of KV memory, {paper['setup']['requests']} ShareGPT-like requests at t=0): requests/s "
                      + ", ".join(f"{name} {paper[name]['requests_per_s']:.2f}" for name in throughput.SYSTEMS)
                      + f"; paged / best contiguous {paper['paged_speedup_vs_best_baseline']:.2f}x"]
    quant = result.get("quant")
    if quant:
        lines += ["", f"Quantized products on a [{quant['k']}, {quant['n']}] kernel, us a call (GB/s of the "
                      "stored weights):", "", "| scheme | " + " | ".join(
                          f"{r} rows" for r in dict.fromkeys(x["rows"] for x in quant["results"])) + " |"]
        lines.append("|---" * (1 + len({x["rows"] for x in quant["results"]})) + "|")
        for name in dict.fromkeys(x["scheme"] for x in quant["results"]):
            cells = [f"{x['us']:.1f} ({x['gbps']:.0f})" if "us" in x else "error"
                     for x in quant["results"] if x["scheme"] == name]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [f"(skipped: section {s})" for s in result.get("skipped_sections", [])]
    lines += ["", f"total {result['total_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict, started: float, json_path: str | None = None) -> None:
    """Both files (and ``json_path``), rewritten after every section: what a run cut off at its time limit
    finished stays."""
    result["total_s"] = time.perf_counter() - started
    text = json.dumps(result, indent=1, default=str)
    for path in (out / "device_check.json", *([Path(json_path)] if json_path else [])):
        path.write_text(text)
    (out / "device_check.md").write_text(markdown(result))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for device_check.json and device_check.md")
    parser.add_argument("--json", default=None, help="also write device_check.json's content here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernels (runs on a CPU)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="the sections to run (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the run's seconds: a section not started within them is skipped (default: 450 "
                             "on a GPU)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    enable_compilation_cache(default_cache_dir())
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        print(f"no GPU ({device.platform}): run with --smoke to check the script on tiny shapes")
        return 2
    setup = SMOKE if args.smoke else FULL
    deadline = started + (args.budget_s or setup["budget_s"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "python": platform.python_version(), "smoke": args.smoke, "sections": args.sections,
              "seconds": {}, "skipped_sections": []}
    for section in SECTIONS:
        if section not in args.sections:
            continue
        if section != "checks" and time.perf_counter() > deadline:
            result["skipped_sections"].append(section)
            continue
        t = time.perf_counter()
        if not run_section(section, setup, args, result, started, deadline, out):
            return 1
        result["seconds"][section] = time.perf_counter() - t
        write(out, result, started, args.json)
    write(out, result, started, args.json)
    print(markdown(result))
    return 0


def run_section(section: str, setup: dict, args, result: dict, started: float, deadline: float, out: Path) -> bool:
    """One section into ``result``; False where the self-checks failed (the run stops there)."""
    if section == "checks":
        result["self_checks"] = self_checks(setup, interpret=args.smoke)
        print(f"self-checks: {json.dumps(result['self_checks'])}", flush=True)
        write(out, result, started, args.json)
        if not checks_ok(result["self_checks"]):
            print("FAILED: a GPU kernel does not match its reference")
            return False
    elif section == "kernels":
        result["kernel_bench"] = kernels.main(setup["kernel_bench"] + ["--json", str(out / "kernel_bench.json")])
    elif section == "prefill":
        result["prefill"] = prefill_bench(setup, interpret=args.smoke)
    elif section == "engine":
        copy_gbps = (result.get("kernel_bench") or {}).get("copy_gbps") or kernels.copy_bandwidth(
            2 ** 28 if args.smoke else 2 ** 32, 5)
        budget = min(setup["engine_budget_s"], deadline - started)
        result["engine"] = engine_benchmark(setup, started, budget,
                                            lambda partial: write(out, {**result, "engine": partial}, started,
                                                                  args.json), copy_gbps)
    elif section == "layouts":
        result["layouts"] = layouts_section(args.smoke, out, deadline)
    elif section == "defaults":
        result["defaults"] = defaults_section(setup)
    elif section == "paper":
        result["paper"] = paper_benchmark(setup)
    elif section == "quant":
        result["quant"] = quant_section(args.smoke)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
