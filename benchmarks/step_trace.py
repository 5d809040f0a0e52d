"""Where a served run's time goes, step by step: `jaxpage serve` with every scheduled step recorded, driven by
vLLM's own client (`vllm bench serve`, random prompts, greedy, ignore_eos), as benchmarks/vs_vllm.py drives it.

    python benchmarks/step_trace.py --concurrency 32                        # serve's defaults
    python benchmarks/step_trace.py --concurrency 32 -- --max-num-batched-tokens 512 --no-wave-prefill

The server is this script again (`--as-server`): `serving.cli` with Scheduler.schedule and schedule_ahead
wrapped, so that each step's wall time, decode rows and prompt rows/tokens are written to a JSON file when the
server stops. A warm-up run of C prompts goes first (untimed), then --prompts-per-concurrency x C prompts are
measured. Printed per kind of step (prompt tokens only, decodes only, mixed: prompt tokens beside decodes): count,
duration, decode rows; and the decode rows' step durations weighted by row (the inter-token latencies the server
causes: a row waits for its whole step), against the client's own ITL percentiles. The summary and the measured
run's steps go to --json; the server's log and the client's result to a temporary folder (printed).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from benchmarks.launch import free_port, spawn, wait_serving
from benchmarks.vs_vllm import PEER, WORKLOADS, Server, client_argv, get_json


def serve_traced(out: str, argv: list[str]) -> int:
    """The server process: serving.cli's serve, each step recorded as (time, decodes, prompt rows, tokens)."""
    from jaxpage.core.scheduler import Scheduler
    from serving.cli import main

    steps: list[tuple[float, int, int, int]] = []

    def recorded(method):
        def schedule(self, *a, **k):
            output = method(self, *a, **k)
            if output is not None and output.scheduled:
                chunks = [s.num_new_tokens for s in output.scheduled if s.num_new_tokens > 1 and not s.spec_token_ids]
                steps.append((time.time(), len(output.scheduled) - len(chunks), len(chunks), sum(chunks)))
            return output
        return schedule
    Scheduler.schedule = recorded(Scheduler.schedule)
    Scheduler.schedule_ahead = recorded(Scheduler.schedule_ahead)

    atexit.register(lambda: Path(out).write_text(json.dumps(steps)))  # serve stops on SIGTERM and exits
    return main(["serve", *argv])


def summary(steps: list, since: float) -> dict:
    """Per kind of step (the last step has no end, so it is left out) and the row-weighted step durations."""
    steps = [s for s in steps if s[0] >= since]
    kinds: dict[str, list] = {"prompt": [], "decode": [], "mixed": []}
    rows: list[float] = []
    for (t, decodes, prompts, tokens), (t_next, *_) in zip(steps, steps[1:]):
        ms = (t_next - t) * 1e3
        kinds["mixed" if decodes and tokens else "prompt" if tokens else "decode"].append((ms, decodes, tokens))
        rows += [ms] * decodes
    out = {"decode_row_step_ms": dict(zip(("p50", "p90", "p99", "max"),
                                          np.percentile(rows, [50, 90, 99, 100]).round(1).tolist()))}
    for kind, v in kinds.items():
        if v:
            ms = np.array([x[0] for x in v])
            out[kind] = {"steps": len(v), "mean_ms": round(float(ms.mean()), 1), "max_ms": round(float(ms.max()), 1),
                         "decode_rows": int(sum(x[1] for x in v)), "prompt_tokens": int(sum(x[2] for x in v))}
    return out


def client(args, server: Server, n: int, round_index: int, out: Path) -> None:
    """One `vllm bench serve` run, as vs_vllm.py runs it (round_index: fresh prompts for each)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    argv = client_argv(args, server, WORKLOADS[args.workload], args.concurrency, n, out, round_index)
    subprocess.run(argv, env=env, capture_output=True, text=True, check=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--as-server":
        sys.exit(serve_traced(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts-per-concurrency", type=int, default=4)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="fixed")
    parser.add_argument("--json", default="/tmp/step_trace.json", help="the steps and the summary")
    parser.add_argument("--vllm", default=str(PEER / "bin" / "vllm"), help="vLLM's CLI (the client)")
    parser.add_argument("--tokenizer", default=str(PEER / "smollm2-hf"))
    parser.add_argument("serve_args", nargs="*", help="after --: flags for jaxpage serve")
    args = parser.parse_args()
    args.seed, args.output_len, args.num_warmups = 0, None, 0  # what vs_vllm.client_argv reads besides
    work = Path(tempfile.mkdtemp(prefix="jaxpage-step-trace-"))
    print(f"server log and client result in {work}", flush=True)
    port, http_port = free_port(), free_port()
    steps_path, log = work / "steps.json", work / "server.log"
    proc = spawn([str(Path(__file__).resolve()), "--as-server", str(steps_path), "--port", str(port),
                  "--http-port", str(http_port), "--metrics-port", "0", *args.serve_args], log,
                 start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, timeout=900, log_path=log)
        base_url = f"http://127.0.0.1:{http_port}"
        for _ in range(120):  # the HTTP side comes up beside gRPC
            try:
                model = get_json(base_url + "/v1/models")["data"][0]["id"]
                break
            except OSError:
                time.sleep(0.5)
        server = Server("jaxpage", proc, base_url, log, [], model=model)
        client(args, server, args.concurrency, 0, work / "warm_up.json")
        time.sleep(1)
        since = time.time()
        client(args, server, args.prompts_per_concurrency * args.concurrency, 1, work / "client.json")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    measured = json.loads((work / "client.json").read_text())
    steps = json.loads(steps_path.read_text())
    result = {"command": " ".join(sys.argv), "load_1min": os.getloadavg()[0],
              "client": {k: measured.get(k) for k in ("output_throughput", "mean_itl_ms", "p99_itl_ms",
                                                      "mean_ttft_ms", "p99_ttft_ms")},
              "server_steps": summary(steps, since)}
    print(json.dumps(result, indent=1))
    # the measured run's steps: [wall time, decode rows, prompt rows, prompt tokens]
    Path(args.json).write_text(json.dumps({**result, "steps": [s for s in steps if s[0] >= since]}))


if __name__ == "__main__":
    main()
