"""Every op's fused CPU and Triton implementations equal the torch reference bit for bit, through the
op table's one signature (:mod:`kvcanary.ops`): stamps, counters, cursor, violation rows.

Randomized over every layout kind, both table kinds, padding rows and tokens, sliding windows,
reads of slots the same step writes, int32 and strided step tensors, content budgets, and
corruption that trips every check. Triton runs under ``TRITON_INTERPRET=1`` without a GPU, on
fewer cases (:mod:`test_kernels` covers its launch shapes).
"""

import dataclasses
import os
import random

import pytest
import torch

from kvcanary import checks, ops
from kvcanary.errors import StepError
from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS, Counter, Site

from factories import DEV, corrupt, make_layout, prefill_of, random_step, step_to

LAYOUTS = ("paged", "packed", "head_major", "partial", "mixed", "vec", "amx", "none")
SEEDS = int(os.environ.get("KVC_PARITY_SEEDS", 2))  # more in a soak: KVC_PARITY_SEEDS=50


def backends():
    out = []
    if DEV.type == "cpu":
        out.append("fused")
    out.append(pytest.param("triton", marks=pytest.mark.triton))
    return out


def step_cases():
    """(backend, block size, table kind, layout): every combination for the fused path, one table
    kind for Triton under the interpreter."""
    out = []
    for b in backends():
        name = b if isinstance(b, str) else b.values[0]
        for bs in (1, 16):
            for kind in ("block", "token"):
                for lay in LAYOUTS:
                    if (bs == 1 and lay in ("vec", "amx")) or (name == "triton" and (bs, kind) != (16, "block")):
                        continue
                    out.append(pytest.param(name, bs, kind, lay, marks=b.marks if name == "triton" else ()))
    return out


def _rows(ring, counters):
    n = int(counters[Counter.VIOLATIONS])
    return sorted(map(tuple, ring[: min(n, ring.shape[0])].cpu().tolist()))


def _zeros():
    return torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=DEV)


def _mangle(step, rng):
    """int32 and strided copies of some of the step's integer tensors (engines hand over both)."""
    for f in step.__dataclass_fields__:
        v = getattr(step, f)
        if not isinstance(v, torch.Tensor) or v.dtype == torch.bool or rng.random() < 0.4:
            continue
        if rng.random() < 0.5:
            v = v.to(torch.int32)
        if rng.random() < 0.5:
            v = torch.stack([v, torch.zeros_like(v)], dim=-1)[..., 0]  # a view with stride 2
        setattr(step, f, v)
    return step


class Pair:
    """The torch reference and one backend on twin pools."""

    def __init__(self, backend, layout, num_slots):
        self.ref, self.impl = ops.load("torch"), ops.load(backend)
        self.t_ref, self.t_impl = ops.prepare("torch", layout, DEV), ops.prepare(backend, layout, DEV)
        self.st_ref = checks.new_stamps(num_slots, DEV)
        self.st_impl = self.st_ref.clone()
        self.ring = torch.zeros(2, 1024, NUM_FIELDS, dtype=torch.int64, device=DEV)

    def run(self, op, *args, pools=True, **kw):
        c = [_zeros(), _zeros()]
        self.ring.zero_()
        for i, (impl, table, st) in enumerate(((self.ref, self.t_ref, self.st_ref),
                                                (self.impl, self.t_impl, self.st_impl))):
            c[i][Counter.STEPS] = 7
            if op == "verify":
                step, cursor, budget, part = args
                impl[op](st, table, step, c[i], cursor[i], budget, self.ring[i], part)
            elif op == "stamp":
                impl[op](st, table, args[0], c[i], self.ring[i], **kw)
            elif op == "scrub":
                impl[op](st, table, args[0], c[i], self.ring[i], args[1])
        assert _rows(self.ring[0], c[0]) == _rows(self.ring[1], c[1])
        assert torch.equal(c[0], c[1]), (c[0].tolist(), c[1].tolist())
        assert torch.equal(self.st_ref, self.st_impl), first_mismatch(self.st_ref, self.st_impl)
        return c[0], _rows(self.ring[0], c[0])


def first_mismatch(a, b):
    bad = (a != b).nonzero()
    return None if not bad.numel() else (tuple(bad[0].tolist()), a[tuple(bad[0])].item(), b[tuple(bad[0])].item())


def _setup(backend, bs, kind, lay, seed):
    rng = random.Random(f"parity-{backend}-{bs}-{kind}-{lay}-{seed}")
    nb = max(8, 400 // bs)
    layout = make_layout(lay, nb, bs, seed)
    lens = [(rng.randint(30, 140), rng.randint(0, 3))] + [(rng.randint(0, 20), rng.randint(0, 40)) for _ in range(2)]
    step, stoks = random_step(rng, nb * bs, bs, lens, kind, rng.randint(0, 2), rng.random() < 0.5,
                              rng.choice([None, 5]), book=rng.random() < 0.5)
    step, pre = step_to(step, DEV), step_to(prefill_of(step, stoks), DEV)
    if rng.random() < 0.3:  # some reads are of slots this step writes: verified in two parts
        step.written_from = step.cached_lens.long() - torch.randint(0, 8, (step.num_rows,), device=DEV)
    return rng, layout, nb * bs, step, pre


def _seeds_for(backend):
    return range(SEEDS if backend == "fused" else 1)


@pytest.mark.parametrize("backend,bs,kind,lay", step_cases())
def test_parity_verify(backend, bs, kind, lay):
    for seed in _seeds_for(backend):
        rng, layout, n, step, pre = _setup(backend, bs, kind, lay, seed)
        pair = Pair(backend, layout, n)
        pair.run("stamp", pre)
        corrupt(rng, pair.st_ref, layout, step)
        pair.st_impl.copy_(pair.st_ref)
        step = _mangle(step, rng)
        for budget in (None, 0, 7):
            for part in (ops.ALL, ops.BEFORE_WRITES, ops.AFTER_WRITES):
                cur = torch.tensor([rng.randrange(50)], device=DEV)
                cursor = [cur.clone(), cur.clone()]
                counters, _ = pair.run("verify", step, cursor, budget, part)
                assert torch.equal(cursor[0], cursor[1])


@pytest.mark.parametrize("backend,bs,kind,lay", step_cases())
def test_parity_stamp(backend, bs, kind, lay):
    for seed in _seeds_for(backend):
        rng, layout, n, step, pre = _setup(backend, bs, kind, lay, seed)
        pair = Pair(backend, layout, n)
        pair.run("stamp", _mangle(pre, rng))
        corrupt(rng, pair.st_ref, layout, step)
        pair.st_impl.copy_(pair.st_ref)
        if rng.random() < 0.5 and step.num_new:
            step.new_positions[rng.randrange(step.num_new)] += 1
        if rng.random() < 0.5 and step.num_new:  # a write outside the pool: reported, never stamped
            step.new_slots[rng.randrange(step.num_new)] = n + rng.randrange(3)
        if rng.random() < 0.3 and step.num_new > 1:  # two tokens to one slot
            i, j = rng.sample(range(step.num_new), 2)
            step.new_slots[i] = step.new_slots[j]
        if rng.random() < 0.5:
            step.expected_new_positions = step.new_positions.clone()
            step.expected_new_positions[rng.randrange(max(1, step.num_new)):] += 1
        pair.run("stamp", _mangle(step, rng), unknown_possible=True)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("lay", LAYOUTS)
def test_parity_content(backend, lay):
    for seed in _seeds_for(backend):
        layout = make_layout(lay, 9, 16, seed)
        g = torch.Generator().manual_seed(seed)
        slots = torch.randperm(9 * 16, generator=g)[:37].to(DEV)  # a prime count
        slots[5], slots[6] = -1, 9 * 16  # outside the pool: 0
        out = []
        for backend_name in ("torch", backend):
            o = torch.full((37,), 5, dtype=torch.int64, device=DEV)
            ops.load(backend_name)["content"](slots.to(torch.int32) if seed % 2 else slots,
                                              ops.prepare(backend_name, layout, DEV), 9 * 16, o)
            out.append(o)
        assert torch.equal(out[0], out[1]), first_mismatch(out[0], out[1])
        assert int(out[0][5]) == int(out[0][6]) == 0 and (lay == "none" or bool((out[0][:5] != 0).all()))


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("lay", LAYOUTS)
def test_parity_scrub(backend, lay):
    for seed in _seeds_for(backend):
        rng, layout, n, step, pre = _setup(backend, 16, "block", lay, seed)
        pair = Pair(backend, layout, n)
        pair.run("stamp", pre)
        corrupt(rng, pair.st_ref, layout, step)
        pair.st_impl.copy_(pair.st_ref)
        slots = torch.tensor(rng.sample(range(n), min(n, 200)) + [-1, n], device=DEV)
        for site in (Site.SCRUB, Site.TRANSFER):
            counters, _ = pair.run("scrub", slots.to(torch.int32) if rng.random() < 0.5 else slots, site)
            assert counters[Counter.SLOTS_SCRUBBED] > 0


def test_fused_validation_accepts_what_torch_accepts():
    """The fused step check refuses exactly the steps the torch check refuses, with its message."""
    from kvcanary.fused import steps as fused

    rng = random.Random(11)
    refused = 0
    for i in range(300):
        bs = rng.choice([1, 4, 16])
        _, _, n, step, _ = _setup("fused", bs, rng.choice(["block", "token"]), "none", i)
        field = rng.choice(["cached_lens", "new_offsets", "new_slots", "new_positions", "table", "read_starts",
                            "table_rows", "expected_rows"])
        if field == "read_starts":
            step.read_starts = (step.cached_lens - rng.randint(-2, 6)).clamp_min(rng.choice([-1, 0]))
        elif field == "table_rows":
            step.table_rows = torch.tensor([rng.randint(-1, step.table.shape[0]) for _ in range(step.num_rows)])
        elif field == "expected_rows":
            n_exp = step.expected_tokens.shape[0]
            step.expected_rows = torch.tensor([rng.randint(-1 if rng.random() < 0.3 else 0, n_exp - (rng.random() < 0.7))
                                               for _ in range(step.num_rows)])
        else:
            t = step.table if field == "table" else getattr(step, field)
            if t.numel():
                t.view(-1)[rng.randrange(t.numel())] += rng.choice([-200, -1, 1, n])
        step = _mangle(step, rng)
        step.validate_shapes()
        try:
            step.validate_values(n)
            want = None
        except StepError as e:
            want = str(e)
        try:
            fused.validate(step, n)
            got = None
        except StepError as e:
            got = str(e)
        assert got == want, (i, field)
        refused += want is not None
    assert 60 < refused < 290  # both kinds of step were tried


def test_every_op_has_three_implementations_a_parity_test_and_a_benchmark():
    import importlib.util
    import pathlib

    for name, op in ops.OPS.items():
        assert set(op.impls) == set(ops.BACKENDS), name
        for b in ops.BACKENDS:
            assert callable(op.impl(b)), (name, b)
        assert callable(globals().get(f"test_parity_{name}")), f"no parity test for op {name}"
    path = pathlib.Path(__file__).parents[1] / "bench" / "ops.py"
    spec = importlib.util.spec_from_file_location("bench_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert set(mod.CASES) == set(ops.OPS), "bench/ops.py times every op of the table"


def test_without_numba_the_cpu_backend_is_torch_and_asking_for_fused_is_refused(monkeypatch, caplog):
    from kvcanary import Canary, CanaryConfig, UnsupportedError
    from kvcanary import fused

    monkeypatch.setattr(fused, "_why", ["ModuleNotFoundError: No module named 'numba'"])
    with caplog.at_level("WARNING", logger="kvcanary"):
        assert Canary(8).backend == "torch"
    assert "fused CPU path is unavailable (ModuleNotFoundError" in caplog.text
    with pytest.raises(UnsupportedError, match="backend 'fused' needs numba: ModuleNotFoundError"):
        Canary(8, config=CanaryConfig(backend="fused"))


def test_fused_written_from_equals_the_torch_construction():
    """Where each row's reads of this step's own writes start (vLLM hands out a prefix-cache hit
    before its KV exists), on random steps where some new tokens write slots other rows read, half
    of them with read windows (a write below a row's window is not a read of it)."""
    from kvcanary.engines.block_table import written_from

    rng = random.Random(5)
    hits = 0
    for i in range(120):
        bs = rng.choice([1, 4, 16])
        _, _, n, step, _ = _setup("fused", bs, rng.choice(["block", "token"]), "none", i)
        for _ in range(rng.randint(0, 3)):  # a new token writes a slot some row reads
            if step.num_new:
                r = rng.randrange(step.num_rows)
                c = int(step.cached_lens[r])
                if c:
                    step.new_slots[rng.randrange(step.num_new)] = step.lookup(torch.tensor([r]),
                                                                             torch.tensor([rng.randrange(c)]))[0]
        step = _mangle(step, rng)
        if i % 2:  # a read window (sliding attention): reads and written_from start there
            cached = step.cached_lens.long()
            lo = (cached - torch.randint(1, 9, cached.shape, device=cached.device)).clamp(min=0)
            step = dataclasses.replace(step, read_starts=torch.minimum(lo, cached))
        want, got = written_from(step, fused=False), written_from(step, fused=True)
        assert torch.equal(want, got), (i, want.tolist(), got.tolist())
        hits += int((want < step.cached_lens.long()).sum())
    assert hits > 30  # the runs had rows whose reads this step writes
