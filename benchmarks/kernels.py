"""Paged decode attention on one GPU: our Pallas kernel against JAX's own Pallas GPU paged_attention and the
engine's XLA path (jaxpage.attention.backends.paged_attention_xla), after checking ours against the reference.

    python -m benchmarks.kernels [--json out.json] [--plot out.png]   # on a GPU: Llama-3-8B heads, bfloat16
    python -m benchmarks.kernels --smoke                              # anywhere: tiny shapes, interpret=True
    jaxpage bench kernels [...]                                       # the same, from the CLI

Shapes: 32 query heads, 8 KV heads, head_dim 128, block size 16; batch 1/16/64/256 x context 512/2k/8k, every
sequence at the full context. Each configuration gets enough independent pools and block tables (random
permutations of blocks) that one round over them is several times the L2 cache; a sample times ``--calls``
back-to-back calls rotating over them and blocks once; the reported time is the median of ``--samples``
samples. Bandwidth counts the K/V pages each call must read (plus q and the output), against a measured
device-to-device copy (read + write bytes). A call's time there includes the host's dispatch, which bounds small
batches; our kernel's calls up to ``--breakdown-batch`` are also run under the profiler, recording the GPU's busy
time per call and each GPU kernel in it (the split-K kernel, the ops that combine its splits). Stops starting new configurations after ``--budget-s`` seconds so the
whole run stays under 8 minutes.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import save_plot
from jaxpage.attention.backends import paged_attention_xla
from pallas_kernels import paged_decode_attention_gpu, paged_decode_attention_reference

L2_BYTES = 50 << 20  # H100/H200: 50 MiB


def copy_bandwidth(nbytes: int, samples: int) -> float:
    """GB/s of a device copy (bytes read + bytes written)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    copy(x).block_until_ready()
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times) / 1e9


def make_sets(key, batch, context, shape, num_sets, dtype):
    """num_sets independent (q, pool, tables) with every sequence at ``context`` tokens."""
    heads, kv_heads, head_dim, block_size = shape
    pages = -(-context // block_size)
    num_blocks = 1 + batch * pages
    sets = []
    for i in range(num_sets):
        kq, kp, kt = jax.random.split(jax.random.fold_in(key, i), 3)
        q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
        pool = jax.random.normal(kp, (1, num_blocks, 2, kv_heads, block_size, head_dim), dtype)
        tables = (1 + jax.random.permutation(kt, batch * pages)).reshape(batch, pages).astype(jnp.int32)
        sets.append((q, pool, tables))
    lens = jnp.full((batch,), context, jnp.int32)
    return sets, lens


def time_method(fn, sets, calls, samples):
    """Median seconds per call; consecutive calls (and samples) walk on through the input sets, so a set comes
    back only after all the others have been read."""
    jax.block_until_ready([fn(*s) for s in sets])  # compile, warm up, touch every set once
    times, i = [], 0
    for _ in range(samples):
        t = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*sets[i % len(sets)])
            i += 1
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def device_breakdown(fn, sets, calls: int) -> dict | None:
    """Where a call's time goes on the device: ``calls`` calls under the profiler, each GPU kernel's mean
    microseconds and launches per call, and the union of the GPU streams' busy time per call (the host's dispatch
    is what a call's wall time adds to it). None where no GPU event was traced (a CPU)."""
    import collections
    import glob
    import tempfile

    jax.block_until_ready(fn(*sets[0]))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready([fn(*sets[i % len(sets)]) for i in range(calls)])
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    events = [(e.name, e.start_ns, e.end_ns) for plane in data.planes if plane.name.startswith("/device:GPU")
              for line in plane.lines if line.name.startswith("Stream") for e in line.events]
    if not events:
        return None
    spans, end = 0, -math.inf
    for _, a, b in sorted(events, key=lambda e: e[1]):
        if b > end:
            spans, end = spans + b - max(a, end), b
    by_name = collections.defaultdict(list)
    for name, a, b in events:
        by_name[name].append(b - a)
    kernels = sorted(((name, sum(d) / calls / 1e3, len(d) / calls) for name, d in by_name.items()),
                     key=lambda k: -k[1])
    return {"device_us_per_call": spans / calls / 1e3,
            "kernels": [{"name": n[:120], "us_per_call": us, "launches_per_call": k} for n, us, k in kernels[:12]]}


def methods(lens, scale, interpret):
    """name -> jitted fn(q, pool, tables); each consumes the engine's layout (JAX's kernel gets its own layout
    prepared outside the timed call)."""
    layer = jnp.int32(0)
    ours = jax.jit(lambda q, pool, tables: paged_decode_attention_gpu(q, pool, layer, tables, lens, scale=scale,
                                                                      interpret=interpret))

    def xla(q, pool, tables):
        batch = q.shape[0]
        return paged_attention_xla(q, pool, layer, jnp.arange(batch, dtype=jnp.int32), lens - 1, tables, scale)

    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    def jax_kernel(q, k_pages, v_pages, tables):
        k_splits = math.gcd(16, tables.shape[1])
        return jax_paged.paged_attention(q * jnp.asarray(scale, q.dtype), k_pages, v_pages, tables, lens,
                                         k_splits=k_splits, pages_per_compute_block=min(8, tables.shape[1] // k_splits),
                                         interpret=interpret)

    return {"pallas_ours": ours, "xla_engine": jax.jit(xla), "pallas_jax": jax.jit(jax_kernel)}


def to_jax_layout(pool):
    """[1, N, 2, KVH, bs, D] -> k_pages, v_pages [KVH, N, bs, D] (done once, outside the timing)."""
    return pool[0, :, 0].transpose(1, 0, 2, 3), pool[0, :, 1].transpose(1, 0, 2, 3)


def check(shape, dtype, interpret, block_size, key) -> dict:
    """Our kernel against the reference on ragged lengths (0, 1, block multiples +- 1, long), before timing."""
    heads, kv_heads, head_dim, _ = shape
    lens_list = [0, 1, block_size - 1, block_size, block_size + 1, 37 * block_size + 5, 64 * block_size]
    width = 64
    batch = len(lens_list)
    kq, kp = jax.random.split(key)
    q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
    pool = jax.random.normal(kp, (1, 1 + batch * width, 2, kv_heads, block_size, head_dim), dtype)
    tables = (1 + jax.random.permutation(key, batch * width)).reshape(batch, width).astype(jnp.int32)
    lens = jnp.asarray(lens_list, jnp.int32)
    scale = head_dim ** -0.5
    ref = paged_decode_attention_reference(q, pool, jnp.int32(0), tables, lens, scale=scale)
    result = {}
    for name, kw in (("auto_splits", {}), ("pages_per_split=4", {"pages_per_split": 4})):
        out = paged_decode_attention_gpu(q, pool, jnp.int32(0), tables, lens, scale=scale, interpret=interpret, **kw)
        err = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
        finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
        result[name] = {"max_abs_err": err, "finite": finite, "ok": finite and err <= 2e-2}
    # JAX's kernel in our adaptation (layout, scale folded into q), on the rows with keys: information only
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    k_pages, v_pages = to_jax_layout(pool)
    try:
        out = jax_paged.paged_attention(q * jnp.asarray(scale, dtype), k_pages, v_pages, tables, lens,
                                        k_splits=16, pages_per_compute_block=4, interpret=interpret)
    except Exception as e:  # noqa: BLE001 (its shape limits are not ours: say so, check ours anyway)
        result["pallas_jax_adapted_max_abs_err"] = f"{type(e).__name__}: {str(e)[:200]}"
        return result
    err = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))[1:].max()
    result["pallas_jax_adapted_max_abs_err"] = float(err)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes with interpret=True (runs on CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no configuration after this")
    parser.add_argument("--json", default=None, help="write every configuration's figures here")
    parser.add_argument("--breakdown-batch", type=int, default=16,
                        help="our kernel's calls up to this batch are also profiled: each GPU kernel's time")
    parser.add_argument("--plot", default=None, help="PNG: GB/s per method and configuration (needs matplotlib)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="check our kernel against the reference first (device_check does its own)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]
    interpret = args.smoke or device.platform != "gpu"
    if interpret and not args.smoke:
        sys.exit(f"no GPU ({device.platform}): run with --smoke to check the script on tiny shapes")
    if args.smoke:
        shape, batches, contexts = (8, 2, 64, args.block_size), [1, 2], [64, 96]
        samples, calls, copy_bytes = args.samples or 3, args.calls or 2, 64 << 20
    else:
        shape, batches, contexts = (32, 8, 128, args.block_size), [1, 16, 64, 256], [512, 2048, 8192]
        samples, calls, copy_bytes = args.samples or 15, args.calls or 10, 2 << 30
    batches, contexts = args.batches or batches, args.contexts or contexts
    dtype = jnp.bfloat16
    heads, kv_heads, head_dim, block_size = shape
    scale = head_dim ** -0.5
    key = jax.random.key(0)

    result = {"device": str(device.device_kind), "platform": device.platform, "jax": jax.__version__,
              "machine": platform.machine(), "smoke": args.smoke, "dtype": "bfloat16",
              "shape": dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size),
              "samples": samples, "calls_per_sample": calls, "results": [], "skipped": []}
    result["check"] = check(shape, dtype, interpret, block_size, key) if args.check else {}
    print(f"check against the reference: {result['check'] or 'skipped'}")
    if not all(c["ok"] for c in result["check"].values() if isinstance(c, dict)):
        _write(args.json, result)
        sys.exit("FAILED: paged_decode_attention_gpu does not match the reference")
    result["copy_gbps"] = copy_bandwidth(copy_bytes, samples)
    print(f"device copy bandwidth (read + write): {result['copy_gbps']:.0f} GB/s on {device.device_kind}")

    for batch in batches:
        for context in contexts:
            if time.perf_counter() - started > args.budget_s:
                result["skipped"].append({"batch": batch, "context": context, "why": "time budget"})
                continue
            pages = -(-context // block_size)
            kv_bytes = batch * pages * block_size * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
            io_bytes = 2 * batch * heads * head_dim * jnp.dtype(dtype).itemsize
            num_sets = max(2, min(4 if args.smoke else 256, math.ceil(4 * L2_BYTES / kv_bytes)))
            sets, lens = make_sets(jax.random.fold_in(key, batch * 100003 + context), batch, context, shape,
                                   num_sets, dtype)
            fns = methods(lens, scale, interpret)
            for name, fn in fns.items():
                if name == "pallas_jax":
                    timed_sets = [(q, *to_jax_layout(pool), tables) for q, pool, tables in sets]
                else:
                    timed_sets = sets
                try:
                    seconds = time_method(fn, timed_sets, calls, samples)
                except Exception as e:  # one method failing to build must not lose the others' numbers
                    result["results"].append({"batch": batch, "context": context, "method": name,
                                              "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    print(f"{name} batch={batch} context={context}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                finally:
                    del timed_sets  # JAX's layout is a second copy of the pools
                gbps = (kv_bytes + io_bytes) / seconds / 1e9
                result["results"].append({"batch": batch, "context": context, "method": name,
                                          "median_us": seconds * 1e6, "gbps": gbps,
                                          "frac_of_copy": gbps / result["copy_gbps"], "input_sets": num_sets})
                if name == "pallas_ours" and batch <= args.breakdown_batch:  # launch-bound sizes: on the device
                    result["results"][-1]["device"] = device_breakdown(fn, sets, calls)
            del sets
    result["total_s"] = time.perf_counter() - started
    print_table(result)
    _write(args.json, result)
    if args.plot:
        save_plot(args.plot, lambda: plot(result, args.plot))
    return result


def print_table(result) -> None:
    rows = {}
    for r in result["results"]:
        rows.setdefault((r["batch"], r["context"]), {})[r["method"]] = r
    names = ["pallas_ours", "pallas_jax", "xla_engine"]
    print(f"\n{'batch':>5} {'context':>7} " + " ".join(f"{n + ' us':>16} {'GB/s':>7} {'%copy':>5}" for n in names))
    for (batch, context), by in rows.items():
        cells = []
        for n in names:
            r = by.get(n)
            if r is None or "error" in r:
                cells.append(f"{'error' if r else '-':>16} {'':>7} {'':>5}")
            else:
                cells.append(f"{r['median_us']:>16.1f} {r['gbps']:>7.0f} {100 * r['frac_of_copy']:>5.0f}")
        print(f"{batch:>5} {context:>7} " + " ".join(cells))
    for s in result["skipped"]:
        print(f"skipped batch={s['batch']} context={s['context']}: {s['why']}")
    print(f"total {result['total_s']:.0f} s")


def plot(result, path) -> None:
    """GB/s of each method per (batch, context), against the device copy's bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["pallas_ours", "pallas_jax", "xla_engine"]
    configs = list(dict.fromkeys((r["batch"], r["context"]) for r in result["results"]))
    gbps = {(r["batch"], r["context"], r["method"]): r.get("gbps", 0.0) for r in result["results"]}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(configs) + 2), 4))
    for i, name in enumerate(names):
        ax.bar(np.arange(len(configs)) + (i - 1) * 0.27, [gbps.get((*c, name), 0.0) for c in configs], 0.27,
               label=name)
    ax.axhline(result["copy_gbps"], color="k", ls=":", lw=1, label="device copy")
    ax.set_xticks(range(len(configs)), [f"b{b}\nctx {c}" for b, c in configs], fontsize=8)
    ax.set_ylabel("GB/s of the K/V a call must read")
    ax.set_title(f"paged decode attention on {result['device']} ({result['dtype']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(path, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
