"""kvcanary's simulator: a scripted paged KV engine (block pool, prefix cache, chunked prefill,
preemption, offload, aborts, with switches that reproduce known bugs) and its workloads. The tests,
the selftest and the soaks drive the canary with it; it is not an engine adapter (those live in
:mod:`kvcanary.engines`)."""
