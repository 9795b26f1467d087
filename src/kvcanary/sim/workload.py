"""Randomized workloads for the scripted engine: shared prefixes, aborts, preemptions."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvcanary.sim.engine import ScriptedEngine


@dataclass(frozen=True)
class Workload:
    """``requests`` prompts built from ``num_prefixes`` shared prefixes plus a random tail.

    ``abort_p`` and ``preempt_p`` are per-step probabilities of aborting or preempting a random
    running request.
    """

    requests: int = 24
    num_prefixes: int = 3
    prefix_len: tuple[int, int] = (4, 24)
    tail_len: tuple[int, int] = (1, 12)
    max_new: tuple[int, int] = (1, 10)
    abort_p: float = 0.03
    preempt_p: float = 0.05
    arrivals_per_step: int = 2
    seed: int = 0

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request can hold (prompt and generated): an engine's pool must hold
        this many slots for the longest request to run."""
        return self.prefix_len[1] + self.tail_len[1] + self.max_new[1]


def run(engine: ScriptedEngine, wl: Workload, max_steps: int = 100_000, on_step=None) -> int:  # type: ignore[no-untyped-def]
    """Feed ``wl`` to ``engine`` until every request finished or was aborted; returns steps run.

    ``on_step(engine)`` runs after every step (the caller polls its canary there).
    """
    rng = random.Random(wl.seed)
    vocab = engine.spec.vocab
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(*wl.prefix_len))] for _ in range(wl.num_prefixes)]
    pending = [
        rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(*wl.tail_len))]
        for _ in range(wl.requests)
    ]
    steps = idle = 0
    while steps < max_steps:
        for _ in range(wl.arrivals_per_step):
            if pending:
                engine.add_request(pending.pop(), rng.randint(*wl.max_new))
        if engine.running and rng.random() < wl.abort_p:
            engine.abort(rng.choice(engine.running))
        if len(engine.running) > 1 and rng.random() < wl.preempt_p:
            engine.preempt(rng.choice(engine.running))
        did = engine.step()
        steps += 1
        if on_step is not None:
            on_step(engine)
        if did is None and not pending and not engine.waiting and not engine.running:
            break
        idle = idle + 1 if did is None else 0
        if idle > 1000:
            raise RuntimeError(f"scripted engine stalled: {len(engine.waiting)} waiting, {len(engine.running)} running")
    return steps
