"""What an engine compiles before it serves (its warm-up programs), and compiling them (on the CPU, on several threads).

XLA:CPU's compile of one program runs mostly on one core and releases the GIL, so the buckets compile side by side
(tpu-inference precompiles the same way) on the CPU; on a TPU or GPU one thread (``compile_threads``). The
compile lane (``jaxpage/testing/compile_targets.py --warmup``) compiles this same list for TPU chips ahead of time.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxpage.config import EngineConfig, pick_bucket
from jaxpage.models.lora_slots import lora_buckets
from jaxpage.worker.step import abstract_step_inputs, replicated

MAX_COMPILE_THREADS = 16  # each compile holds its own HLO and the compiler's state in host memory


@dataclasses.dataclass(frozen=True)
class WarmupProgram:
    """One executable compiled at start: the step of a ``num_tokens`` bucket with ``num_loras`` adapter slots
    (kind "step"; 0: the base model's), or async scheduling's placeholder substitution into a ``num_tokens``
    batch of the tokens of a step that sampled ``num_sampled`` rows (kind "substitute")."""

    kind: str
    num_tokens: int
    num_loras: int = 0
    num_sampled: int = 0


def warmup_programs(config: EngineConfig, substitutes: bool) -> list[WarmupProgram]:
    """Every program an engine of ``config`` compiles before serving, the slowest (largest buckets) first so
    that they start first; ``substitutes``: the engine schedules asynchronously."""
    programs = []
    for num_tokens in reversed(config.token_buckets()):
        programs.append(WarmupProgram("step", num_tokens))
        programs += [WarmupProgram("step", num_tokens, num_loras=n)
                     for n in lora_buckets(config.step_model.max_loras, config.step_model.cpu_lora_kernel)]
        if substitutes:
            rows = sorted({config.num_seqs_for(b) for b in previous_buckets(config, num_tokens)})
            programs += [WarmupProgram("substitute", num_tokens, num_sampled=n) for n in rows]
    return programs


def program_inputs(config: EngineConfig, program: WarmupProgram) -> tuple:
    """A program's abstract inputs other than the weights and the pool: a step's (batch, sampling); a
    substitution's (token ids, the step before's sampled tokens on the device, each token's row among them)."""
    if program.kind == "step":
        return abstract_step_inputs(config, program.num_tokens, program.num_loras)
    ids = jax.ShapeDtypeStruct((program.num_tokens,), jnp.int32)
    return ids, jax.ShapeDtypeStruct((program.num_sampled,), jnp.int32, sharding=replicated(config)), ids


def fewer_rows_inputs(config: EngineConfig, program: WarmupProgram) -> tuple:
    """A step program's abstract sampling inputs for each sampled rows' size below its bucket's sequence count
    (``config.sampled_row_buckets()``; InputBatch.sampled_rows_apart)."""
    num_seqs = config.num_seqs_for(program.num_tokens)
    return tuple(abstract_step_inputs(config, program.num_tokens, program.num_loras, num_sampled=n)[1]
                 for n in config.sampled_row_buckets() if n < num_seqs)


def previous_buckets(config: EngineConfig, num_tokens: int) -> list[int]:
    """The buckets of the step before that a step of this bucket may take placeholders from: any, without
    speculative decoding (a decode step after a step of prompt chunks of the same rows is smaller); with it, any
    smaller decode step's (the same rows and their drafts, proposed one step late)."""
    if config.speculative_config is None:
        return config.token_buckets()
    decode = pick_bucket(config.token_buckets(), config.scheduler.max_num_seqs)
    return [b for b in config.token_buckets() if b <= min(num_tokens, decode)]


def compile_threads(num_programs: int, platform: str = "cpu") -> int:
    """Threads for ``num_programs`` compiles: on the CPU one per core this process may use, at most
    MAX_COMPILE_THREADS; elsewhere one. libtpu's compile of a TPU step already keeps ~1.85 of this machine's two
    cores busy, two threads gained nothing here, and a compile lane test compiling on two threads crashed
    (a segfault inside libtpu, 2 of 2 runs under pytest, 0 of 3 as a script): unproven, so off."""
    if platform != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(num_programs, cores, MAX_COMPILE_THREADS))


def compile_all(compile_one: Callable[[WarmupProgram], object], programs: list[WarmupProgram],
                threads: int, progress: bool = False) -> dict[WarmupProgram, object]:
    """``compile_one(program)`` for every program, on ``threads`` threads; the results in the programs' order.
    The first error is raised once every compile has ended."""
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool, \
            tqdm(total=len(programs), desc="compiling", disable=not progress, leave=False) as bar:
        futures = [pool.submit(compile_one, p) for p in programs]
        for future in concurrent.futures.as_completed(futures):
            bar.update()
    return {p: f.result() for p, f in zip(programs, futures)}
