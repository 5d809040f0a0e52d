"""The `jaxpage` command line."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# Before transformers is first imported: it advises at import that "PyTorch was not found", and jaxpage needs no torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxpage.engine.arg_utils import EngineArgs  # noqa: E402
from jaxpage.worker.multihost import DistributedArgs  # noqa: E402
from serving.cli_args import ServerArgs  # noqa: E402

SERVE_MAX_NUM_BATCHED_TOKENS = 2048
# `jaxpage bench NAME ARGS...`: a script of the source checkout's benchmarks/ (beside serving/), run as
# `python -m benchmarks.MODULE ARGS...` in a fresh process: the benchmarks set XLA flags and the environment
# before jax loads. name: (module, one line)
BENCHMARKS = {
    "latency": ("latency", "tokens/s at 1, 8, 32 streams, one long prefill; A/B"),
    "throughput": ("throughput", "paged vs contiguous KV caches on the same memory"),
    "serve": ("serve", "a request-rate sweep against a server, gRPC or HTTP"),
    "kernels": ("kernels", "paged decode attention kernels on one GPU, GB/s"),
    "device-check": ("device_check", "the one-shot GPU check: kernels and the engine"),
    "vs-vllm": ("vs_vllm", "jaxpage serve beside vllm serve (vllm bench serve)"),
    "multi-turn": ("multi_turn", "multi-turn chat: prefix cache tiers, DP routing"),
    "profile": ("profile", "where a CPU engine step's time goes (jax.profiler)"),
    "engine-host": ("engine_host", "the engine's host time per step, no device work; A/B"),
    "lm-eval": ("lm_eval", "lm-eval scores: jaxpage serve vs transformers"),
    "embeddings": ("embeddings", "embeddings/s at batch 1, 32, 256 vs sentence-transformers"),
    "quantized": ("quantized", "compressed-tensors checkpoints: memory, agreement, tok/s"),
}
ROOT = Path(__file__).resolve().parents[1]  # the checkout `pip install -e .` installed from


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpage", description="PagedAttention LLM serving in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("prompt")

    srv = sub.add_parser("serve", help="serve the model over gRPC (jaxpage.v1.Generation) and the "
                         "OpenAI-compatible HTTP API, with health and metrics")
    EngineArgs.add_cli_args(srv)
    # a server's step budget as vLLM's API server takes it (2048 on CPU and GPU): a wave of arrivals prefills in
    # one step (--wave-prefill); LLM(...) and `generate` keep 512, fewer buckets to compile
    srv.set_defaults(max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    ServerArgs.add_cli_args(srv)
    DistributedArgs.add_cli_args(srv)

    cli = sub.add_parser("client", help="call a running `jaxpage serve`; the text goes to stdout")
    cli.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    cli.add_argument("--stream", action="store_true", help="print the text as it is generated")
    cli.add_argument("--max-tokens", type=int, default=128)
    cli.add_argument("--temperature", type=float, default=0.0)
    cli.add_argument("--seed", type=int, default=None)
    cli.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    cli.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    cli.add_argument("--info", action="store_true", help="print the served model's info instead")
    cli.add_argument("--lora-name", default="", help="a LoRA adapter the server serves (--info lists them; "
                     "default: the base model)")
    cli.add_argument("--verbose", "-v", action="store_true", help="finish reason and token counts to stderr")
    cli.add_argument("--api-key", default=None, help="bearer token (default $JAXPAGE_API_KEY)")
    cli.add_argument("--tls-ca", default=None, help="PEM CA certificates to trust: connect over TLS")
    cli.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    cli.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    cli.add_argument("prompt", nargs="?", default="")

    # listed here for `jaxpage --help`; main() hands `jaxpage bench ...` to bench() before this parser sees it
    sub.add_parser("bench", help="run a benchmark of the source checkout (`jaxpage bench --help` lists them)",
                   add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return parser


def bench_parser() -> argparse.ArgumentParser:
    width = max(map(len, BENCHMARKS)) + 2
    parser = argparse.ArgumentParser(
        prog="jaxpage bench", usage="%(prog)s [-h] NAME [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark of the source checkout: `python -m benchmarks.MODULE ARGS...` of the\n"
        "repository that serving/ is in, in a fresh process.\n\nbenchmarks:\n"
        + "\n".join(f"  {name:<{width}}{line}" for name, (_, line) in BENCHMARKS.items()),
        epilog="`jaxpage bench NAME --help`: the benchmark's own options. Needs a source checkout (benchmarks/\n"
        "beside serving/: `pip install -e .` from a git clone).")
    parser.add_argument("name", metavar="NAME", choices=list(BENCHMARKS),
                        help="a benchmark of those above; the ARGS after it are its own")
    return parser


def bench(argv: list[str], root: Path = ROOT) -> int:
    """`jaxpage bench NAME ARGS...`: the benchmark's exit status (2 without a source checkout)."""
    if not argv or argv[0] not in BENCHMARKS:
        bench_parser().parse_args(argv[:1])  # --help lists them (exit 0); else argparse's error (exit 2)
        return 2
    module = BENCHMARKS[argv[0]][0]
    if not (root / "benchmarks" / f"{module}.py").is_file():
        print(f"jaxpage: error: `jaxpage bench` needs a source checkout: no benchmarks/{module}.py in {root} "
              "(clone the repository and `pip install -e .` from it)", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    # -P: the checkout's benchmarks package, not a benchmarks/ of the working directory (which stays the caller's,
    # so that relative --json/--plot paths land there)
    proc = subprocess.Popen([sys.executable, "-P", "-m", f"benchmarks.{module}", *argv[1:]], env=env)
    while True:
        try:
            code = proc.wait()
            return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + its number
        except KeyboardInterrupt:  # Ctrl-C reached the benchmark too: it stops its servers and exits; wait for it
            continue


def generate(ns: argparse.Namespace) -> int:
    from jaxpage.engine.llm_engine import LLMEngine
    from jaxpage.entrypoints.chat_utils import render_chat
    from jaxpage.sampling_params import SamplingParams

    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.seed)
    if not ns.prompt:
        raise ValueError("prompt is empty")
    engine = LLMEngine.from_args(EngineArgs.from_cli_args(ns))
    chat = [{"role": "user", "content": ns.prompt}]
    prompt = render_chat(engine.tokenizer, chat) if ns.chat else ns.prompt
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def serve(ns: argparse.Namespace) -> int:
    ServerArgs.from_cli_args(ns)  # its bad values raise here, before anything loads
    for flag in ("lora_modules", "allow_runtime_lora_updating"):
        if getattr(ns, flag) and not ns.enable_lora:
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
    if ns.max_seqs_per_request is None:  # a server has many clients: none may take every slot
        ns.max_seqs_per_request = max(1, ns.max_num_seqs // 2)
    from jaxpage.worker import multihost
    from serving.server import run

    multihost.initialize(DistributedArgs.from_cli_args(ns))
    if not multihost.is_multiprocess():
        return run(ns)
    if ns.data_parallel_size != 1:
        raise ValueError(f"--data-parallel-size={ns.data_parallel_size}: several processes serve one engine "
                         "over one mesh (tensor parallel); data parallelism is within one process")
    ns.max_engine_restarts = 0  # the followers cannot rebuild theirs: a dead engine stops the whole mesh
    from jaxpage.engine.llm_engine import LLMEngine

    if not multihost.is_leader():
        return multihost.follow(LLMEngine.from_args(EngineArgs.from_cli_args(ns)).runner)
    engines: list[LLMEngine] = []

    def make_engine():
        from jaxpage.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_args(EngineArgs.from_cli_args(ns))
        engines.append(engine.engine)
        return engine
    try:
        return run(ns, make_engine)
    finally:
        if engines:  # once the engine has stopped
            engines[-1].runner.stop_followers()


def client(ns: argparse.Namespace) -> int:
    if not ns.prompt and not ns.info:
        raise ValueError("prompt is empty")
    from serving.client import run

    return run(ns)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    ns = build_parser().parse_args(argv)
    try:
        return {"generate": generate, "serve": serve, "client": client}[ns.command](ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxpage: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
