"""Embeddings per second: jaxpage's pooling runner against sentence-transformers, on the same checkpoint.

    python -m benchmarks.embeddings [--batches 1 32 256] [--rounds 3] [--words 48] [--json F]
    jaxpage bench embeddings [...]

SmolLM2-135M-Instruct (the embedded GGUF file), read by transformers in float32 and saved as a
sentence-transformers directory (mean pooling, a Normalize module; the tokenizer without its chat template, through
which sentence-transformers 6 would embed each text as a chat); jaxpage serves that same directory (runner
"pooling", its pooler read from the modules) in float32 and in bfloat16 (the CPU default for a bfloat16
checkpoint where the CPU has bfloat16 dot instructions). Each round times, at each batch size B, sentence-transformers'
``encode(B texts, batch_size=B)`` and each jaxpage engine's ``LLM.embed(B texts)`` in turn (the order rotated every
round); batch 1 is 16 single-text calls. The texts are distinct (no prefix-cache hit), ``--words`` words each.
Reported: texts/s per side (the median over rounds), the median of the paired ratios (jaxpage / ST) and the
largest 1 - cosine between each jaxpage engine's vectors and sentence-transformers' (one text a call: a batch that
sentence-transformers pads on the left, as SmolLM2's tokenizer says, shifts the padded texts' positions).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("paged attention keeps the cache of every sequence in blocks of one pool indexed through tables so that "
         "memory is shared between requests while the scheduler batches them continuously on the device and the "
         "host prepares the next step").split()
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=512, progress=False)


def texts(n: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, words)) + f" ({seed}-{i})" for i in range(n)]


def sentence_transformers_dir(path: Path) -> Path:
    """SmolLM2 from its GGUF file (transformers, float32) as a sentence-transformers directory: mean pooling,
    normalized."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import AutoModel, AutoTokenizer

    from jaxpage.models.loader import default_model_path

    gguf = default_model_path()
    read = AutoModel.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    if hasattr(config, "quantization_config"):  # a GGUF-read model does not save: its weights go to a fresh one
        del config.quantization_config
    model = AutoModel.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.chat_template = None  # else sentence-transformers 6 embeds each text as a chat, not the text
    tokenizer.save_pretrained(path / "hf")
    word = modules.Transformer(str(path / "hf"))
    dim = word.get_word_embedding_dimension()
    model = SentenceTransformer(modules=[word, modules.Pooling(dim, "mean"), modules.Normalize()], device="cpu")
    model.save(str(path / "st"))
    return path / "st"


def timed(fn, batch: list[str]) -> tuple[float, np.ndarray]:
    """texts/s of fn over batch (16 single-text calls at batch 1) and its vectors."""
    calls = [[t] for t in batch] if len(batch) < 2 else [batch]
    start = time.perf_counter()
    vectors = np.concatenate([fn(c) for c in calls])
    return len(batch) / (time.perf_counter() - start), vectors


def run(batches: list[int], rounds: int, words: int) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxpage import LLM

    with tempfile.TemporaryDirectory() as tmp:
        directory = sentence_transformers_dir(Path(tmp))
        st = SentenceTransformer(str(directory), device="cpu")
        engines = {dtype: LLM(str(directory), runner="pooling", dtype=dtype, **ENGINE)
                   for dtype in ("float32", "bfloat16")}
        sides = {"sentence-transformers": lambda b: st.encode(b, batch_size=len(b), convert_to_numpy=True),
                 **{f"jaxpage {engine.engine.config.dtype}": (
                     lambda b, engine=engine: np.array([o.outputs.embedding for o in engine.embed(b)]))
                    for engine in engines.values()}}
        names = list(sides)
        rates = {(name, b): [] for name in names for b in batches}
        disagreement = {name: 0.0 for name in names[1:]}
        for name in names:  # warm: first calls, every batch size
            for b in batches:
                timed(sides[name], texts(min(b, 16), words, seed=10**6 + b))
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for b in batches:
                batch = texts(16 if b == 1 else b, words, seed=1000 * r + b)
                vectors = {}
                for name in order:
                    rates[name, b].append(timed(sides[name], batch)[0])
                    # one text a call: sentence-transformers pads a batch on SmolLM2's tokenizer's side (left),
                    # which moves the padded texts' positions in transformers' model
                    vectors[name] = np.concatenate([sides[name]([t]) for t in batch[:4]])
                reference = vectors[names[0]]
                for name in names[1:]:
                    cosine = np.sum(vectors[name] * reference, axis=1)
                    disagreement[name] = max(disagreement[name], float(np.max(1 - cosine)))
        return {"batches": batches, "rounds": rounds, "words": words, "torch_threads": torch.get_num_threads(),
                "texts_per_s": {f"{name}@{b}": statistics.median(v) for (name, b), v in rates.items()},
                "paired_ratio": {f"{name}@{b}": statistics.median(
                    x / y for x, y in zip(rates[name, b], rates[names[0], b])) for name in names[1:] for b in batches},
                "raw": {f"{name}@{b}": v for (name, b), v in rates.items()},
                "max_one_minus_cosine": disagreement}


def table(result: dict) -> str:
    names = sorted({key.rsplit("@", 1)[0] for key in result["texts_per_s"]}, key=lambda n: n != "sentence-transformers")
    lines = ["| batch | " + " | ".join(f"{n} texts/s" for n in names) + " | " + " | ".join(
        f"{n} / ST" for n in names[1:]) + " |", "|" + "---|" * (2 * len(names))]
    for b in result["batches"]:
        lines.append(f"| {b} | " + " | ".join(f"{result['texts_per_s'][f'{n}@{b}']:.1f}" for n in names) + " | "
                     + " | ".join(f"{result['paired_ratio'][f'{n}@{b}']:.2f}x" for n in names[1:]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args.batches, args.rounds, args.words)
    print(table(result))
    print("largest 1 - cosine against sentence-transformers:", result["max_one_minus_cosine"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
