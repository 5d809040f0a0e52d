"""Pallas paged-attention kernels (GPU and TPU), each beside a pure-jnp reference with the same signature.

All take the engine's one KV layout, the whole pool plus a layer index (see jaxpage.attention.kv_cache):
- paged_decode_attention_gpu: one query token per sequence, Triton lowering, split-K over pages.
- paged_decode_attention_tpu: the same on TPU (Mosaic): scalar-prefetched tables, one DMA per page.
- ragged_paged_attention_tpu: one kernel pass for a flat mixed batch that also writes the batch's K/V into the pool;
  it also takes the packed layout (pallas_kernels.packed: K and V of head_dim 64 in one 128-lane row), which the
  others refuse.
- write_kv_tpu: that write alone, for the XLA path on TPU (XLA:TPU's scatter would relayout the pool).
The attention kernels also take ``soft_cap`` (a static float: Gemma 2's logit cap) and ``window`` (an int32
scalar, traced or not: a sliding window, 0 for full attention; pages wholly before it are never read).
The engine's own XLA path lives in jaxpage.attention.backends.
"""
from pallas_kernels.decode_attention.gpu import paged_decode_attention_gpu
from pallas_kernels.kv_write.tpu import write_kv_tpu
from pallas_kernels.ragged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_attention.tpu import ragged_paged_attention_tpu
from pallas_kernels.decode_attention.reference import paged_decode_attention_reference
from pallas_kernels.ragged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.decode_attention.tpu import paged_decode_attention_tpu

__all__ = ["paged_decode_attention_gpu", "paged_decode_attention_reference", "paged_decode_attention_tpu",
           "ragged_paged_attention_gpu", "ragged_paged_attention_reference", "ragged_paged_attention_tpu", "write_kv_tpu"]
