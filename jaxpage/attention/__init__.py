"""Layer 2, attention: the one KV layout (kv_cache: the pool and its shardings; block_moves: copies and swaps of
whole blocks) and the attention backends over it (XLA, or the Pallas kernels of pallas_kernels)."""
