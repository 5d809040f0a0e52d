"""Speculative decoding (vLLM's spec_decode): proposers of draft tokens, one module per method behind
``proposer.Proposer``, the verification rule of the target's samples, and the acceptance counters."""
