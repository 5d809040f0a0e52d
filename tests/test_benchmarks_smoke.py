"""The benchmarks a user runs (benchmarks/, each also `jaxpage bench NAME`): every one's --help, and smoke runs of
throughput --quick, serve --quick and device_check --smoke whose JSON has the figures the reports are built on."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import BENCHMARKS, bench, build_parser
from serving.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("paged", "static_contiguous", "slot_contiguous")
KEYS = ("requests_per_s", "output_tokens_per_s", "peak_concurrency", "kv_waste_frac")


# --- every kept script's --help, and `jaxpage bench` ---------------------------------------------------------
SCRIPTS = {**{name: module for name, (module, _) in BENCHMARKS.items()}, "gpu_step_profile": "gpu_step_profile"}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_benchmark_has_a_help_naming_its_module(name, capsys):
    """--help exits 0 before anything loads, with the docstring's first line and its `python -m` usage."""
    module = importlib.import_module(f"benchmarks.{SCRIPTS[name]}")
    with pytest.raises(SystemExit) as exit_:
        (getattr(module, "parse_args", None) or module.main)(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert out.startswith("usage: ") and "--json" in out, out
    assert " ".join(module.__doc__.split("\n")[0].split()[:6]) in " ".join(out.split()), out
    assert f"python -m benchmarks.{SCRIPTS[name]}" in out, out
    assert "benchmarks/" + SCRIPTS[name] + ".py" not in module.__doc__  # run as a module, not by its path


def test_jaxpage_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith("usage: jaxpage bench ")
    section = out.split("\nbenchmarks:\n")[1].split("\n\n")[0]
    listed = {m.group(1) for m in re.finditer(r"^  (\S+) +\S", section, re.MULTILINE)}  # one line each
    assert listed == set(BENCHMARKS) == {"latency", "throughput", "serve", "kernels", "device-check", "vs-vllm",
                                         "multi-turn", "profile", "engine-host", "lm-eval", "embeddings", "quantized"}
    for module, line in BENCHMARKS.values():
        assert (ROOT / "benchmarks" / f"{module}.py").is_file()
        assert " ".join(line.split()[:4]) in " ".join(out.split())
    assert "bench" in build_parser().format_help()  # `jaxpage --help` names it too


def test_jaxpage_bench_latency_help_runs_the_script(capfd):
    """Through the CLI: a fresh `python -m benchmarks.latency --help`, its exit status passed on."""
    assert cli_main(["bench", "latency", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: ") and "--compare TREE_A TREE_B" in out and "--plot" in out, out
    assert "Latency by phase" in out
    assert cli_main(["bench", "latency", "--phases", "no-such-phase"]) == 2  # the script's own argparse error
    assert "invalid choice: 'no-such-phase'" in capfd.readouterr().err


def test_jaxpage_bench_refuses_an_unknown_name_and_a_missing_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "no-such-benchmark"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench"])
    assert exit_.value.code == 2
    capsys.readouterr()
    (tmp_path / "serving").mkdir()  # an installed package: serving/ without benchmarks/ beside it
    assert bench(["latency", "--rounds", "1"], root=tmp_path) == 2
    assert "`jaxpage bench` needs a source checkout" in capsys.readouterr().err


def test_latency_table_and_plot(tmp_path, capsys):
    """The table and the plot of a run and of a --compare, from made-up figures (no engine)."""
    from benchmarks import latency

    phases = ["decode1", "prefill1024"]
    row = {"dtype": "float32", "decode1": [10.0, 12.0, 11.0], "prefill1024": [3.0, 2.0]}
    latency.print_table(row, phases)
    lines = capsys.readouterr().out.splitlines()
    assert "| decode1 | tok/s | 10, 12, 11 | 11 |" in lines and "| prefill1024 | s | 3, 2 | 2.5 |" in lines
    compared = {"dtype": "float32", "trees": ["/a", "/b"],
                "figures": {"/a": {"decode1": [10.0, 12.0], "prefill1024": [2.0, 2.0]},
                            "/b": {"decode1": [20.0, 18.0], "prefill1024": [1.0, 1.0]}},
                "median": {"/a": {"decode1": 11.0, "prefill1024": 2.0}, "/b": {"decode1": 19.0, "prefill1024": 1.0}},
                "paired_ratio_b_over_a": {"decode1": 1.75, "prefill1024": 0.5}}
    latency.print_table(compared, phases)
    assert "| decode1 | tok/s | 11 | 19 | 1.75 |" in capsys.readouterr().out.splitlines()
    pytest.importorskip("matplotlib")
    for i, r in enumerate((row, compared)):
        latency.plot(r, phases, str(tmp_path / f"{i}.png"))
        assert (tmp_path / f"{i}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- benchmarks/throughput.py --quick: paged vs the contiguous baselines on a tiny workload -----------------
@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput") / "quick.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--quick", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), out


def test_quick_json_has_every_system_and_key(quick_result):
    result, _ = quick_result
    for system in SYSTEMS:
        for key in KEYS:
            assert key in result[system], (system, key)
            assert result[system][key] >= 0
        assert result[system]["requests_per_s"] > 0
        assert result[system]["output_tokens_per_s"] > 0
        assert result[system]["peak_concurrency"] >= 1


def test_quick_same_work_and_memory_for_every_system(quick_result):
    result, _ = quick_result
    tokens = {result[s]["num_output_tokens"] for s in SYSTEMS}
    assert len(tokens) == 1  # every system generated exactly the workload's tokens
    assert result["static_contiguous"]["peak_kv_slots_allocated"] <= result["budget_tokens"]
    assert result["slot_contiguous"]["peak_concurrency"] <= result["slots"]
    assert result["paged"]["engine_stats"]["num_blocks"] == result["budget_blocks"]


def test_quick_kv_waste_is_a_fraction(quick_result):
    result, _ = quick_result
    assert 0 <= result["paged"]["kv_waste_frac"] < 1
    assert 0 <= result["paged"]["kv_waste_at_peak"] < 1
    for system in SYSTEMS:
        assert 0 <= result[system]["kv_waste_frac"] <= 1


def test_quick_writes_a_plot(quick_result):
    pytest.importorskip("matplotlib")
    _, out = quick_result
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- benchmarks/serve.py --quick: Poisson arrivals against a `jaxpage serve` subprocess ---------------------
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2e", "normalized_latency")


@pytest.fixture(scope="module")
def serving_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving") / "quick.json"
    png = out.with_suffix(".png")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--quick", "--rates", "2", "--num-requests", "4",
                           "--max-tokens", "6", "--protocol", "grpc", "http", "--json", str(out), "--plot", str(png)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), png


def test_serving_quick_json_shape(serving_quick):
    result, _ = serving_quick
    for key in ("machine", "date", "command", "rates"):
        assert key in result, key
    assert [(r["rate"], r["protocol"]) for r in result["rates"]] == [(2.0, "grpc"), (2.0, "http")]
    for rate in result["rates"]:
        for key in LATENCY_KEYS:
            for stat in ("mean", "p50", "p99"):
                assert rate[key][stat] is not None and rate[key][stat] >= 0, (key, stat)
            assert rate[key]["p50"] <= rate[key]["p99"] + 1e-9
        assert rate["throughput_requests_per_s"] > 0 and rate["throughput_output_tokens_per_s"] > 0
        assert rate["server"]["preemptions"] >= 0 and 0 < rate["server"]["peak_kv_cache_usage"] <= 1
    [row] = result["comparison"]
    for protocol, rate in zip(("grpc", "http"), result["rates"]):
        assert row[protocol]["output_tokens_per_s"] == rate["throughput_output_tokens_per_s"]


def test_serving_quick_every_request_finished_with_its_tokens(serving_quick):
    result, _ = serving_quick
    for rate in result["rates"]:  # gRPC and HTTP
        assert rate["num_requests"] == 4 and rate["num_finished"] == 4 and rate["num_errors"] == 0
        assert rate["total_output_tokens"] == rate["total_requested_tokens"]
    for r in (r for rate in result["rates"] for r in rate["requests"]):
        assert r["finished"] and r["error"] is None and r["finish_reason"] == "length"
        assert 1 <= r["requested_tokens"] <= 6
        assert r["output_tokens"] == r["requested_tokens"] == r["usage_completion_tokens"] == sum(r["chunk_tokens"])
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) == len(r["chunk_tokens"]) - 1 and all(g >= 0 for g in r["itl"])
        if r["output_tokens"] > 1:
            assert abs(r["tpot"] * (r["output_tokens"] - 1) + r["ttft"] - r["e2e"]) < 1e-3  # JSON rounds to 10 us
        assert abs(r["normalized_latency"] - r["e2e"] / r["output_tokens"]) < 1e-4


def test_serving_quick_writes_a_plot(serving_quick):
    pytest.importorskip("matplotlib")
    _, png = serving_quick
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- benchmarks/device_check.py --smoke: the one-shot GPU check, tiny and interpreted, on the CPU -----------
def test_device_check_smoke_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    checks = result["self_checks"]
    assert {name.split()[0] for name in checks} == {"decode", "ragged"}
    assert all(sub["ok"] for c in checks.values() for sub in ([c] if "ok" in c else c.values()))
    methods = {r["method"] for r in result["kernel_bench"]["results"] if r.get("gbps", 0) > 0}
    assert methods == {"pallas_ours", "pallas_jax", "xla_engine"}
    assert result["kernel_bench"]["copy_gbps"] > 0
    assert result["prefill"]["pallas_q16_us"] > 0 and result["prefill"]["xla_engine_us"] > 0
    streams = result["engine"]["streams"]
    assert sorted(int(n) for n in streams) == [1, 4] and not result["engine"]["skipped"]
    for run in streams.values():
        assert all(run[s]["output_tokens_per_s"] > 0 for s in SYSTEMS)
    from jaxpage.worker.step import LAYER_LOOPS

    layouts = result["layouts"]  # each driver built as asked (the script asserts the runner's), each stream count
    assert sorted(layouts["layouts"]) == sorted(LAYER_LOOPS) and not layouts["skipped"], layouts
    for loop, entry in layouts["layouts"].items():
        assert [d["streams"] for d in entry["decode"]] == [1, 4] and all(
            d["untraced_wall_ms_median"] > 0 for d in entry["decode"]), (loop, entry)
    runs = result["defaults"]["runs"]  # serve's prefill limits and lifted, ABAB, each with its latency
    assert [isinstance(r["limits"], str) for r in runs] == [True, False, True, False], runs
    assert all(r["output_tokens_per_s"] > 0 and 0 < r["itl_ms_p50"] <= r["itl_ms_p99"] for r in runs), runs
    paper = result["paper"]
    assert paper["setup"]["max_len"] == 64 and not result["skipped_sections"]
    assert all(paper[s]["completed_requests"] == paper["setup"]["requests"] for s in SYSTEMS), paper
    # the floor: the weights' bytes from the model's shapes, not from the weights the benchmark made
    import math

    import jax
    import jax.numpy as jnp

    from benchmarks.device_check import SMOKE
    from jaxpage.testing import random_model

    engine, dtype = result["engine"], jnp.dtype(SMOKE["dtype"])
    shapes = jax.tree.leaves(random_model.param_shapes(SMOKE["model"], dtype))
    assert engine["weight_bytes"] == sum(math.prod(a.shape) for a in shapes) * dtype.itemsize
    model = SMOKE["model"]
    assert engine["kv_bytes_per_token"] == 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize
    assert engine["copy_gbps"] == result["kernel_bench"]["copy_gbps"]
    context = SMOKE["prompt"] + SMOKE["output"] / 2
    for n, run in streams.items():
        step_bytes = engine["weight_bytes"] + int(n) * context * engine["kv_bytes_per_token"]
        assert run["floor_tokens_per_s"] == pytest.approx(int(n) * engine["copy_gbps"] * 1e9 / step_bytes)
        for s in SYSTEMS:
            assert run[s]["frac_of_floor"] == pytest.approx(run[s]["output_tokens_per_s"] / run["floor_tokens_per_s"])
    table = (tmp_path / "device_check.md").read_text()
    assert "| streams | paged | static contiguous | slot contiguous | floor |" in table and "| ragged" in table
    assert f"{engine['weight_bytes'] / 1e6:,.1f} MB of weights" in table and "% of the" in table


def test_device_check_fails_on_any_failed_self_check():
    from benchmarks.device_check import checks_ok

    good = {"decode x": {"auto_splits": {"ok": True}, "pages_per_split=4": {"ok": True}}, "ragged x": {"ok": True}}
    assert checks_ok(good)
    assert not checks_ok({**good, "ragged y": {"ok": False}})
    assert not checks_ok({**good, "decode y": {"auto_splits": {"ok": True}, "pages_per_split=4": {"ok": False}}})


# --- benchmarks/multi_turn.py --quick: conversations over a tiny random model, one engine and DP 2 ----------
# Three fresh processes (one engine, DP 2 by load, DP 2 cache-aware): 116 s here at load 4-5, over the suite's
# budget for one test, so it runs only when asked (JAXPAGE_MULTI_TURN_SMOKE=1).
@pytest.mark.skipif(not os.environ.get("JAXPAGE_MULTI_TURN_SMOKE"), reason="minutes: set JAXPAGE_MULTI_TURN_SMOKE=1")
def test_multi_turn_quick_routes_each_second_turn_to_its_first_turns_replica(tmp_path):
    from tests.factories import tiny_llama
    from tests.reference import save_random_model

    save_random_model(tiny_llama(), tmp_path / "llama", seed=3)
    out = tmp_path / "multi_turn.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_turn", "--quick", "--model", str(tmp_path / "llama"),
                           "--max-model-len", "128", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"no_offload", "dp_load", "dp_cache_aware"}
    for r in results.values():
        assert r["requests"] == 3 * 2 and r["output_tokens"] == 3 * 2 * 4
        assert r["prompt_tokens_computed"] == r["prompt_tokens"] - r["prefix_cache_hits"] >= 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    # greedy: the same answers on one engine and on two replicas, whichever replica served a turn
    assert len({r["answers_digest"] for r in results.values()}) == 1
    routing = results["dp_cache_aware"]["routing"]
    assert routing["routed_load"] == 0 and routing["routed_cache_hit"] + routing["routed_cache_miss"] == 6
    assert routing["routed_cache_hit"] >= 3  # every second turn, at least
    # each second turn (20 + 12 + 4 + 12 tokens) finds its first turn's 2 full blocks on its replica
    assert results["dp_cache_aware"]["prefix_cache_hits"] >= 3 * 32
    assert results["dp_cache_aware"]["prefix_cache_hits"] >= results["dp_load"]["prefix_cache_hits"]
    assert results["dp_load"]["routing"]["routed_load"] == 6
