"""The CPU kernels' shared libraries: built on first use, loaded and registered with XLA as FFI targets.

Two libraries, so that oneDNN is needed only where it is used: ``KERNELS`` (kv_write.cc, gather_rows.cc,
block_moves.cc, paged_attention.cc, lora_delta.cc, greedy_pick.cc, silu_and_mul.cc, rms_norm.cc,
rotary_embedding.cc, threads.cc: plain C++ with OpenMP) and ``ONEDNN`` (onednn_matmul.cc and packed_gemv.cc,
linked against the oneDNN wheels, PyPI ``onednn-cpu-gomp`` and ``onednn-devel-cpu-gomp``). Each is compiled with
the system's C++ compiler and cached per source, JAX (and oneDNN) version and CPU. Where one cannot be built (no
compiler, no oneDNN for ``ONEDNN``), or with ``JAXPAGE_CPU_KERNELS=0`` (both) or ``JAXPAGE_ONEDNN=0``
(``ONEDNN``), ``available(lib)`` is False and its ops keep their portable form (custom_op.CustomOp).
"""
from __future__ import annotations

import ctypes
import dataclasses
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

HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("simd16.h", "prefix_tiles.h", "threads.h", "timed_choice.h"))


@dataclasses.dataclass(frozen=True)
class Library:
    name: str
    sources: tuple[str, ...]
    targets: tuple[tuple[str, str], ...]  # (XLA FFI target, the library's symbol)
    onednn: bool  # compiled against oneDNN's headers and linked to its library


KERNELS = Library("kernels", ("kv_write.cc", "gather_rows.cc", "block_moves.cc", "paged_attention.cc",
                              "lora_delta.cc", "greedy_pick.cc", "silu_and_mul.cc", "rms_norm.cc",
                              "rotary_embedding.cc", "threads.cc"),
                  (("jaxpage_write_kv", "JaxpageWriteKv"), ("jaxpage_gather_rows", "JaxpageGatherRows"),
                   ("jaxpage_take_blocks", "JaxpageTakeBlocks"), ("jaxpage_put_blocks", "JaxpagePutBlocks"),
                   ("jaxpage_paged_attention", "JaxpagePagedAttention"), ("jaxpage_lora_delta", "JaxpageLoraDelta"),
                   ("jaxpage_greedy_pick", "JaxpageGreedyPick"), ("jaxpage_silu_and_mul", "JaxpageSiluAndMul"),
                   ("jaxpage_rms_norm", "JaxpageRmsNorm"), ("jaxpage_fused_add_rms_norm", "JaxpageFusedAddRmsNorm"),
                   ("jaxpage_rotary_embedding", "JaxpageRotaryEmbedding")), onednn=False)
ONEDNN = Library("onednn", ("onednn_matmul.cc", "packed_gemv.cc"),
                 (("jaxpage_onednn_matmul", "JaxpageOnednnMatmul"),), onednn=True)


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


def build(lib: Library, prefix: Path | None) -> Path:
    """Compiles a library once per source, JAX (and oneDNN) version and CPU; returns the shared library's path."""
    sources = tuple(Path(__file__).with_name(name) for name in lib.sources)
    include, flags = jax.ffi.include_dir(), cpu_flags()
    text = b"".join(s.read_bytes() for s in sources + HEADERS)
    key = hashlib.sha256(text + f"{jax.__version__}{prefix}{flags}".encode()).hexdigest()[:16]
    path = cache_dir() / f"libjaxpage_{lib.name}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    onednn = [f"-I{prefix / 'include'}", *map(str, sources), f"-L{prefix / 'lib'}", "-ldnnl",
              f"-Wl,-rpath,{prefix / 'lib'}"] if lib.onednn else list(map(str, sources))
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        command = [os.environ.get("CXX", "g++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-fopenmp",
                   "-fno-math-errno", *(["-march=native"] if flags else []), f"-I{include}", *onednn,
                   "-o", tmp.name]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(tmp.name, path)  # atomic: processes building at once each leave a whole library
        finally:
            Path(tmp.name).unlink(missing_ok=True)
    return path


@functools.cache
def library(lib: Library = KERNELS) -> ctypes.CDLL | None:
    """The library, built, loaded and its targets registered with XLA (once per process); None where it cannot
    be (then its ops keep their portable form)."""
    off = os.environ.get("JAXPAGE_CPU_KERNELS", "1") == "0" or (lib.onednn and os.environ.get("JAXPAGE_ONEDNN") == "0")
    if off or jax.default_backend() != "cpu":
        return None  # a GPU or TPU host never runs them: no build at its first trace
    prefix = onednn_prefix() if lib.onednn else None
    if lib.onednn and prefix is None:
        log.info("oneDNN not installed (the cpu extra): bfloat16 products stay XLA's dots")
        return None
    try:
        loaded = ctypes.cdll.LoadLibrary(str(build(lib, prefix)))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("the CPU kernels (%s) could not be built (%s): their portable forms are used instead", lib.name,
                    getattr(e, "stderr", None) or e)
        return None
    for target, symbol in lib.targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu")
    return loaded


def available(lib: Library = KERNELS) -> bool:
    """Whether the library's FFI targets are registered with XLA."""
    return library(lib) is not None


def ffi_call(target: str, result_shape_dtypes, lib: Library = KERNELS, **kwargs):
    """``jax.ffi.ffi_call`` of one of ``lib``'s targets, the library loaded first (a kernel called directly, not
    through its CustomOp, may be the first use of its library in a process)."""
    library(lib)
    return jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)
