"""The fused path's forward hooks as one compiled call each (:mod:`kvcanary.fused.forward`) leave a
canary exactly as the per-op path does: stamps, counters, violation rows, content cursor, last
writers, the harm ledger, guard state and the patrol walk, over random steps with corruption,
content budgets, guard slots, padding writes and reads of slots the same step writes."""

import dataclasses
import random

import numba
import numpy as np
import pytest
import torch

from kvcanary import Canary, CanaryConfig
from kvcanary.errors import KvCanaryError, StepError
from kvcanary.fused.fold import fold_source

from factories import DEV, clone_step, corrupt, make_layout, prefill_of, random_step

pytestmark = pytest.mark.skipif(DEV.type != "cpu", reason="the fused path runs on CPU pools")


def _twins(layout, n, budget, patrol, validate=None):
    cfg = CanaryConfig(mode="raise", backend="fused", content_budget_bytes=budget, patrol_budget_bytes=patrol,
                       validate=validate)
    fast, slow = Canary(n, layout, cfg), Canary(n, layout, cfg)
    assert fast._fast is not None
    slow._fast = None  # the per-op path: the reference here
    return fast, slow


def _state(c):
    return {
        "stamps": c.stamps.clone(), "counters": c.ring.counters.clone(), "cursor": c.cursor.clone(),
        "rows": c.ring.rows[: min(int(c.ring.counters[1]), c.ring.rows.shape[0])].clone(),
        "writers": c.writers.clone(), "ledger": (c.ledger.at.copy(), c.ledger.before.copy()) if c.ledger else None,
        "guard": [t.clone() for t in (c.guards.base, c.guards.hit, c.guards.was, c.guards.got)],
        "walk": (c.scrub_cursor, c.scrub_passes, list(c.walk.visits), c.walk.walked, c.forwards),
    }


def _same(a, b, where):
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), (where, k)
        elif k == "ledger" and x is not None:
            assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]), (where, k)
        elif k == "guard":
            assert all(torch.equal(p, q) for p, q in zip(x, y)), (where, k)
        else:
            assert x == y, (where, k)


CASES = [(seed, lay, kind) for seed in range(6) for lay in ("paged", "packed", "mixed", "none")
         for kind in ("block", "token")]


@pytest.mark.parametrize("seed,lay,kind", CASES)
def test_the_compiled_forward_hooks_equal_the_per_op_path(seed, lay, kind):
    rng = random.Random(f"fused-forward-{seed}-{lay}-{kind}")
    bs = 16 if kind == "block" else 1
    nb = max(8, 400 // bs)
    n = nb * bs
    layout = make_layout(lay, nb, bs, seed)
    if layout.sources:
        layout = dataclasses.replace(layout, guards=(rng.randrange(n),), reserved=(n - 2,))
    per_slot = layout.content_bytes_per_slot
    budget = rng.choice([None, 0, 7 * per_slot or None])
    # the random steps' tables point at -1 past the reads (the value check refuses them; the ops' parity
    # tests take them as they are): the check's own equality is the test below
    fast, slow = _twins(layout, n, budget, rng.choice([0, 3 * per_slot or 0]), validate=False)
    for forward in range(4):
        lens = [(rng.randint(20, 120), rng.randint(0, 3))] + [(rng.randint(0, 20), rng.randint(0, 30)) for _ in range(2)]
        step, stoks = random_step(rng, n, bs, lens, kind, rng.randint(0, 2), rng.random() < 0.5, rng.choice([None, 5]),
                                   book=rng.random() < 0.5)
        pre = prefill_of(step, stoks)
        if rng.random() < 0.3:  # some reads are of slots this step writes: the Python side finishes
            step.written_from = step.cached_lens.long() - torch.randint(0, 8, (step.num_rows,))
        pad = torch.tensor([rng.randrange(n), -1]) if rng.random() < 0.2 else None
        patrol = rng.random() < 0.8
        for c in (fast, slow):
            c.before_forward(clone_step(pre))
            c.after_forward(clone_step(pre), patrol=True)
        corrupt(rng, fast.stamps, layout, step)
        slow.stamps.copy_(fast.stamps)
        if layout.sources and rng.random() < 0.5:  # a reserved slot's bytes change
            raw = torch.empty(0, dtype=torch.uint8).set_(layout.sources[0].tensor.untyped_storage())
            raw[rng.randrange(raw.numel())] ^= 1
        for c in (fast, slow):
            s = clone_step(step)
            c.before_forward(s)
            c.after_forward(s, pad, patrol=patrol)
        _same(_state(fast), _state(slow), (forward, step.written_from is not None, pad is not None))
        found_fast, found_slow = fast.drain(), slow.drain()
        assert found_fast == found_slow


def test_a_bad_step_is_refused_with_the_same_words():
    rng = random.Random(3)
    layout = make_layout("paged", 16, 16, 0)
    fast, slow = _twins(layout, 256, None, 0)
    step, _ = random_step(rng, 256, 16, [(10, 2)], "block")
    step.new_slots[0] = 999
    errors = []
    for c in (fast, slow):
        with pytest.raises(KvCanaryError) as e:
            c.after_forward(clone_step(step))
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "new_slots" in errors[0] and isinstance(e.value, StepError)


@numba.njit
def _fold_parts(src, runs, keys, slots, lo, hi, acc, cnt):  # type: ignore[no-untyped-def]
    """Sources ``lo`` to ``hi`` of each new slot folded into ``acc`` (an engine's per-layer hook)."""
    for t in range(slots.shape[0]):
        s = slots[t]
        if s >= 0:
            for i in range(lo, hi):
                acc[t] += fold_source(src, runs, keys, i, s)
            cnt[t] += hi - lo


@pytest.mark.parametrize("seed,lay", [(seed, lay) for seed in range(4) for lay in ("paged", "packed", "mixed")])
def test_stamps_from_fingerprints_folded_in_parts_equal_the_stamps_folded_after(seed, lay):
    """The fingerprints an engine folds source by source while each layer writes
    (``after_forward(folded=...)``) give the stamps the canary folds from the cache; a token whose
    fold misses a source is folded from the cache, whatever its partial sum holds."""
    rng = random.Random(f"folded-{seed}-{lay}")
    nb, bs = 25, 16
    n = nb * bs
    layout = make_layout(lay, nb, bs, seed)
    fast, slow = _twins(layout, n, None, 0, validate=False)
    table = fast.table
    nsrc = table.src.shape[0]
    assert nsrc >= 2
    partial = 0
    for forward in range(4):
        lens = [(rng.randint(20, 120), rng.randint(0, 3))] + [(rng.randint(0, 20), rng.randint(0, 30)) for _ in range(2)]
        step, stoks = random_step(rng, n, bs, lens, "block", 0, False, None)
        for s in (step, prefill_of(step, stoks)):
            slots = s.new_slots.numpy().astype(np.int64)
            acc = np.zeros(len(slots), dtype=np.uint64)
            cnt = np.zeros(len(slots), dtype=np.int64)
            cut = rng.randrange(1, nsrc)
            _fold_parts(table.src, table.runs, table.keys, slots, cut, nsrc, acc, cnt)  # the later layers first
            short = np.array([rng.random() < 0.3 for _ in slots])
            _fold_parts(table.src, table.runs, table.keys, np.where(short, -1, slots), 0, cut, acc, cnt)
            acc[short] ^= np.uint64(0x9E3779B97F4A7C15)  # what a missed source leaves is never used
            partial += int(np.count_nonzero(short & (slots >= 0)))
            fast.before_forward(clone_step(s))
            fast.after_forward(clone_step(s), patrol=False, folded=(acc, cnt))
            slow.before_forward(clone_step(s))
            slow.after_forward(clone_step(s), patrol=False)
            _same(_state(fast), _state(slow), forward)
            assert fast.drain() == slow.drain()
    assert partial > 0


def test_a_folded_argument_of_the_wrong_kind_is_refused():
    layout = make_layout("paged", 16, 16, 0)
    fast, _ = _twins(layout, 256, None, 0)
    step, _ = random_step(random.Random(1), 256, 16, [(10, 2)], "block")
    fast.before_forward(clone_step(step))
    with pytest.raises(ValueError, match="folded: expected uint64 and int64"):
        fast._fast.after(fast._described(clone_step(step)), True, 1, True, 0, 0,
                         (np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64)))


def test_the_fold_tables_join_groups_and_refuse_a_layer_outside_its_group():
    from types import SimpleNamespace

    from kvcanary.engines.vllm.fold import Fold, fold_tables

    layout = make_layout("paged", 16, 16, 0)
    a, _ = _twins(layout, 256, None, 0)
    b, _ = _twins(layout, 256, None, 0)
    ga, gb = SimpleNamespace(name="a", canary=a), SimpleNamespace(name="b", canary=b)
    k = a.table.count
    group_of = {"x": ga, "y": gb}
    t = fold_tables([ga, gb], ["x", "y"], group_of, {"x": (0, k), "y": (1, k)})
    assert t.spans.tolist() == [[0, k], [k + 1, 2 * k]] and t.sources == {"a": k, "b": k}
    assert np.array_equal(t.src[k:, 0], b.table.src[:, 0])
    fold = Fold(t, ["a", "b"], 4)
    fold.cnt[:] = [[k, k - 1, k, 0], [k, k, 3, k]]  # tokens folded over all k sources of their group: 5
    assert fold.whole() == int(np.count_nonzero(fold.cnt == np.array([[k], [k]]))) == 5
    fold.cnt[:] = 0
    fold.layer(0)
    fold.layer(1)
    assert fold.layer(0)[-2].shape[1] == 0 and (fold.cnt < 0).all()  # a layer seen twice voids the forward
    assert fold.whole() == 0
    with pytest.raises(ValueError, match="outside group b"):
        fold_tables([ga, gb], ["x", "y"], group_of, {"y": (0, k + 1)})
