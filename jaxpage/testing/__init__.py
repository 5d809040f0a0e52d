"""Test and benchmark infrastructure: model stand-ins, server launch, workloads, the compile lanes, the step
model and the structure checks. Imported by tests/ and benchmarks/, never by the engine or the server."""
