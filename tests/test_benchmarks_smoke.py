"""Smoke test of benchmarks/throughput.py --quick: it runs, and its JSON has the figures the report is built on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("paged", "static_contiguous", "slot_contiguous")
KEYS = ("requests_per_s", "output_tokens_per_s", "peak_concurrency", "kv_waste_frac")


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput") / "quick.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "benchmarks/throughput.py", "--quick", "--json", str(out)], cwd=ROOT,
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
