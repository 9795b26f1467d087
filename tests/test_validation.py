"""Validation gaps closed: every bad value gets a kvcanary error naming it and what was expected, and
what validation cannot stop (duplicate writes, wrapping table entries with ``validate`` off) is
reported as a violation on both paths."""

import dataclasses
import random

import pytest
import torch

from kvcanary import ByteSource, Canary, CanaryConfig, ConfigError, KvLayout, LayoutError, Step, StepError, checks
from kvcanary import errors as kvcanary_errors
from kvcanary.violations import F_CHECKS, F_ROW, F_SLOT, NUM_COUNTERS, NUM_FIELDS, Check, Counter

from factories import paged_layout, random_step, step_to

NS, BS = 64, 4
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton: interpreted on a CPU


def row_step(cached, new, table, block_size=BS, slots=None):
    """One row: ``cached`` tokens cached, ``new`` new tokens at the next positions, slots from the table."""
    table = torch.tensor(table, dtype=torch.int64).view(1, -1)
    pos = torch.arange(cached, cached + new)
    if slots is None:
        slots = (table[0, pos // block_size] * block_size + pos % block_size).tolist()
    return Step(cached_lens=torch.tensor([cached]), new_offsets=torch.tensor([0, new]),
                new_tokens=torch.tensor([100 + int(p) for p in pos], dtype=torch.int64),
                new_positions=pos, new_slots=torch.tensor(slots, dtype=torch.int64), block_table=table,
                block_size=block_size)


# ---- 1. block table entries outside the pool, without int64 overflow ---------------------------

@pytest.mark.parametrize("entry", [16, -1, 1 + (1 << 62), 1 << 61, -(1 << 63)])
def test_block_entry_outside_the_pool_is_rejected(entry):
    step = row_step(8, 0, [0, entry])
    with pytest.raises(StepError, match=rf"block_table\[0, 1\] \(step row 0\): expected a block in \[0, 15\], "
                                        rf"whose slots stay below num_slots 64 with block_size 4, got {entry}$"):
        step.validate_values(NS)


def test_block_entry_names_the_table_row_and_the_write_range():
    step = row_step(3, 2, [0, 1])  # position 4, written this step, lies in block column 1
    step.table_rows = torch.tensor([1])
    step.block_table = torch.tensor([[0, 1], [2, 99]])
    with pytest.raises(StepError, match=r"block_table\[1, 1\] \(step row 0\): expected a block in \[0, 15\].* got 99"):
        step.validate_values(NS)


def test_only_the_block_entries_the_step_addresses_are_checked():
    row_step(5, 1, [0, 1, 999, -7]).validate_values(NS)  # the row uses columns 0 and 1 only
    s = row_step(5, 1, [999, 1])
    s.read_starts = torch.tensor([4])  # a window: column 0 is not read
    s.validate_values(NS)
    s.read_starts = torch.tensor([3])
    with pytest.raises(StepError, match=r"block_table\[0, 0\] .* got 999"):
        s.validate_values(NS)


def test_a_partial_last_block_is_checked_per_offset():
    row_step(2, 0, [15]).validate_values(62)  # slots 60, 61 of a pool of 62
    with pytest.raises(StepError, match=r"block_table\[0, 0\].*expected a block in \[0, 14\].* got 15"):
        row_step(3, 0, [15]).validate_values(62)  # slot 62 is outside


def _stamped_canary(table, validate=False, backend="torch"):
    canary = Canary(NS, config=CanaryConfig(mode="log", validate=validate, backend=backend))
    canary.after_forward(row_step(0, 8, table))
    assert canary.poll() == []
    return canary


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_entry_that_wraps_int64_is_a_bad_slot_not_a_wrapped_one(backend):
    # (1 + 2**62) * 4 wraps to 4: block 1, which holds exactly what the row expects
    step = row_step(8, 0, [0, 1 + (1 << 62)])
    assert step.lookup(torch.zeros(8, dtype=torch.int64), torch.arange(8)).tolist() == [0, 1, 2, 3] + [-1] * 4
    canary = _stamped_canary([0, 1], backend=backend)
    canary.before_forward(step)
    found = canary.poll()
    assert [(v.checks, v.position) for v in found] == [(Check.BAD_SLOT, p) for p in range(4, 8)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_entry_that_wraps_int64_is_a_write_table_violation(backend):
    canary = _stamped_canary([0, 1], backend=backend)
    step = row_step(8, 1, [0, 1, 2 + (1 << 62)], slots=[8])  # (2 + 2**62) * 4 wraps to 8
    canary.after_forward(step)
    assert [(v.checks, v.slot, v.aux) for v in canary.poll()] == [(Check.WRITE_TABLE, 8, -1)]


# ---- 2. the validation memo sees in-place writes ---------------------------------------------

def good():
    step, _ = random_step(random.Random(0), NS, BS, [(5, 2), (3, 1)])
    return step


def counted(monkeypatch):
    calls = []
    orig = Step.validate_values
    monkeypatch.setattr(Step, "validate_values", lambda self, n: (calls.append(n), orig(self, n)))
    return calls


def test_validate_once_skips_an_unchanged_step(monkeypatch):
    calls = counted(monkeypatch)
    s = good()
    s.validate_once(NS)
    s.validate_once(NS)
    assert calls == [NS]
    s.validate_once(NS + 4)  # another pool
    assert calls == [NS, NS + 4]


@pytest.mark.parametrize("mutate,msg", [
    (lambda s: s.new_slots.__setitem__(0, NS), "new_slots: expected < num_slots 64, got 64 at index 0"),
    (lambda s: s.block_table.__setitem__((0, 1), 1 << 62), r"block_table\[0, 1\] .*got 4611686018427387904"),
    (lambda s: s.cached_lens[1:].fill_(-1), "cached_lens: expected >= 0, got -1 at index 1"),  # through a view
    (lambda s: s.new_offsets.copy_(torch.tensor([0, 3, 2])), "new_offsets increments: expected non-decreasing"),
])
def test_validate_once_sees_an_in_place_write(mutate, msg):
    s = good()
    s.validate_once(NS)
    mutate(s)
    with pytest.raises(StepError, match=msg):
        s.validate_once(NS)


def test_validate_once_sees_an_in_place_write_that_would_index_out_of_the_table():
    s = good()
    s.table_rows = torch.tensor([0, 1])
    s.validate_once(NS)
    s.table_rows[1] = 9  # unvalidated, lookup would fail with a bare IndexError
    with pytest.raises(StepError, match=r"table_rows: expected in \[0, 2\), got 9 at index 1"):
        s.validate_once(NS)


def test_validate_once_sees_a_replaced_tensor():
    s = good()
    s.validate_once(NS)
    s.new_slots = s.new_slots.clone()
    s.new_slots[0] = NS
    with pytest.raises(StepError, match="new_slots: expected < num_slots 64"):
        s.validate_once(NS)


def test_validate_once_always_validates_inference_tensors(monkeypatch):
    calls = counted(monkeypatch)
    with torch.inference_mode():
        s = good()
        s.validate_once(NS)
        s.validate_once(NS)
    assert calls == [NS, NS]  # no version counter to trust


# ---- 3. two tokens writing one slot ------------------------------------------------------------

def dup_step(rows=((0, 3), (0, 3)), same_tokens=False):
    """Rows of fresh sequences over block size 1; row 1's third new token is written to row 0's third
    token's slot, and row 1's table agrees (a double allocation). Returns the step and that slot."""
    tab = torch.arange(len(rows) * 8).view(len(rows), 8)
    offs, toks, poss, slots = [0], [], [], []
    for r, (c, n) in enumerate(rows):
        for p in range(c, c + n):
            toks.append(7 + p if same_tokens else 100 * r + p)
            poss.append(p)
            slots.append(int(tab[r, p]))
        offs.append(len(toks))
    a, b = 2, offs[1] + 2
    slots[b] = slots[a]
    tab[1, poss[b]] = slots[a]
    return Step(cached_lens=torch.tensor([c for c, _ in rows]), new_offsets=torch.tensor(offs),
                new_tokens=torch.tensor(toks), new_positions=torch.tensor(poss), new_slots=torch.tensor(slots),
                block_table=tab, block_size=1), slots[a]


@pytest.mark.parametrize("same_tokens", [False, True])
def test_duplicate_write_is_reported_for_both_tokens_and_leaves_the_slot_unstamped(same_tokens):
    step, slot = dup_step(same_tokens=same_tokens)
    stamps = checks.new_stamps(NS)
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    rows = checks.stamp(stamps, KvLayout(), step, counters, 0)
    assert sorted((int(r[F_ROW]), int(r[F_SLOT]), int(r[F_CHECKS])) for r in rows) == [
        (0, slot, Check.WRITE_DUPLICATE), (1, slot, Check.WRITE_DUPLICATE)]
    assert stamps[slot].tolist() == list(checks.EMPTY_STAMP)
    assert int(counters[Counter.SLOTS_STAMPED]) == step.num_new - 2


def test_duplicate_write_is_recorded_with_validate_off_and_a_later_read_fails():
    canary = Canary(NS, config=CanaryConfig(mode="log", validate=False))
    step, slot = dup_step()
    canary.after_forward(step)
    found = canary.poll()
    assert [(v.row, v.slot) for v in found if Check.WRITE_DUPLICATE in v.checks] == [(0, slot), (1, slot)]
    assert Check.WRITE_DUPLICATE.name in found[0].describe()


def _stamp_both(step, layout, block, rounds=1):
    from kvcanary.kernels import stamp as kstamp
    from kvcanary.kernels._common import source_table

    step = step_to(step, DEV)
    st_t, st_k = checks.new_stamps(NS, DEV), checks.new_stamps(NS, DEV)
    table = source_table(layout, DEV)
    for _ in range(rounds):  # the writer counts must be back at zero after each step
        c_t, c_k = (torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=DEV) for _ in range(2))
        ring = torch.zeros(64, NUM_FIELDS, dtype=torch.int64, device=DEV)
        rows_t = checks.stamp(st_t, layout, step, c_t, 0)
        kstamp.stamp(st_k, table, step, c_k, ring, block=block)
        c_t[Counter.VIOLATIONS] += rows_t.shape[0]
        assert torch.equal(st_t, st_k)
        assert torch.equal(c_t, c_k)
        got = sorted(map(tuple, ring[: int(c_k[Counter.VIOLATIONS])].tolist()))
        assert sorted(map(tuple, rows_t.tolist())) == got
        assert not kstamp.writer_counts(st_k).any()
    return got


@pytest.mark.parametrize("block", [256, 2])  # one block (counted behind a barrier), and across blocks
@pytest.mark.parametrize("same_tokens", [False, True])
def test_triton_duplicate_writes_match_torch(block, same_tokens):
    step, _ = dup_step(rows=((0, 3), (1, 4), (0, 2)), same_tokens=same_tokens)
    got = _stamp_both(step, paged_layout(NS // BS, BS, device=DEV), block, rounds=2)
    assert sum(r[F_CHECKS] & Check.WRITE_DUPLICATE != 0 for r in got) == 2


def test_triton_three_writers_of_one_slot_match_torch():
    step, slot = dup_step()
    step.new_slots[1] = slot  # a third writer, in the first row
    got = _stamp_both(step, KvLayout(), 2)
    assert [r[F_SLOT] for r in got if r[F_CHECKS] & Check.WRITE_DUPLICATE] == [slot] * 3


# ---- 4. layouts whose slots or sources share bytes ----------------------------------------------

def _src(**kw):
    t = kw.pop("tensor", torch.zeros(8, 4, 2, 8, dtype=torch.float16))
    geo = dict(name="k", tensor=t, page_size=4, num_pages=8, page_stride=128, token_stride=32, rows=1,
               row_stride=32, row_bytes=32, offset=0)
    geo.update(kw)
    return ByteSource(**geo)


@pytest.mark.parametrize("kw,msg", [
    (dict(token_stride=0), "source 'k': token_stride: expected > 0 bytes with 4 slots per page .*got 0"),
    (dict(page_stride=0), "source 'k': page_stride: expected > 0 bytes with 8 pages .*got 0"),
    (dict(page_stride=-128), "source 'k': page_stride: expected >= 0 bytes, got -128"),
    (dict(token_stride=-32), "source 'k': token_stride: expected >= 0 bytes, got -32"),
    (dict(rows=2, row_bytes=16, row_stride=-16), "source 'k': row_stride: expected >= 0 bytes, got -16"),
    (dict(rows=2, row_bytes=16, row_stride=0), "source 'k': row_stride: expected > 0 bytes with 2 rows .*got 0"),
])
def test_aliasing_or_negative_strides_are_rejected(kw, msg):
    with pytest.raises(LayoutError, match=msg):
        _src(**kw)


def test_slots_of_one_source_sharing_bytes_are_rejected():
    with pytest.raises(LayoutError, match=r"source 'k': two of its slots or rows both cover byte 16 .*token_stride 16"):
        KvLayout((_src(token_stride=16),))
    with pytest.raises(LayoutError, match=r"source 'k': two of its slots or rows both cover byte 112"):
        KvLayout((_src(page_stride=112),))  # the last slot of a page runs into the next page


def test_overlapping_sources_are_rejected_and_disjoint_ones_pass():
    _disjoint_layouts_over_one_tensor()
    t = torch.zeros(8, 2, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"sources 'k' \(offset 0\) and 'v' \(offset 0\) both cover byte 0"):
        KvLayout.from_tensors([("k", t[:, 0]), ("v", t[:, 0])], page_size=4)
    with pytest.raises(LayoutError, match=r"sources 'k' \(offset 0\) and 'v' \(offset 64\) both cover byte 64"):
        KvLayout((ByteSource.from_tensor("k", t[:, 0], page_size=4),
                  ByteSource.from_tensor("v", t.view(8, 8, 2, 8)[:, 2:6], page_size=4)))  # half into v's page
    flat = torch.zeros(64, 32, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"sources 'a' \(offset 0\) and 'b' \(offset 16\) both cover byte 16"):
        KvLayout((ByteSource.from_tensor("a", flat[:, :16]), ByteSource.from_tensor("b", flat[:, 8:24])))


def _disjoint_layouts_over_one_tensor():
    t = torch.zeros(8, 2, 4, 2, 8, dtype=torch.float16)
    KvLayout.from_tensors([("k", t[:, 0]), ("v", t[:, 1])], page_size=4)  # packed K|V
    flat = torch.zeros(64, 32, dtype=torch.float16)
    KvLayout((ByteSource.from_tensor("a", flat[:, :16]), ByteSource.from_tensor("b", flat[:, 16:])))
    pm = torch.zeros(4, 8, 16, dtype=torch.float16).permute(1, 0, 2)  # page-minor: pages interleave
    KvLayout((ByteSource.from_tensor("k", pm, page_size=4),))
    # transformers' group layout: per block, each layer's K page then its V page, over one tensor
    tpp, layers, row = 4, 3, 32
    cache = torch.zeros(6 * tpp * 2 * layers, row // 2, dtype=torch.float16)
    stride = 2 * layers * tpp
    KvLayout(tuple(ByteSource(name=f"l{i}.{h}", tensor=cache, page_size=tpp, num_pages=6, page_stride=stride * row,
                              token_stride=row, rows=1, row_stride=row, row_bytes=row,
                              offset=(2 * i + hi) * tpp * row)
                   for i in range(layers) for hi, h in enumerate("kv")))


# ---- 5. config fields of the wrong type ----------------------------------------------------------

@pytest.mark.parametrize("kw,msg", [
    (dict(ring_capacity="10"), "ring_capacity: expected an integer >= 1, got str '10'"),
    (dict(ring_capacity=2.5), "ring_capacity: expected an integer >= 1, got float 2.5"),
    (dict(ring_capacity=True), "ring_capacity: expected an integer >= 1, got bool True"),
    (dict(scrub_slots=None), "scrub_slots: expected an integer >= 1, got NoneType None"),
    (dict(scrub_slots=[4]), r"scrub_slots: expected an integer >= 1, got list \[4\]"),
    (dict(history="many"), "history: expected an integer >= 1, got str 'many'"),
    (dict(history=False), "history: expected an integer >= 1, got bool False"),
    (dict(content_budget_bytes=True), "content_budget_bytes: expected an integer >= 0, 'auto' or None, got bool True"),
    (dict(content_budget_bytes=2.5), "content_budget_bytes: expected an integer >= 0, 'auto' or None, got float 2.5"),
    (dict(content_budget_bytes="1024"), "content_budget_bytes: expected .* got str '1024'"),
    (dict(validate=1), "validate: expected True, False or None, got int 1"),
    (dict(validate="off"), "validate: expected True, False or None, got str 'off'"),
])
def test_config_field_of_the_wrong_type(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        CanaryConfig(**kw)


def test_config_from_env_still_parses_and_replace_is_checked():
    env = {"KVCANARY_RING_CAPACITY": "10", "KVCANARY_SCRUB_SLOTS": "7", "KVCANARY_VALIDATE": "off",
           "KVCANARY_CONTENT_BUDGET_BYTES": "2048"}
    cfg = CanaryConfig.from_env(environ=env)
    assert (cfg.ring_capacity, cfg.scrub_slots, cfg.validate, cfg.content_budget_bytes) == (10, 7, False, 2048)
    with pytest.raises(ConfigError, match="KVCANARY_RING_CAPACITY: expected an integer, got '2.5'"):
        CanaryConfig.from_env(environ={"KVCANARY_RING_CAPACITY": "2.5"})
    with pytest.raises(ConfigError, match="history: expected an integer >= 1, got float 2.5"):
        dataclasses.replace(cfg, history=2.5)


# ---- 6. step fields that are not tensors -------------------------------------------------------

def test_step_fields_given_as_lists():
    for field in ("cached_lens", "new_offsets", "new_tokens", "new_positions", "new_slots", "block_table",
                  "row_valid", "expected_tokens", "expected_new_tokens"):
        s = good()
        setattr(s, field, getattr(s, field).tolist())
        with pytest.raises(StepError, match=rf"^{field}: expected a torch.Tensor, got list$"):
            s.validate_shapes()


@pytest.mark.parametrize("bs", [2.0, True, "4"])
def test_block_size_of_the_wrong_type(bs):
    s = good()
    s.block_size = bs
    with pytest.raises(StepError, match=rf"block_size: expected an int, got {type(bs).__name__}"):
        s.validate_shapes()


# ---- 7. the canary's own arguments -------------------------------------------------------------

@pytest.mark.parametrize("num_slots", [1.5, True, "64", 0])
def test_canary_num_slots_of_the_wrong_type_or_range(num_slots):
    with pytest.raises(ConfigError, match=rf"num_slots: expected an integer in 1 \.\. \d+, got {num_slots!r}"):
        Canary(num_slots)  # type: ignore[arg-type]


def test_canary_config_and_layout_of_the_wrong_type():
    with pytest.raises(ConfigError, match=r"config: expected a CanaryConfig, got str 'raise'"):
        Canary(NS, config="raise")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"layout: expected a KvLayout or None, got list"):
        Canary(NS, layout=[])  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_canary_on_cuda_without_cuda():
    with pytest.raises(kvcanary_errors.UnsupportedError, match=r"device: cuda was asked for, but this torch build "
                       r"sees no CUDA device"):
        Canary(NS, device="cuda")


def test_canary_refuses_a_pool_that_cannot_fit_before_allocating():
    with pytest.raises(ConfigError, match=r"num_slots: 1099511627776 slots need 32768\.0 GiB of stamps \(32 bytes a "
                       r"slot\); cpu has [\d.]+ GiB in all"):
        Canary(1 << 40)


@pytest.mark.parametrize("op", ["scrub", "release", "export_stamps", "forget", "import_stamps"])
@pytest.mark.parametrize("slots,msg", [
    (torch.tensor([3, NS]), rf"slots: expected slot ids in \[0, {NS}\), got {NS}"),
    (torch.tensor([-1]), rf"slots: expected slot ids in \[0, {NS}\), got -1"),
    ([1, 2], r"slots: expected a 1-d integer torch.Tensor of slot ids, got list"),
    (torch.zeros(2, 2, dtype=torch.int64), r"slots: expected a 1-d integer tensor, got torch.int64 \(2, 2\)"),
    (torch.tensor([1.0]), r"slots: expected a 1-d integer tensor, got torch.float32 \(1,\)"),
])
def test_canary_slot_arguments_out_of_range_or_of_the_wrong_kind(op, slots, msg):
    canary = Canary(NS, config=CanaryConfig(mode="raise", validate=False))  # checked on a CPU pool even so
    args = (slots, None) if op == "import_stamps" else (slots,)
    with pytest.raises(kvcanary_errors.KvCanaryError, match=msg):
        getattr(canary, op)(*args)
    logged = Canary(NS, config=CanaryConfig(mode="log"))
    getattr(logged, op)(*args)  # log mode: counted, not raised
    assert logged.stats()["internal_errors"] == 1


# ---- 8. steps that are not steps, block sizes that are not the layout's page size ---------------

@pytest.mark.parametrize("op", ["before_forward", "after_forward"])
@pytest.mark.parametrize("step", [None, {"cached_lens": [0]}])
def test_a_step_that_is_not_a_step_is_named(op, step):
    canary = Canary(NS, config=CanaryConfig(mode="raise"))
    with pytest.raises(StepError, match=rf"^step: expected a kvcanary.step.Step, got {type(step).__name__}$"):
        getattr(canary, op)(step)
    logged = Canary(NS, paged_layout(NS // BS, BS), CanaryConfig(mode="log"))
    logged.after_forward(row_step(0, 4, [0]))
    getattr(logged, op)(step)  # log mode: counted, never raised into the engine
    assert logged.stats()["internal_errors"] == 1
    if op == "after_forward":  # which slots the forward wrote cannot be told: every stamp becomes unknown
        assert bool((logged.stamps[:, checks.POSITION] == checks.UNKNOWN_POS).all())


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_a_block_size_other_than_the_layouts_page_size_is_refused(backend, monkeypatch):
    canary = Canary(NS, paged_layout(NS // BS, BS), CanaryConfig(mode="raise", backend=backend))
    step = row_step(0, 4, [0, 1], block_size=2 * BS)
    with pytest.raises(StepError, match=r"^block_size: expected 4 \(the page size of the layout's paged sources\), "
                                        r"got 8: the content checks would read other slots' bytes$"):
        canary.before_forward(step)
    canary.after_forward(row_step(0, 4, [0]))  # the page size: fine
    calls = []
    from kvcanary import step_check

    monkeypatch.setattr(step_check, "check_pages", lambda s, pages: calls.append(s))
    good = row_step(4, 1, [0, 1])
    canary.before_forward(good)
    assert len(calls) == 1  # monkeypatched: counts calls, the real one memoizes in the step


def test_the_page_check_runs_once_per_step_until_a_field_is_assigned():
    canary = Canary(NS, paged_layout(NS // BS, BS), CanaryConfig(mode="raise"))
    step = row_step(0, 4, [0])
    canary.after_forward(step)
    assert step.memo()["pages_ok"] == frozenset({BS})
    step.block_size = 2 * BS  # an assignment drops the memo: checked again
    with pytest.raises(StepError, match="block_size: expected 4"):
        canary.before_forward(step)


def test_tables_of_slot_ids_and_flat_layouts_go_with_any_block_size():
    paged = Canary(NS, paged_layout(NS // BS, BS), CanaryConfig(mode="raise"))
    paged.after_forward(row_step(0, 5, list(range(5)), block_size=1))  # a block table of slot ids
    tokens = row_step(0, 3, [8, 9, 10], block_size=1)
    tokens.slot_table, tokens.block_table = tokens.block_table, None  # a token table
    paged.after_forward(tokens)
    flat = KvLayout.from_tensors([("k", torch.zeros(NS, 16, dtype=torch.uint8))])
    Canary(NS, flat, CanaryConfig(mode="raise")).after_forward(row_step(0, 4, [1], block_size=8))
    none = Canary(NS, paged_layout(NS // BS, BS), CanaryConfig(mode="raise", content="none"))
    none.after_forward(row_step(0, 4, [1], block_size=8))  # metadata only: no bytes are read
    assert paged.poll() == []


# ---- 9. guard slots on a layout without sources ------------------------------------------------

@pytest.mark.parametrize("kw, shown", [(dict(reserved=(0, 1)), r"reserved=\(0, 1\)"),
                                       (dict(guards=(5,)), r"guards=\(5,\)")])
def test_guard_slots_on_a_layout_without_sources_are_refused(kw, shown):
    with pytest.raises(LayoutError, match=rf"^layout: expected sources whose bytes the guard slots are checked in, got "
                                          rf"{shown} on a layout without sources"):
        Canary(NS, KvLayout(**kw), CanaryConfig(mode="log"))


def test_a_metadata_only_canary_keeps_an_adapters_reserved_slots_quiet():
    layout = dataclasses.replace(paged_layout(NS // BS, BS), reserved=tuple(range(BS)))
    canary = Canary(NS, layout, CanaryConfig(mode="raise", content="none"))  # the canary's own choice: no bytes
    assert canary.guard_slots == 0


# ---- 10. values that would crash later, or switch a check off without a word --------------------

def test_a_ring_too_large_is_refused_before_anything_is_allocated():
    from kvcanary import config
    from kvcanary.violations import NUM_FIELDS

    assert config.RING_ROW_BYTES == NUM_FIELDS * 8
    CanaryConfig(ring_capacity=config.MAX_RING_CAPACITY)
    with pytest.raises(ConfigError, match=r"^KVCANARY_RING_CAPACITY: expected an integer in 1 \.\. 1048576, got "
                                          r"1000000000000: the ring is 112 bytes a row .*\(1048576 rows are 112 MiB\)"):
        CanaryConfig.from_env(environ={"KVCANARY_RING_CAPACITY": str(10**12)})
    with pytest.raises(ConfigError, match=r"^ring_capacity: expected an integer in 1 \.\. 1048576, got 1048577"):
        CanaryConfig(ring_capacity=(1 << 20) + 1)


@pytest.mark.parametrize("env, value", [("5", 5.0), ("2", 2.0), ("2.0", 2.0), ("1e3", 1000.0)])
def test_an_audit_tolerance_that_switches_the_audit_off_is_refused_and_points_to_audit_queries(env, value):
    with pytest.raises(ConfigError, match=rf"^KVCANARY_AUDIT_TOLERANCE: expected a number in \(0, 2\) or None, got "
                                          rf"{value!r}: an audited query's error is max \|engine - reference\| / max "
                                          rf"\|V\| .*set audit_queries=0 \(KVCANARY_AUDIT_QUERIES=0\)$"):
        CanaryConfig.from_env(environ={"KVCANARY_AUDIT_TOLERANCE": env})
    with pytest.raises(ConfigError, match=r"^audit_tolerance: expected a number in \(0, 2\)"):
        CanaryConfig(audit_tolerance=value)
    assert CanaryConfig(audit_tolerance=1.99).audit_tolerance == 1.99
    assert CanaryConfig.from_env(environ={"KVCANARY_AUDIT_TOLERANCE": "auto"}).audit_tolerance is None


def test_the_audit_error_of_any_average_of_the_v_rows_read_stays_within_2():
    # the bound the tolerance check rests on: the worst weighting puts the engine's output at -max|V|
    # in the channel where the reference sits at +max|V|
    from kvcanary.audit import reference as audit

    torch.manual_seed(0)
    q, k, v = torch.randn(64, 8), torch.randn(64, 16, 8), torch.randn(64, 16, 8)
    valid = torch.ones(64, 16, dtype=torch.bool)
    ref, vmax, _ = audit.attend(q, k, v, valid, 0.35)
    for _ in range(20):  # engine outputs: any other weights over the same rows, the one-hot extremes included
        w = torch.softmax(torch.randn(64, 16) * 50, dim=1)
        assert float(audit.error(torch.einsum("sl,sld->sd", w, v), ref, vmax).max()) <= 2.0


@pytest.mark.parametrize("where, expected", [
    ("missing/v.jsonl", "expected a file in an existing directory, got {p!r}: directory {d!r} does not exist"),
    (".", "expected a file to append violation events to, got {p!r}, a directory"),
])
def test_a_violations_log_that_cannot_be_written_is_refused_up_front(where, expected, tmp_path):
    path = str(tmp_path / where)
    with pytest.raises(ConfigError) as ei:
        CanaryConfig.from_env(environ={"KVCANARY_VIOLATIONS_LOG": path})
    assert str(ei.value) == "KVCANARY_VIOLATIONS_LOG: " + expected.format(p=path, d=str(tmp_path / "missing"))
    CanaryConfig(violations_log=str(tmp_path / "v.jsonl"))  # a new file in an existing directory: fine


def test_every_config_field_has_its_variable():
    from kvcanary import config

    assert {f for f, _ in config.ENV.values()} == {f.name for f in dataclasses.fields(CanaryConfig)}
    assert CanaryConfig.from_env(environ={"KVCANARY_HISTORY": "50"}).history == 50  # was ignored, with a warning


@pytest.mark.parametrize("argv, expected", [
    (["--blocks", str(10**12)], "argument --blocks: expected an integer in 1 .. 16777216"),
    (["--block-size", str(10**8)], "argument --block-size: expected an integer in 1 .. 1024"),
    (["--layers", str(10**6)], "argument --layers: expected an integer in 1 .. 256"),
    (["--max-new-tokens", "5000"], "argument --max-new-tokens: expected an integer in 1 .. 960"),
])
def test_demo_sizes_past_what_a_demo_can_allocate_are_usage_errors(argv, expected, capsys):
    from kvcanary import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["demo", "--engine", "scripted", *argv])
    assert ei.value.code == 2 and expected in capsys.readouterr().err


def test_a_demo_pool_larger_than_the_machine_is_refused_before_allocating(capsys, monkeypatch):
    from kvcanary import cli
    from kvcanary.demo import common

    monkeypatch.setattr(common, "memory", lambda: 8 << 30)
    assert cli.main(["demo", "--engine", "scripted", "--blocks", str(1 << 24), "--layers", "8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvcanary demo: --blocks: expected a KV pool within half of this machine's 8.0 GiB, got 16777216 blocks x 8 "
        "slots x 568 bytes (K and V of 8 layers and the canary's 56 bytes) = 71.0 GiB")
