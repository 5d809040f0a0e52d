"""One way to call a CPU kernel (vLLM's CustomOp): an op has a portable form, which every platform runs, and a CPU
form, one of this package's kernels (an FFI call); ``CustomOp.__call__`` is the one place that chooses.

The kernel is taken where its library is built (library.available), the operands are ones it supports (dtypes,
shapes: ``supports``), and, for a kernel that sees its operands whole, the trace runs on one device (no mesh axis
splits them). It then runs under ``lax.platform_dependent``, so a program lowered for a GPU or TPU keeps the
portable form. Each kernel module declares its ops (``rms_norm.RMS_NORM``, ``onednn.DENSE``, ...); the model,
attention and sampler code passes the portable form and the operands."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from jaxpage.cpu_kernels.library import KERNELS, Library, available


def _any(*operands, **params) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class CustomOp:
    name: str
    kernel: Callable  # (*operands, **params) -> the op's result, on a CPU device
    supports: Callable[..., bool] = _any  # (*operands, **params): whether the kernel takes them
    library: Library = KERNELS
    whole_operands: bool = False  # the kernel reads its operands whole: not under a mesh that splits them

    def __call__(self, portable: Callable, *operands, **params):
        """The op on ``operands``: ``kernel(*operands, **params)`` on a CPU device where ``enabled``, else
        ``portable(*operands)`` (which binds any parameters itself)."""
        if not self.enabled(*operands, **params):
            return portable(*operands)
        return jax.lax.platform_dependent(*operands, cpu=functools.partial(self.kernel, **params), default=portable)

    def enabled(self, *operands, **params) -> bool:
        """Whether the kernel may run on these operands (a caller choosing among several platforms' kernels
        asks this, and passes ``self.kernel`` as its CPU branch)."""
        return available(self.library) and not (self.whole_operands and _split()) and self.supports(*operands, **params)


def _split() -> bool:
    """Whether the trace runs under a mesh of more than one device (tensor parallelism), whose operands a kernel
    would see as one device's part only."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1
