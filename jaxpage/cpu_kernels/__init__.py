"""CPU kernels that XLA:CPU cannot match, called through ``jax.ffi``: oneDNN's bfloat16 matmul (onednn.py)."""
