"""Layer 6, worker: what runs on the device. The model runner (weights, the pool, warm-up), the jitted step (step)
and its sampler, the step's host inputs (input_batch), the host layer loop, penalty history, and the runner of
several hosts."""
