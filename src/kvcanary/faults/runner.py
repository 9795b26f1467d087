"""Run fault classes against engines and a clean soak; the results behind ``kvcanary selftest``."""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch

from kvcanary import checks
from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.sim import workload
from kvcanary.sim.engine import ScriptedEngine
from kvcanary.sim.spec import EngineSpec
from kvcanary.engines.base import WORST_OF
from kvcanary.faults.catalog import CATALOG, FaultClass, Outcome, Point
from kvcanary.faults.scripted import INJECTORS
from kvcanary.diagnosis import annotate
from kvcanary.step import Step
from kvcanary.violations import Check, Site, events

log = logging.getLogger("kvcanary")


@dataclass
class FaultResult:
    """One fault class run once on one engine."""

    fault: str
    engine: str
    seed: int
    zoo: list[str]
    expected: str
    detected: bool
    checks_fired: list[str]
    forwards_to_detect: int | None
    max_forwards: int
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)
    first: str | None = None
    injected_at: int | None = None  # the engine step (scripted) or forward (transformers) it landed in
    diagnosis: str | None = None  # the class kvcanary.diagnosis gives the first detecting event
    harmful_reads: int | None = None  # reads of the corrupted slot by a forward before the first report
    harmful_tokens: int | None = None  # tokens sampled from corrupted KV that reached the user (kvcanary.harm)
    missed_without_audit: bool | None = None  # an audit class run again without the audit: nothing found

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quiet() -> Callable[[], None]:
    level = log.level
    log.setLevel(logging.CRITICAL)
    return lambda: log.setLevel(level)


class _Feeder:
    """Keeps a scripted engine busy with long requests over a few shared prefixes."""

    def __init__(self, eng: ScriptedEngine, rng: random.Random) -> None:
        self.eng, self.rng = eng, rng
        bs = eng.spec.block_size
        self.prefixes = [[rng.randrange(eng.spec.vocab) for _ in range(3 * bs)] for _ in range(3)]

    def top_up(self) -> None:
        while len(self.eng.running) + len(self.eng.waiting) < self.eng.spec.max_running:
            tail = [self.rng.randrange(self.eng.spec.vocab) for _ in range(self.rng.randint(1, 6))]
            self.eng.add_request(self.rng.choice(self.prefixes) + tail, self.rng.randint(2, 12))


# the pool of the "default" budget runs: 4 KiB of KV a slot, so the default CPU budgets cover 64 read
# slots a verify and 16 patrol slots a forward (a 12-forward pass over 192 slots)
DEFAULT_BUDGET_SPEC = EngineSpec(num_layers=4, num_kv_heads=4, head_dim=64)


def _reads_of(step: Step, slots: torch.Tensor) -> int:
    """How many of the step's verified reads are of ``slots``."""
    row, idx = checks.rows_of(checks.read_counts(step))
    return int(torch.isin(step.lookup(row, step.starts()[row] + idx), slots).sum())


def run_scripted(fc: FaultClass, seed: int, table: str = "block", layout: str = "paged",
                 base: EngineSpec | None = None) -> FaultResult:
    """Inject ``fc`` once into a busy scripted engine and run until detection or the deadline.

    ``base`` gives the engine's geometry (default :class:`EngineSpec`'s: 48 blocks of 4 slots, or
    :data:`DEFAULT_BUDGET_SPEC` for a class run under the default budgets); its layout, table,
    offload and seed are set from the other arguments and ``fc``. Block 0 is the engine's null
    block (reserved). Under ``fc.budget == "full"`` every read and the whole pool are
    re-fingerprinted each forward; under ``"default"`` the canary has the default configuration
    and the engine drives it as the adapters do (first reads of prefix hits, a patrol share and
    the guards after each forward); ``"default_no_patrol"`` leaves the patrol out.
    """
    full = fc.budget == "full"
    spec = replace(base or (EngineSpec() if full else DEFAULT_BUDGET_SPEC), layout=layout,  # type: ignore[arg-type]
                   table=table, offload=fc.point == Point.TRANSFER, seed=seed,  # type: ignore[arg-type]
                   null_block=True)
    eng = ScriptedEngine(spec)
    config = (CanaryConfig(mode="log", content_budget_bytes=None, scrub_slots=eng.num_slots) if full else
              CanaryConfig(mode="log", patrol_budget_bytes=0 if fc.budget == "default_no_patrol" else "auto"))
    canary = Canary(eng.num_slots, eng.layout, config)
    eng.canary = canary
    rng = random.Random(seed)
    feed = _Feeder(eng, rng)
    restore = _quiet()
    try:
        reads: list[int] = []  # per forward after the fault landed: reads of the corrupted slot

        def count_reads(e: ScriptedEngine, st: Step) -> None:
            if inj is not None and inj.landed and "slot" in inj.detail:
                reads.append(_reads_of(st, torch.tensor([inj.detail["slot"]])))

        eng.hooks.setdefault("before_forward", []).append(count_reads)

        def step() -> list:  # type: ignore[type-arg]
            feed.top_up()
            eng.step()
            if full:
                canary.scrub()
            return canary.poll()

        inj = None

        clean = [v for _ in range(8) for v in step()]
        if clean:
            return _result(fc, "scripted", seed, False, [], None, {"false_positive": clean[0].describe()})
        for _ in range(30):
            inj = INJECTORS[fc.name](eng, rng)
            if inj is not None:
                break
            step()
        if inj is None:
            return _result(fc, "scripted", seed, False, [], None, {"error": "no target for the fault appeared"})
        landed_at = eng.steps if inj.landed else None
        for _ in range(fc.max_forwards + 12):
            found = step()
            if landed_at is None and inj.landed:
                landed_at = eng.steps - (1 if inj.in_forward else 0)
            hits = [v for v in found if v.checks & fc.checks] if landed_at is not None else []
            if hits and landed_at is not None:
                fired = sorted({c.name or "" for v in hits for c in Check if c in v.checks})
                diag = annotate(events(found), canary.writer_of)
                kind = next(e.diagnosis.kind for e in diag if any(v in hits for v in e.violations))
                # reads of this forward were verified before it ran only where a read check caught it
                before = any(v.site in (Site.VERIFY, Site.FIRST_READ) for v in hits)
                harmful = sum(reads[:-1]) + (0 if before or not reads else reads[-1]) if "slot" in inj.detail else None
                return _result(fc, "scripted", seed, True, fired, eng.steps - landed_at, inj.detail, hits[0].describe(),
                               landed_at, kind, harmful)
            if landed_at is not None and eng.steps - landed_at >= fc.max_forwards + 2:
                break
        return _result(fc, "scripted", seed, False, [], None, inj.detail, at=landed_at)
    finally:
        restore()


def _result(fc: FaultClass, engine: str, seed: int, detected: bool, fired: list[str], forwards: int | None,
            detail: dict[str, Any], first: str | None = None, at: int | None = None,
            diagnosis: str | None = None, harmful: int | None = None) -> FaultResult:
    ok = detected and forwards is not None and forwards <= fc.max_forwards
    return FaultResult(fc.name, engine, seed, list(fc.zoo), fc.outcome.value, detected, fired, forwards,
                       fc.max_forwards, ok, detail, first, at, diagnosis, harmful)


# transformers continuous batching: the fault classes its injectors reproduce
CB_FAULTS = {"bit_flip": "flip_shared_byte", "table_redirect": "redirect_table_entry",
             "slot_reused_while_referenced": "free_shared_block", "padding_write_into_reserved": "write_read_trash"}


# the attention-kernel and cache-write classes (kvcanary.faults.transformers_kernel), which need the
# write check or the read audit
KERNEL_FAULTS = {"attention_read_bug": "read_next_page", "kernel_ignores_prefix": "ignore_prefix",
                 "layout_disagreement": "heads_reversed", "quant_scale_mixup": "v_rescaled",
                 "write_lands_zeros": "write_zeros", "window_off_by_one": "window_one_short",
                 "wrong_softmax_scale": "scale_of_one", "transient_scale_error": "transient_scale",
                 "one_off_v_zeros": "one_v_row_zeroed", "intermittent_kernel": "intermittent_scale",
                 "head_zeroed_one_layer": "head_zeroed", "position_shift": "shift_positions"}
# the forward a class is injected at, where not the third: the transient scale error strikes from
# the start; the others after the first forwards' full audits (kvcanary.audit.budget.WARM), where the
# time budget decides how many queries a forward audits
INJECT_AT = {"transient_scale_error": 0, "one_off_v_zeros": 12, "intermittent_kernel": 12,
             "head_zeroed_one_layer": 12}
SLIDING_FAULTS = {"window_off_by_one"}  # run on a model whose layers attend to a window
FULL_AUDIT = 64  # audited queries per forward in the "full" runs: every layer and request of the batch


def transformers_model(fc: FaultClass) -> Any:
    """The tiny model a class runs on in transformers (a window on every layer for the window's classes)."""
    from kvcanary.engines.transformers.models import tiny_model

    return tiny_model(seed=0, layers=2, sliding_window=16 if fc.name in SLIDING_FAULTS else None)


def run_transformers(fc: FaultClass, seed: int, model: Any = None, audit: bool = True) -> FaultResult:
    """Inject the transformers counterpart of ``fc`` into continuous batching of a tiny model.
    A class that needs the audit (``fc.audit``) runs again without it (``audit=False``), where
    nothing must be found."""
    if fc.audit and audit:
        res = _run_transformers(fc, seed, model, False)
        missed = not res.detected and "error" not in res.detail
        out = _run_transformers(fc, seed, model, True)
        out.missed_without_audit = missed
        # the miss is real: the fault changed what the engine generated
        out.detail["output_changed_without_audit"] = res.detail.get("output_changed")
        out.ok = out.ok and missed
        return out
    return _run_transformers(fc, seed, model, audit)


def _run_transformers(fc: FaultClass, seed: int, model: Any, audit: bool) -> FaultResult:
    import torch

    from kvcanary.engines.transformers.entry import protect
    from kvcanary.engines.transformers.models import cb_configs
    from kvcanary.faults.transformers_cb import CbFault

    model = model if model is not None else transformers_model(fc)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(20)]
    gen, cb = cb_configs(max_new_tokens=32 if fc.at_default else 10)
    fault = CbFault({**CB_FAULTS, **KERNEL_FAULTS}[fc.name], at=INJECT_AT.get(fc.name, 3), seed=seed)
    if fc.at_default:  # the default write check and read audit, or neither
        config = CanaryConfig(mode="log", content_budget_bytes=None) if audit else CanaryConfig(
            mode="log", content_budget_bytes=None, write_check=False, audit_queries=0)
    else:
        config = CanaryConfig(mode="log", content_budget_bytes=None, write_check=audit,
                              audit_queries=FULL_AUDIT if audit else 0, audit_every=1)
    restore = _quiet()
    try:
        with torch.inference_mode(), protect(model, config) as guard:
            guard.hooks.append(fault)
            faulty = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    finally:
        restore()
    if fault.injected_at is not None and not audit:  # anything found at all, without the audit
        found = guard.violations
        with torch.inference_mode():
            clean = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        changed = any(clean[k].generated_tokens != faulty[k].generated_tokens for k in clean)
        return _result(fc, "transformers", seed, bool(found), [], None,
                       {**fault.detail, "output_changed": changed,
                        **({"found_without_audit": found[0].describe()} if found else {})})
    if fault.injected_at is None:
        return _result(fc, "transformers", seed, False, [], None, {"error": "no target for the fault appeared"})
    early = [v for v in guard.violations if v.step < fault.injected_at]
    if early:
        return _result(fc, "transformers", seed, False, [], None, {"false_positive": early[0].describe()})
    hits = [v for v in guard.violations if v.checks & fc.checks]
    if not hits or fault.landed_at is None:
        return _result(fc, "transformers", seed, False, [], None, fault.detail)
    fired = sorted({c.name or "" for v in hits if v.step == hits[0].step for c in Check if c in v.checks})
    # a corruption present when forward k's checks run is found by forward k: 1 forward
    res = _result(fc, "transformers", seed, True, fired, hits[0].step - fault.landed_at + 1, fault.detail,
                  guard.describe(hits[0]), fault.landed_at)
    res.harmful_tokens = int(guard.stats().get("harmful_tokens", 0))  # log mode: the reporting forwards' tokens
    return res


def random_spec(rng: random.Random, seed: int) -> EngineSpec:
    """A randomized scripted engine for soaks: layout, table kind, page size, chunking, window,
    padding rows, offload and a null block drawn from ``rng``; at least 96 slots."""
    spec = EngineSpec(num_blocks=rng.choice([16, 24, 48]), block_size=rng.choice([1, 2, 4, 8]),
                      layout=rng.choice(["flat", "paged", "packed", "head_major", "mla"]),  # type: ignore[arg-type]
                      table=rng.choice(["block", "token"]), chunk_size=rng.choice([1, 4, 16]),  # type: ignore[arg-type]
                      window=rng.choice([None, None, 6]), pad_rows=rng.randint(0, 2), offload=rng.random() < 0.5,
                      num_layers=2, seed=seed, null_block=rng.random() < 0.5)
    return EngineSpec(**{**asdict(spec), "num_blocks": max(spec.num_blocks, 96 // spec.block_size)})


def soak(steps: int, seed: int = 0, progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Randomized clean scripted-engine runs (sharing, eviction, preemption, chunked prefill, offload)
    for ``steps`` steps in total; returns the summed canary counters (``violations`` must be 0)."""
    total: dict[str, int] = {}
    done, k = 0, 0
    while done < steps:
        spec = random_spec(random.Random(seed * 1000 + k), k)
        eng = ScriptedEngine(spec)
        canary = Canary(eng.num_slots, eng.layout, CanaryConfig(mode="log", scrub_slots=64))
        eng.canary = canary
        wl = workload.Workload(requests=40, seed=k, abort_p=0.05, preempt_p=0.1)
        n = workload.run(eng, wl, max_steps=steps - done, on_step=lambda e: (canary.scrub(), canary.poll()))
        for key, v in canary.stats().items():
            total[key] = max(total.get(key, 0), v) if key in WORST_OF else total.get(key, 0) + v
        done += n
        k += 1
        if progress is not None:
            progress(done)
    total["soak_steps"] = done
    return total


def detectable() -> list[FaultClass]:
    return [f for f in CATALOG if f.outcome == Outcome.DETECT]
