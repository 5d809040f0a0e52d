"""benchmarks/vs_vllm.py: its report (table, RESULTS.md markers, plot) from a stored tiny run of both systems
(tests/data/vs_vllm_tiny.json, the client's own result JSONs inside), and, where the vLLM peer is installed, a real
`vllm bench serve` run against `jaxpage serve` through the script."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vs_vllm

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "tests" / "data" / "vs_vllm_tiny.json"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def run_script(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_vllm", *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def table_rows(markdown: str) -> dict[tuple[str, int, str], list[str]]:
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[1].isdigit():
            rows[(cells[0], int(cells[1]), cells[2])] = cells
    return rows


@pytest.fixture(scope="module")
def stored_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("vs_vllm")
    md = out / "RESULTS.md"
    md.write_text(f"# before\n\n{vs_vllm.BEGIN}\nstale table\n{vs_vllm.END}\n\nafter\n")
    run_script("--report-only", "--json", str(STORED), "--markdown", str(md), "--plot", str(out / "p.png"), timeout=120)
    return json.loads(STORED.read_text()), md.read_text(), out / "p.png"


def test_stored_run_has_both_systems_from_the_real_client():
    result = json.loads(STORED.read_text())
    assert {r["system"] for r in result["runs"]} >= {"jaxpage", "vllm-fp32"}
    for r in result["runs"]:
        client = r["client"]  # vllm bench serve's own result JSON
        assert client["completed"] == r["num_prompts"] and client["failed"] == 0
        assert client["max_concurrency"] == r["concurrency"]


def test_table_has_the_clients_figures_and_ratios(stored_report):
    result, md, _ = stored_report
    rows = table_rows(md)
    assert len(rows) == len(result["runs"])
    first = result["systems"][0]
    for r in result["runs"]:
        client = r["client"]
        cells = rows[(r["workload"], r["concurrency"], r["system"])]
        assert cells[3] == f"{client['output_throughput']:.1f}"
        base = next(b["client"] for b in result["runs"]
                    if b["system"] == first and (b["workload"], b["concurrency"]) == (r["workload"], r["concurrency"]))
        assert cells[4] == f"{client['output_throughput'] / base['output_throughput']:.2f}x"
        assert cells[5] == f"{client['mean_itl_ms']:.0f} / {client['p99_itl_ms']:.0f}"
        assert cells[6] == f"{client['mean_ttft_ms']:.0f} / {client['p99_ttft_ms']:.0f}"


def test_markdown_replaces_only_between_the_markers(stored_report):
    _, md, _ = stored_report
    assert md.startswith("# before\n\n" + vs_vllm.BEGIN) and md.endswith(vs_vllm.END + "\n\nafter\n")
    assert "stale table" not in md and md.count(vs_vllm.BEGIN) == 1
    assert "vllm-fp32 (`vllm serve" in md  # how each server used the cores


def test_report_writes_a_plot(stored_report):
    pytest.importorskip("matplotlib")
    _, _, png = stored_report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not Path(vs_vllm.PEER / "bin" / "vllm").exists() or not (vs_vllm.PEER / "smollm2-hf").is_dir(),
                    reason="the vLLM peer (its client) is not installed: bash /work/shared/peers/vllm/setup.sh")
def test_real_client_against_jaxpage(tmp_path):
    out = tmp_path / "run.json"
    run_script("--systems", "jaxpage", "--workloads", "fixed", "--concurrency", "2", "--num-prompts", "2",
               "--output-len", "4", "--no-warm-up", "--json", str(out), "--markdown", "", "--plot", "",
               "--work-dir", str(tmp_path / "work"), timeout=900)
    result = json.loads(out.read_text())  # run_script: exit status 0, so no server or run failed
    [run] = result["runs"]
    assert run["completed"] == 2 and run["failed"] == 0
    assert run["total_output_tokens"] == 2 * 4  # ignore_eos: every request made its full output
    assert run["total_input_tokens"] == 2 * 64
    assert run["client"]["max_concurrency"] == 2 and run["output_tok_s"] > 0
    assert run["cores"]["server_cpu_s"] > 0 and result["servers"]["jaxpage"]["idle_cores_busy"] >= 0
    with pytest.raises(ProcessLookupError):  # the server was stopped, its whole process group
        os.killpg(result["servers"]["jaxpage"]["pid"], 0)


def test_paired_table_takes_each_rounds_ratio_against_the_first_system():
    """--interleave --rounds: per workload x concurrency, the median over rounds of each system's tok/s over the
    first system's in the same round (two rounds of the stored run, the second with other figures)."""
    import copy
    import statistics

    result = json.loads(STORED.read_text())
    runs = []
    for k, scale in enumerate((1.0, 0.5)):
        for r in copy.deepcopy(result["runs"]):
            r["round"] = k
            r["output_tok_s"] *= scale if r["system"] == result["systems"][0] else 1.0
            runs.append(r)
    result["runs"] = runs
    text = vs_vllm.paired(result)
    first, other = result["systems"][0], result["systems"][1]
    for r in (r for r in runs if r["system"] == other and r["round"] == 0):
        key = (r["workload"], r["concurrency"])
        ratios = [o["output_tok_s"] / f["output_tok_s"] for o in runs for f in runs
                  if o["system"] == other and f["system"] == first and o["round"] == f["round"]
                  and (o["workload"], o["concurrency"]) == key == (f["workload"], f["concurrency"])]
        assert len(ratios) == 2
        line = next(line for line in text.splitlines() if line.startswith(f"| {key[0]} | {key[1]} |"))
        assert f"{statistics.median(ratios):.2f}x" in line


def test_each_round_and_cell_gets_prompts_of_its_own():
    """Interleaved rounds must not meet the prompts of an earlier round in the prefix cache: every (workload,
    concurrency, round) has its own client seed, the same for every system."""
    args = vs_vllm.parse_args(["--interleave", "--rounds", "3"])
    seeds = [vs_vllm.run_seed(args, vs_vllm.WORKLOADS[w], c, r) for w in args.workloads for c in args.concurrency
             for r in range(args.rounds)]
    assert len(set(seeds)) == len(seeds)
