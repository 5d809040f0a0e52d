"""Warm-up: the step programs compiled on several threads, a compile error raised."""
from __future__ import annotations

import pytest


def test_warmup_compiles_on_several_threads_and_raises_a_compile_error():
    import threading

    from jaxpage.worker.warmup import WarmupProgram, compile_all

    programs = [WarmupProgram("step", n) for n in (8, 16, 32, 64)]
    both = threading.Barrier(2, timeout=10)  # two compiles must be running at once, or this times out

    def compile_one(program):
        if program.num_tokens in (8, 16):
            both.wait()
        return program.num_tokens * 2, threading.current_thread().name

    done = compile_all(compile_one, programs, threads=2)
    assert list(done) == programs and [v[0] for v in done.values()] == [16, 32, 64, 128]
    assert len({v[1] for v in done.values()}) == 2

    def failing(program):
        if program.num_tokens == 32:
            raise ValueError("no compile for T32")
        return program

    with pytest.raises(ValueError, match="T32"):
        compile_all(failing, programs, threads=2)
