"""EleutherAI's lm-eval (0.4.13) against `jaxpage serve`, beside lm-eval's own transformers backend on the same
float32 weights (SmolLM2-135M-Instruct), on the small local tasks of benchmarks/lm_eval_tasks/:

- jaxpage_mc: multiple choice by loglikelihood (acc, acc_norm), 30 questions x 4 choices;
- jaxpage_perplexity: rolling loglikelihood (word_perplexity, byte_perplexity, bits_per_byte), 24 documents;
- jaxpage_arithmetic: greedy generation scored by exact match, 24 questions; as plain text and through the chat
  template (--apply_chat_template).

Runs: `--model hf` (float32) on all of them, then `--model local-completions` (token-id prompts, batches of 4
prompts per request: echo + logprobs for the loglikelihoods) and `--model local-chat-completions` (the chat task)
against one `jaxpage serve --dtype float32`. It prints the scores side by side, the largest difference of any
request's loglikelihood, and every generation that differs; it writes all of it to --out.

lm-eval lives in a virtualenv of its own (its pins would move the project's), made once with ``--setup``:
``python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 'lm_eval[api]==0.4.13' transformers gguf
accelerate`` (torch 2.13.0 exactly: the CPU wheel the local index has), then the GGUF the tests load converted
into a Hugging Face directory (float32) for `--model hf` and for the tokenizer local-completions needs.

    python -m benchmarks.lm_eval --setup          # once: the venv and the HF directory
    python -m benchmarks.lm_eval [--json benchmarks/results/lm_eval_compare.json]
    jaxpage bench lm-eval [...]                   # the same, from the CLI
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from jaxpage.models.loader import default_model_path
from jaxpage.testing.launch import ROOT, free_port, spawn, wait_serving

TASKS = ROOT / "benchmarks" / "lm_eval_tasks"
WORK = Path("/tmp/jaxpage-lmeval")
SERVED_NAME = "smollm2"
SCORE_TASKS = ["jaxpage_mc", "jaxpage_perplexity", "jaxpage_arithmetic"]
CHAT_TASK = "jaxpage_arithmetic"
GENERATION_TASKS = {"jaxpage_arithmetic"}
INSTALL = ["torch==2.13.0", "lm_eval[api]==0.4.13", "transformers", "gguf", "accelerate"]

CONVERT = r'''
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
cfg = model.config  # transformers marks a GGUF-loaded model quantized and will not save it: a plain copy
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
plain = type(model)(cfg).to(torch.float32)
plain.load_state_dict(model.state_dict(), strict=False)
plain.tie_weights()
plain.generation_config = model.generation_config
plain.save_pretrained(sys.argv[2], safe_serialization=True)
tok.save_pretrained(sys.argv[2])
'''


def setup(venv: Path, hf_dir: Path) -> None:
    if not (venv / "bin" / "lm_eval").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", *INSTALL], check=True)
    if not (hf_dir / "model.safetensors").exists():
        subprocess.run([str(venv / "bin" / "python"), "-c", CONVERT, str(default_model_path()), str(hf_dir)],
                       check=True)
    print(f"lm-eval in {venv}, SmolLM2 float32 in {hf_dir}")


def lm_eval(venv: Path, out: Path, model: str, model_args: str, tasks: list[str], *extra: str) -> dict:
    """One lm-eval run (every sample logged); its results JSON and the samples by task. A run already in out (a
    --resume) is read, not run again."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [str(venv / "bin" / "lm_eval"), "run", "--model", model, "--model_args", model_args,
            "--tasks", ",".join(tasks), "--include_path", str(TASKS), "--output_path", str(out),
            "--log_samples", "--seed", "1234", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started, seconds = time.monotonic(), None
    if not finished(out):
        subprocess.run(argv, check=True, cwd=ROOT, env=env)
        seconds = round(time.monotonic() - started, 1)
    results = json.loads(Path(max(glob.glob(str(out / "**" / "results_*.json"), recursive=True)))
                         .read_text())
    samples = {}
    for task in tasks:
        path = max(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        samples[task] = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {"argv": argv, "seconds": seconds, "results": results["results"],
            "samples": samples}


def finished(out: Path) -> bool:
    return bool(glob.glob(str(out / "**" / "results_*.json"), recursive=True))


def scores(run: dict, task: str) -> dict[str, float]:
    return {k.split(",")[0]: v for k, v in run["results"][task].items()
            if "," in k and "stderr" not in k and isinstance(v, float | int)}


def compare(ref: dict, ours: dict, task: str) -> dict:
    """Scores side by side, the largest loglikelihood difference of any request, the generations that differ."""
    by_doc = {s["doc_id"]: s for s in ours["samples"][task]}
    max_diff, greedy_differs, texts_differ = 0.0, 0, []
    for s in ref["samples"][task]:
        o = by_doc[s["doc_id"]]
        for a, b in zip(s["resps"], o["resps"], strict=True):
            a, b = a[0], b[0]  # lm-eval logs a generation, a loglikelihood, or (loglikelihood, is_greedy), as text
            if task in GENERATION_TASKS:
                if a != b:
                    texts_differ.append({"doc_id": s["doc_id"], "hf": a, "jaxpage": b})
            elif isinstance(a, list):
                max_diff = max(max_diff, abs(float(a[0]) - float(b[0])))
                greedy_differs += a[1] != b[1]
            else:
                max_diff = max(max_diff, abs(float(a) - float(b)))
    return {"hf": scores(ref, task), "jaxpage": scores(ours, task), "max_loglikelihood_diff": max_diff,
            "is_greedy_differs": greedy_differs, "generations_differ": texts_differ}


def serve(log: Path) -> tuple[subprocess.Popen, int]:
    port, http_port = free_port(), free_port()
    proc = spawn(["-m", "serving.cli", "serve", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs",
                  "8", "--max-num-batched-tokens", "256", "--served-model-name", SERVED_NAME, "--port", str(port),
                  "--metrics-port", "0", "--http-port", str(http_port)], log)
    wait_serving(f"127.0.0.1:{port}", proc, 600, log)
    return proc, http_port


def print_table(report: dict) -> None:
    """Per endpoint and task: each score of lm-eval's transformers run beside jaxpage's, the largest
    loglikelihood difference, and how many greedy flags and generations differ."""
    print("\n| endpoint | task | metric | hf (transformers) | jaxpage |\n| --- | --- | --- | --- | --- |")
    for endpoint in ("completions", "chat_completions"):
        for task, c in report[endpoint].items():
            for metric, value in c["hf"].items():
                print(f"| {endpoint} | {task} | {metric} | {value:.6f} | {c['jaxpage'].get(metric, math.nan):.6f} |")
            print(f"| {endpoint} | {task} | max abs dlogL; is_greedy / generations differing | | "
                  f"{c['max_loglikelihood_diff']:.2e}, {c['is_greedy_differs']} / {len(c['generations_differ'])} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="make the venv and the HF directory, then stop")
    p.add_argument("--venv", type=Path, default=WORK / "venv")
    p.add_argument("--hf-dir", type=Path, default=WORK / "smollm2-hf")
    p.add_argument("--resume", type=Path, help="a run directory of before: its finished lm-eval runs are kept")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per request to the server")
    p.add_argument("--json", "--out", dest="out", type=Path,
                   default=ROOT / "benchmarks" / "results" / "lm_eval_compare.json", help="write the report here")
    args = p.parse_args(argv)
    setup(args.venv, args.hf_dir)
    if args.setup:
        return
    runs_dir = args.resume or WORK / "runs" / datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    hf_args = f"pretrained={args.hf_dir},dtype=float32"
    runs = {"hf": lm_eval(args.venv, runs_dir / "hf", "hf", hf_args, SCORE_TASKS, "--batch_size", "1"),
            "hf_chat": lm_eval(args.venv, runs_dir / "hf_chat", "hf", hf_args, [CHAT_TASK], "--batch_size", "1",
                               "--apply_chat_template")}
    load_before = os.getloadavg()
    proc, http_port = (None, 0) if finished(runs_dir / "completions") and finished(runs_dir / "chat") else serve(
        runs_dir / "server.log")
    try:
        base = f"http://127.0.0.1:{http_port}/v1"
        common = f"model={SERVED_NAME},tokenizer_backend=huggingface,tokenizer={args.hf_dir},max_retries=1"
        runs["completions"] = lm_eval(args.venv, runs_dir / "completions", "local-completions",
                                      f"{common},base_url={base}/completions,tokenized_requests=True",
                                      SCORE_TASKS, "--batch_size", str(args.batch_size))
        runs["chat_completions"] = lm_eval(args.venv, runs_dir / "chat", "local-chat-completions",
                                           f"{common},base_url={base}/chat/completions", [CHAT_TASK],
                                           "--apply_chat_template")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "load_before_serving": load_before, "load_after": os.getloadavg(), "runs": str(runs_dir),
              "argv": {k: r["argv"] for k, r in runs.items()},
              "seconds": {k: r["seconds"] for k, r in runs.items()},  # None: a run of before (--resume)
              "completions": {t: compare(runs["hf"], runs["completions"], t) for t in SCORE_TASKS},
              "chat_completions": {CHAT_TASK: compare(runs["hf_chat"], runs["chat_completions"], CHAT_TASK)}}
    print_table(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
