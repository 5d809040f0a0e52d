"""Layer 5, core (host bookkeeping, vLLM V1's core): the scheduler, the KV block manager and its block pool, and
beam search's step over the scheduler's sequences. Never touches the device."""
