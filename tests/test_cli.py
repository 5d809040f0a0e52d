"""The command line: every engine option has a flag, and each flag reaches EngineArgs as given; without torch
the commands do not pass on transformers' advice to install it."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpage.engine.arg_utils import EngineArgs, parse_bytes
from serving.cli import build_parser, main
from serving.cli_args import ServerArgs
from serving.serving_models import LoRAModulePath
from tests.factories import WITHOUT_TORCH

EVERY_FLAG = [
    "--model", "m.gguf", "--block-size", "32", "--kv-cache-memory", "512MiB", "--num-kv-blocks", "100",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--max-model-len", "256", "--dtype", "bfloat16",
    "--kv-cache-dtype", "int8", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
    "--attention-backend", "pallas_gpu", "--quantization", "int8", "--no-scan-layers", "--tensor-parallel-size", "2",
    "--data-parallel-size", "3", "--data-parallel-routing", "load", "--cache-threshold", "0.5",
    "--balance-abs-threshold", "8", "--balance-rel-threshold", "1.25", "--preemption-mode", "swap", "--swap-space", "1GiB", "--max-seqs-per-request", "2",
    "--cache-dir", "/tmp/c", "--no-progress", "--long-prefill-token-threshold", "32", "--max-num-partial-prefills", "3",
    "--max-long-partial-prefills", "2", "--no-wave-prefill", "--no-prefill-into-padding",
    "--no-async-scheduling", "--enable-lora", "--max-loras", "3",
    "--max-lora-rank", "32", "--max-cpu-loras", "5", "--speculative-config", '{"num_speculative_tokens": 2}',
    "--kv-offloading-size", "512MiB", "--kv-offloading-backend", "native", "--kv-offloading-dir", "/tmp/kv",
    "--kv-offloading-disk-size", "2", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}',
]
EXPECTED = EngineArgs(model="m.gguf", block_size=32, kv_cache_memory=512 << 20, num_kv_blocks=100, max_num_seqs=4,
                      max_num_batched_tokens=128, max_model_len=256, dtype="bfloat16", kv_cache_dtype="int8",
                      gpu_memory_utilization=0.5, enable_prefix_caching=False, attention_backend="pallas_gpu",
                      quantization="int8", scan_layers=False, tensor_parallel_size=2, data_parallel_size=3,
                      data_parallel_routing="load", cache_threshold=0.5, balance_abs_threshold=8,
                      balance_rel_threshold=1.25,
                      preemption_mode="swap", swap_space=1 << 30, max_seqs_per_request=2, cache_dir="/tmp/c",
                      long_prefill_token_threshold=32, max_num_partial_prefills=3, max_long_partial_prefills=2,
                      wave_prefill=False, prefill_into_padding=False,
                      async_scheduling=False, enable_lora=True, max_loras=3, max_lora_rank=32, max_cpu_loras=5,
                      speculative_config={"num_speculative_tokens": 2}, kv_offloading_size=0.5,
                      kv_offloading_backend="native", kv_offloading_dir="/tmp/kv", kv_offloading_disk_size=2.0,
                      progress=False, runner="pooling", pooler_config={"pooling_type": "MEAN"})


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_every_flag_reaches_engine_args(command):
    ns = build_parser().parse_args([command[0], *EVERY_FLAG, *command[1:]])
    assert EngineArgs.from_cli_args(ns) == EXPECTED


def test_every_engine_args_field_has_a_flag_that_sets_it():
    """A field without a flag would be silently dropped by `serve` and `generate` (as five once were)."""
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert fields <= flags, f"EngineArgs fields without a flag: {sorted(fields - flags)}"
    given = set(EVERY_FLAG[i][2:].replace("-", "_").removeprefix("no_") for i in range(len(EVERY_FLAG))
                if EVERY_FLAG[i].startswith("--"))
    assert fields == given, f"EVERY_FLAG does not exercise: {sorted(fields - given)}"
    changed = {f.name for f in dataclasses.fields(EngineArgs) if getattr(EXPECTED, f.name) != f.default}
    assert changed == fields, f"EXPECTED leaves at their defaults: {sorted(fields - changed)}"


def test_defaults_are_the_engine_args_defaults():
    assert EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi"])) == EngineArgs()


def test_serve_takes_the_step_budget_of_vllms_api_server():
    """vLLM's API server on CPU (vllm/engine/arg_utils.py, UsageContext.OPENAI_API_SERVER): 2048 tokens a step;
    everything else as EngineArgs has it, and a flag still wins."""
    served = EngineArgs.from_cli_args(build_parser().parse_args(["serve"]))
    assert served == dataclasses.replace(EngineArgs(), max_num_batched_tokens=2048)
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--max-num-batched-tokens", "512"])).max_num_batched_tokens == 512


@pytest.mark.parametrize("flag", [["--attention-backend", "cuda"], ["--preemption-mode", "drop"],
                                  ["--swap-space", "lots"], ["--dtype", "int8"], ["--tool-call-parser", "xml"],
                                  ["--reasoning-parser", "o1"]])
def test_bad_values_are_refused_by_the_parser(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flag])
    assert flag[0] in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("268435456", 268435456), ("256MiB", 256 << 20), ("4GiB", 4 << 30),
                                         ("4g", 4 << 30), ("1.5GiB", 3 << 29), ("64k", 65536)])
def test_byte_counts_take_binary_units(text, value):
    assert parse_bytes(text) == value


def test_a_byte_count_with_an_unknown_unit_is_refused():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("4GB/s")


SERVER_FLAGS = [
    "--host", "0.0.0.0", "--port", "1", "--http-port", "2", "--served-model-name", "a", "b", "--metrics-port", "3",
    "--metrics-host", "h", "--max-queue", "4", "--grace-seconds", "5.5", "--max-engine-restarts", "0",
    "--max-message-bytes", "6", "--max-prompt-bytes", "7", "--tls-cert", "c.pem", "--tls-key", "k.pem",
    "--tls-client-ca", "ca.pem", "--api-key", "s", "--no-reflection", "--chat-template", "{{ messages }}",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
    "--lora-modules", "x=/a/x", '{"name": "y", "path": "/a/y", "base_model_name": "base"}',
    "--allow-runtime-lora-updating",
]
SERVER_EXPECTED = ServerArgs(host="0.0.0.0", port=1, http_port=2, served_model_name=["a", "b"], metrics_port=3,
                             metrics_host="h", max_queue=4, grace_seconds=5.5, max_engine_restarts=0,
                             max_message_bytes=6, max_prompt_bytes=7, tls_cert="c.pem", tls_key="k.pem",
                             tls_client_ca="ca.pem", api_key="s", reflection=False, chat_template="{{ messages }}",
                             enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
                             lora_modules=[LoRAModulePath("x", "/a/x"), LoRAModulePath("y", "/a/y", "base")],
                             allow_runtime_lora_updating=True)


def test_every_server_flag_reaches_server_args_and_the_defaults_are_its_defaults():
    assert ServerArgs.from_cli_args(build_parser().parse_args(["serve", *SERVER_FLAGS])) == SERVER_EXPECTED
    changed = {f.name for f in dataclasses.fields(ServerArgs) if getattr(SERVER_EXPECTED, f.name) != f.default}
    assert changed == {f.name for f in dataclasses.fields(ServerArgs)}, "SERVER_FLAGS leaves fields at defaults"
    assert ServerArgs.from_cli_args(build_parser().parse_args(["serve"])) == ServerArgs()


@pytest.mark.parametrize("flags, message", [
    (["--max-queue", "0"], "--max-queue=0 must be >= 1"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--max-message-bytes", "0"], "--max-message-bytes=0 is out of range"),
    (["--max-prompt-bytes", "0"], "--max-prompt-bytes=0 is out of range"),
    (["--max-engine-restarts", "-1"], "--max-engine-restarts=-1 is out of range"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "no-such.jinja"],
     "--chat-template=no-such.jinja: no such file (give a Jinja template's path, or the template)"),
    (["--lora-modules", "x=/a/x"], "--lora-modules needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
])
def test_serve_refuses_bad_server_values_before_loading(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err == f"jaxpage: error: {message}\n"


@pytest.mark.parametrize("text", ["x", "=/a", "x=", '{"name": "x"}', '{"name": "x", "path": "/a", "rank": 8}',
                                  '{"name": "x", "path": "/a"'])
def test_a_malformed_lora_module_is_refused_by_the_parser(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", text])
    assert "--lora-modules" in capsys.readouterr().err


TORCH_ADVICE = "PyTorch was not found"


def run_without_torch(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # as a user's shell
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + code, *argv], cwd=Path(__file__).parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["client", "--help"], ["serve", "--help"]])
def test_the_commands_without_torch_do_not_advise_it(argv):
    """The `jaxpage` entry point (serving.cli:main) without torch: no "PyTorch was not found" line."""
    run = run_without_torch("from serving.cli import main; sys.exit(main(sys.argv[1:]))", *argv)
    assert run.returncode == 0 and run.stdout.startswith("usage: jaxpage"), run.stderr[-3000:]
    assert TORCH_ADVICE not in run.stdout + run.stderr


def test_transformers_without_torch_advises_it():
    """The check above could fail: imported alone without torch, transformers prints the line."""
    assert TORCH_ADVICE in run_without_torch("import transformers").stderr
