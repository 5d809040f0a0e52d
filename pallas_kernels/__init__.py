"""Pallas paged-attention kernels (GPU and TPU), each beside a pure-jnp reference. The engine's XLA
reference path lives in jaxpage.attention until the kernels land."""
