"""Layer 1, distribution: the tensor-parallel mesh, the shardings of the pool and weights, and the vocabulary
shard the sampler reduces over. Imports only jaxpage's base modules (config, ...)."""
