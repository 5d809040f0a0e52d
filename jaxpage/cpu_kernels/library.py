"""The CPU kernels' shared library: built on first use, loaded and registered with XLA as FFI targets.

The sources (onednn_matmul.cc, packed_gemv.cc, kv_write.cc, gather_rows.cc, block_moves.cc, paged_attention.cc,
lora_delta.cc, greedy_pick.cc, silu_and_mul.cc, rms_norm.cc, rotary_embedding.cc) are compiled with the system's
C++ compiler against the oneDNN wheels (PyPI ``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``) and cached per source, JAX and oneDNN
version; without a compiler or oneDNN, or with ``JAXPAGE_ONEDNN=0``, ``available()`` is False and callers keep
XLA's ops.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import jax

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("onednn_matmul.cc", "packed_gemv.cc", "kv_write.cc", "gather_rows.cc", "block_moves.cc",
                             "paged_attention.cc", "lora_delta.cc", "greedy_pick.cc",
                             "silu_and_mul.cc", "rms_norm.cc", "rotary_embedding.cc"))
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("simd16.h", "prefix_tiles.h", "threads.h", "timed_choice.h"))
TARGETS = {"jaxpage_onednn_matmul": "JaxpageOnednnMatmul", "jaxpage_write_kv": "JaxpageWriteKv",
           "jaxpage_gather_rows": "JaxpageGatherRows", "jaxpage_take_blocks": "JaxpageTakeBlocks",
           "jaxpage_put_blocks": "JaxpagePutBlocks", "jaxpage_paged_attention": "JaxpagePagedAttention",
           "jaxpage_lora_delta": "JaxpageLoraDelta", "jaxpage_greedy_pick": "JaxpageGreedyPick",
           "jaxpage_silu_and_mul": "JaxpageSiluAndMul", "jaxpage_rms_norm": "JaxpageRmsNorm",
           "jaxpage_fused_add_rms_norm": "JaxpageFusedAddRmsNorm",
           "jaxpage_rotary_embedding": "JaxpageRotaryEmbedding"}


def onednn_prefix() -> Path | None:
    """The install prefix that holds oneDNN's headers and library (the wheels put them under the environment's
    ``include/`` and ``lib/``), or None."""
    for prefix in (os.environ.get("JAXPAGE_ONEDNN_ROOT"), sys.prefix, sysconfig.get_config_var("prefix")):
        if prefix and (Path(prefix) / "include/oneapi/dnnl/dnnl.hpp").exists() and \
                any((Path(prefix) / "lib").glob("libdnnl.so*")):
            return Path(prefix)
    return None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxpage" / "cpu_kernels"


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), '' where unknown: the library is built for this CPU's vector units
    (``-march=native``) only where they are known, and they are part of its cache key (a shared home directory)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(prefix: Path) -> Path:
    """Compiles the extension once per source, JAX and oneDNN version and CPU; returns the shared library's path."""
    include, flags = jax.ffi.include_dir(), cpu_flags()
    sources = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    key = hashlib.sha256(sources + f"{jax.__version__}{prefix}{flags}".encode())
    key = key.hexdigest()[:16]
    path = cache_dir() / f"libjaxpage_onednn-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        command = [os.environ.get("CXX", "g++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-fopenmp",
                   "-fno-math-errno", *(["-march=native"] if flags else []),
                   f"-I{include}", f"-I{prefix / 'include'}", *map(str, SOURCES), f"-L{prefix / 'lib'}", "-ldnnl",
                   f"-Wl,-rpath,{prefix / 'lib'}", "-o", tmp.name]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(tmp.name, path)  # atomic: processes building at once each leave a whole library
        finally:
            Path(tmp.name).unlink(missing_ok=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library, built, loaded and its targets registered with XLA (once per process); None where it cannot
    be (then callers keep XLA's ops)."""
    if os.environ.get("JAXPAGE_ONEDNN", "1") == "0" or jax.default_backend() != "cpu":
        return None  # a GPU or TPU host never runs them: no build at its first trace
    prefix = onednn_prefix()
    if prefix is None:
        log.info("oneDNN not installed: the CPU kernels stay XLA's ops")
        return None
    try:
        loaded = ctypes.cdll.LoadLibrary(str(build(prefix)))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("the CPU kernels could not be built (%s): XLA's ops are used instead",
                    getattr(e, "stderr", None) or e)
        return None
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu")
    return loaded


def available() -> bool:
    """Whether the library's FFI targets are registered with XLA."""
    return library() is not None
