"""Layer 2, attention: the one KV layout (kv_cache: the pool, its shardings, block moves) and the attention
backends over it (XLA, or the Pallas kernels of pallas_kernels)."""
