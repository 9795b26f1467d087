"""The vLLM adapter's steps (kvcanary.engines.vllm.steps) on stand-in attention metadata, without vLLM:
a sliding window whose freed blocks are handed out again, and speculative decoding's drafts,
acceptance and rollback. The real engine runs are in tests_vllm/."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvcanary import CanaryConfig
from kvcanary.canary import Canary
from kvcanary.engines.token_book import TokenBook
from kvcanary.engines.vllm.groups import plan_groups
from kvcanary.engines.vllm.steps import (Kept, ReqStep, block_slots, build_step, match_rows, read_starts,
                                         rolled_back)
from kvcanary.layout import ByteSource, KvLayout
from kvcanary.violations import Check

BS = 4


class Pool:
    """A paged KV pool whose bytes are a function of (token, position), and a canary over it."""

    def __init__(self, blocks: int = 8) -> None:
        self.kv = torch.zeros(blocks, BS, 2, dtype=torch.int64)
        layout = KvLayout((ByteSource.from_tensor("kv", self.kv, page_size=BS),), reserved=tuple(range(BS)))
        self.canary = Canary(blocks * BS, layout, CanaryConfig(mode="log", content_budget_bytes=None,
                                                               patrol_budget_bytes=0))

    def write(self, slots: list[int], tokens: list[int], positions: list[int]) -> None:
        for s, t, p in zip(slots, tokens, positions):
            self.kv[s // BS, s % BS] = torch.tensor([t, p])


def metadata(table: list[list[int]], seq_lens: list[int], new: list[int]) -> SimpleNamespace:
    """vLLM-shaped attention metadata for rows with these block tables, lengths after the step and
    new-token counts (the slot mapping follows the tables)."""
    qsl = [0]
    slots = []
    for row, (tab, seq, n) in enumerate(zip(table, seq_lens, new)):
        qsl.append(qsl[-1] + n)
        slots += [tab[p // BS] * BS + p % BS for p in range(seq - n, seq)]
    width = max(len(t) for t in table)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in table], dtype=torch.int32)
    return SimpleNamespace(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           slot_mapping=torch.tensor(slots, dtype=torch.int64), block_table=bt,
                           num_actual_tokens=len(slots))


def forward(pool: Pool, book: TokenBook, md: SimpleNamespace, reqs: list[ReqStep], window: int | None,
            written: dict[int, int] | None = None, kept: Kept | None = None) -> list:
    """One forward as the connector runs it: steps (on ``kept``'s buffers where given), rollback
    releases, verify, the engine's writes (``written``: slot -> token actually written, default the
    step's tokens), stamp, drain."""
    for r in reqs:
        if r.tokens:
            book.extend(r.req_id, r.start, r.tokens)
    rows = match_rows(md, reqs, book, kept=kept)
    step = build_step(md, rows, BS, window, kept=kept)
    for _, gone in rolled_back(step, rows, BS):
        pool.canary.release(gone)
    pool.canary.before_forward(step)
    slots, toks, poss = step.new_slots.tolist(), step.new_tokens.tolist(), step.new_positions.tolist()
    if written:
        toks = [written.get(s, t) for s, t in zip(slots, toks)]
    pool.write(slots, toks, poss)
    pool.canary.after_forward(step)
    return pool.canary.drain()


def first_slot(table: list[int], computed: int) -> int:
    return table[computed // BS] * BS + computed % BS


@pytest.mark.parametrize("window", [6, None])
def test_a_sliding_window_verifies_only_what_its_kernel_reads(window):
    """One request decodes past a window of 6 while, like vLLM's sliding-window manager, the engine
    frees every block wholly below the window and hands it straight back for the next positions;
    its block table keeps the stale ids. With the window as read_starts nothing is reported; read
    from position 0 (the adapter before read windows) the stale entries are reported."""
    pool, book = Pool(), TokenBook()
    tokens = [(7 * p + 3) % 50 for p in range(40)]
    table, free = [1, 2], [3, 4, 5, 6, 7]
    computed, found = 0, []
    step_tokens = 8  # the prompt
    while computed + step_tokens <= len(tokens):
        end = computed + step_tokens
        while len(table) * BS < end:
            table.append(free.pop(0))
        skipped = max(0, computed - 6 + 1) // BS  # blocks wholly below the window: freed, reused first
        for b in range(skipped):
            if table[b] not in free and table[b] not in table[skipped:]:
                free.insert(0, table[b])
        req = ReqStep("a", computed, step_tokens, first_slot(table, computed), computed, tokens[computed:end])
        found += forward(pool, book, metadata([table], [end], [step_tokens]), [req], window)
        computed, step_tokens = end, 1
    reused = len(table) > len(set(table))
    assert reused  # a freed block came back for later positions of the same request
    if window is None:
        assert found and Check.POSITION in _checks(found)
    else:
        assert found == [] and pool.canary.stats()["slots_verified"] > 0


def test_read_starts_follow_the_window_and_keep_the_chain_readable():
    cached = torch.tensor([0, 1, 5, 40])
    assert read_starts(cached, None) is None
    assert read_starts(cached, 32).tolist() == [0, 0, 0, 9]
    assert read_starts(cached, 1).tolist() == [0, 0, 4, 39]  # the first new token chains from cached - 1


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_drafts_are_stamped_with_the_tokens_written_and_accepted_ones_verify_as_committed(kept):
    """Speculative decoding: a forward writes the last sampled token and drafts; the first draft is
    accepted, the next rejected. The next forward rolls back, releasing the rejected drafts' slots,
    and reads the accepted draft as a committed token: clean. An engine that keeps ``kept`` of the
    rejected drafts' KV as context (rolls back one slot too few, or not at all) is reported, with
    the request, at exactly those slots."""
    pool, book = Pool(), TokenBook()
    table = [1, 2, 3]
    md = metadata([table], [5], [5])
    assert forward(pool, book, md, [ReqStep("a", 0, 5, first_slot(table, 0), 0, [11, 12, 13, 14, 15])], None) == []
    # sampled 21 (position 5); drafts 31 32 33 at positions 6..8
    req = ReqStep("a", 5, 4, first_slot(table, 5), 5, [21], [31, 32, 33])
    assert forward(pool, book, metadata([table], [9], [4]), [req], None) == []
    assert pool.canary.stamps[[first_slot(table, p) for p in (6, 7, 8)], 0].tolist() == [31, 32, 33]
    # 31 accepted, then 41 sampled at position 7: positions 7, 8 rolled back; drafts 51 52
    req = ReqStep("a", 7, 3, first_slot(table, 7), 6, [31, 41], [51, 52], rollback=9)
    assert forward(pool, book, metadata([table], [10], [3]), [req], None) == []
    assert pool.canary.stats()["slots_verified"] >= 5 + 7
    # 51 rejected: 61 sampled at position 8, positions 8, 9 rolled back; one draft, 71
    req = ReqStep("a", 8, 2, first_slot(table, 8), 8, [61], [71], rollback=10)
    md = metadata([table], [10], [2])
    md.seq_lens[0] += kept  # a faulty engine reads `kept` rejected positions as context
    found = forward(pool, book, md, [req], None)
    if not kept:
        assert found == []
        return
    # the kept positions were released at the rollback; this forward's writes land on them for
    # other positions than the ones the faulty read expects
    assert {v.slot for v in found} >= {first_slot(table, p) for p in range(8, 8 + kept)}
    assert all(v.row == 0 for v in found) and Check.POSITION in _checks(found)


def _checks(found: list) -> set:
    return {c for v in found for c in Check if c in v.checks}


def test_a_draft_of_unknown_id_is_laid_out_as_unknown():
    book = TokenBook()
    book.extend("a", 0, [1, 2, 3])
    md = metadata([[1, 2]], [6], [3])
    rows = match_rows(md, [ReqStep("a", 3, 3, first_slot([1, 2], 3), 3, [], [-1, 9])], book)
    assert rows.unknown_new and rows.new_tokens.tolist() == [-1, -1, 9]  # position 3: not sent
    # the steps read the committed tokens in the book's record, in place
    assert rows.record is book.buf and rows.record[rows.record_rows[0], :6].tolist() == [1, 2, 3, -1, -1, -1]


def test_rows_match_by_first_slot_and_unmatched_rows_are_padding():
    book = TokenBook()
    md = metadata([[1], [2]], [2, 3], [2, 3])
    rows = match_rows(md, [ReqStep("b", 0, 3, 2 * BS, 0, [5, 6, 7])], book)
    assert rows.rids == ["", "b"] and rows.valid.tolist() == [False, True]


def test_block_slots_cover_whole_blocks():
    assert block_slots([0, 2], BS).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def test_groups_are_planned_by_kind_and_state_groups_are_not_covered():
    groups = [SimpleNamespace(kv_cache_spec=SlidingWindowSpec(block_size=32, sliding_window=64), layer_names=["a"]),
              SimpleNamespace(kv_cache_spec=FullAttentionSpec(block_size=32), layer_names=["b"]),
              SimpleNamespace(kv_cache_spec=MambaSpec(block_size=64), layer_names=["c"])]
    plans = plan_groups(SimpleNamespace(kv_cache_groups=groups), SimpleNamespace(speculative_config=None))
    assert [(p.kind, p.window, p.covered) for p in plans] == [("sliding", 64, True), ("full", None, True),
                                                               ("MambaSpec", None, False)]
    assert "not per-token KV" in (plans[2].why_not or "")


def random_batch(seed: int) -> tuple[SimpleNamespace, list[ReqStep], TokenBook, dict[str, list[int]], "random.Random"]:
    """A random batch's metadata, request records, token book and each request's ids as the forward
    knows them: prefill chunks and decodes, drafts (some not filled in), padding rows (no request,
    or none scheduled), KV another connector lands, tokens the book does not hold yet."""
    rng = random.Random(seed)
    nreq = rng.randint(1, 6)
    table, seqs, news, reqs = [], [], [], []
    free = list(range(1, 200))
    rng.shuffle(free)
    book, truth = TokenBook(), {}
    for i in range(nreq):
        computed, new = rng.randint(0, 30), rng.randint(0, 6) if rng.random() < 0.2 else rng.randint(1, 6)
        seq = computed + new
        table.append([free.pop() for _ in range(-(-max(seq, 1) // BS))])
        seqs.append(seq)
        news.append(new)
        toks = [rng.randrange(1000) for _ in range(seq)]
        known = rng.randint(0, seq)
        if rng.random() < 0.8:
            book.extend(f"r{i}", 0, toks[:known])
        else:
            known = 0
        drafts = [rng.choice([rng.randrange(1000), -1]) for _ in range(rng.randint(0, new))] if rng.random() < 0.3 else []
        # each position's id as the forward knows it: committed ones the book holds, then the drafts
        truth[f"r{i}"] = toks[:known] + [-1] * (seq - known)
        truth[f"r{i}"][seq - len(drafts) : seq] = drafts
        landed = rng.randint(0, computed) if rng.random() < 0.2 else -1
        if new and rng.random() < 0.85:  # else: a padding row (no request record for it)
            reqs.append(ReqStep(f"r{i}", computed, new, first_slot(table[i], computed), computed, [], drafts=drafts,
                                landed_from=landed))
    md = metadata(table, seqs, news)
    return md, reqs, book, truth, rng


def assert_steps_equal(x, y) -> None:
    """Every field of two steps equal (tensors by value, as int64)."""
    for f in x.__dataclass_fields__:
        u, v = getattr(x, f), getattr(y, f)
        if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            assert u is not None and v is not None and torch.equal(u.long(), v.long()), (f, u, v)
        else:
            assert u == v, f


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_rows_and_steps_equal_the_torch_construction(seed):
    """match_rows and build_step by compiled loops (kvcanary.engines.vllm.compiled) equal the torch
    construction field for field, on random batches: prefill chunks and decodes, windows, drafts
    (some not filled in), padding rows (no request, or none scheduled), KV another connector lands,
    tokens the book does not hold yet."""
    md, reqs, book, truth, rng = random_batch(seed)
    for window in (None, rng.randint(2, 12)):
        a, b = match_rows(md, reqs, book, fused=True), match_rows(md, reqs, book, fused=False)
        assert a.rids == b.rids and a.reqs == b.reqs and a.unknown_new == b.unknown_new
        assert torch.equal(a.valid, b.valid) and a.record is b.record is book.buf
        assert torch.equal(a.record_rows, b.record_rows) and torch.equal(a.new_tokens, b.new_tokens)
        x, y = build_step(md, a, BS, window, fused=True), build_step(md, b, BS, window, fused=False)
        for i, rid in enumerate(a.rids):  # against the truth: reads see committed ids, writes the drafts too
            if rid:
                c = int(x.cached_lens[i])
                assert x.expected_tokens[x.expected_rows[i], :c].tolist() == [t if t >= 0 else -1 for t in truth[rid][:c]]
                lo, hi = int(x.new_offsets[i]), int(x.new_offsets[i + 1])
                assert x.new_tokens[lo:hi].tolist() == truth[rid][c:], (rid, truth[rid])
        assert_steps_equal(x, y)


@pytest.mark.parametrize("seed", range(12))
def test_the_device_rows_and_steps_equal_the_host_construction_without_a_host_sync(seed):
    """device_rows and device_step (kvcanary.engines.vllm.device_steps) equal match_rows and
    build_step's torch construction field for field, and never read a device value on the host
    (test_no_host_sync's guard). Odd seeds point one row's first read block at a block another
    row writes in the same forward (a prefix-cache hit computed in this forward)."""
    from kvcanary.engines.vllm.device_steps import device_rows, device_step, resolve

    from kvcanary.faults.host_sync import no_host_sync

    md, reqs, book, truth, rng = random_batch(seed)
    if seed % 2 and md.block_table.shape[0] > 1:
        md.block_table[1, 0] = int(md.slot_mapping[0]) // BS if md.num_actual_tokens else 0
    for window in (None, rng.randint(2, 12)):
        host = match_rows(md, reqs, book, fused=False)
        with no_host_sync():
            rows = device_rows(md, reqs, book)
            x = device_step(md, rows, BS, window)
        assert torch.equal(rows.valid, host.valid) and torch.equal(rows.record_rows, host.record_rows)
        assert torch.equal(rows.new_tokens, host.new_tokens) and rows.record is host.record
        got = [rows.order[i].req_id if i >= 0 else "" for i in rows.req.tolist()]
        assert got == host.rids
        y = build_step(md, host, BS, window, fused=False)
        assert_steps_equal(x, y)
        # read back after the forward: the host path's rows, request for request
        back = resolve(rows)
        assert back.rids == host.rids and back.reqs == host.reqs and back.unknown_new == host.unknown_new


class Buffers:
    """vLLM's metadata buffers, kept by its runner and refilled in place: each forward's metadata views
    their first rows (the same addresses forward after forward)."""

    def __init__(self, rows: int = 8, tokens: int = 64, width: int = 32) -> None:
        self.qsl, self.seq = torch.zeros(rows + 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
        self.slots, self.table = torch.zeros(tokens, dtype=torch.int64), torch.zeros(rows, width, dtype=torch.int32)

    def metadata(self, table: list[list[int]], seq_lens: list[int], new: list[int]) -> SimpleNamespace:
        md = metadata(table, seq_lens, new)
        r, n, w = len(table), md.num_actual_tokens, md.block_table.shape[1]
        self.qsl[: r + 1] = md.query_start_loc
        self.seq[:r] = md.seq_lens
        self.slots[:n] = md.slot_mapping
        self.table[:r] = 0
        self.table[:r, :w] = md.block_table
        return SimpleNamespace(query_start_loc=self.qsl[: r + 1], seq_lens=self.seq[:r], slot_mapping=self.slots[:n],
                               block_table=self.table[:r], num_actual_tokens=n)


@pytest.mark.parametrize("seed", range(8))
def test_kept_rows_and_steps_equal_the_torch_construction_forward_after_forward(seed):
    """On a Kept, runs of forwards whose metadata refills the same buffers (decodes; drafts, padding
    rows, requests joining and leaving change the shape now and then) get rows and steps equal to the
    torch construction field for field in two groups (one with a window); the same step object
    while the shape holds, with the last forward's model positions cleared; a new one when it changes."""
    rng = random.Random(seed)
    bufs, book, kept = Buffers(), TokenBook(), Kept()
    free = list(range(1, 250))
    rng.shuffle(free)
    live: dict[str, dict] = {}
    last: dict[int, object] = {}
    shape = None
    reused = 0
    window = rng.randint(2, 12)
    for fwd in range(40):
        if len(live) > 1 and rng.random() < 0.05:  # a request leaves
            live.pop(rng.choice(sorted(live)))
        if not live or rng.random() < 0.06:  # a request joins with its prompt
            toks = [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
            live[f"r{fwd}"] = {"table": [free.pop()], "computed": 0, "toks": toks, "new": len(toks)}
        table, seqs, news, reqs = [], [], [], []
        for rid, q in sorted(live.items()):
            drafts = [rng.randrange(1000) for _ in range(rng.randint(1, 2))] if rng.random() < 0.05 else []
            new = q["new"] + len(drafts)
            seq = q["computed"] + new
            while len(q["table"]) * BS < seq:
                q["table"].append(free.pop())
            table.append(q["table"])
            seqs.append(seq)
            news.append(new)
            if rng.random() < 0.95:  # else: a padding row
                book.extend(rid, 0, q["toks"])
                reqs.append(ReqStep(rid, q["computed"], new, first_slot(q["table"], q["computed"]), 0, [], drafts=drafts))
            q["computed"] = seq - len(drafts)
            q["toks"].append(rng.randrange(1000))
            q["new"] = 1
        md = bufs.metadata(table, seqs, news)
        a = match_rows(md, reqs, book, fused=True, kept=kept)
        b = match_rows(md, reqs, book, fused=False)
        assert a.rids == b.rids and a.unknown_new == b.unknown_new
        assert torch.equal(a.valid, b.valid) and torch.equal(a.record_rows, b.record_rows)
        assert torch.equal(a.new_tokens, b.new_tokens) and a.record is book.buf
        same = shape == (len(table), md.num_actual_tokens)
        shape = (len(table), md.num_actual_tokens)
        for group, w in enumerate((None, window)):
            x = build_step(md, a, BS, w, fused=True, kept=kept, group=group)
            y = build_step(md, b, BS, w, fused=False)
            assert_steps_equal(x, y)
            assert (x is last.get(group)) == same
            reused += same
            last[group] = x
            x.assign_new("expected_new_positions", x.new_positions.clone())  # the model's positions (entry)
    assert reused >= 20  # most forwards ran on the kept steps


def test_a_kept_step_sees_each_forwards_values():
    """Decode forwards on a Kept verify clean; a table entry redirected in place in the metadata's
    buffer (the kept step's view reads it) and a cached token's bytes changed are each reported in
    the forward that reads them."""
    pool, book, bufs, kept = Pool(blocks=16), TokenBook(), Buffers(), Kept()
    tables = {"a": [1, 2, 6], "b": [3, 4, 7]}
    toks = {"a": [5, 6, 7], "b": [8, 9]}
    for rid, t in toks.items():
        md = bufs.metadata([tables[rid]], [len(t)], [len(t)])
        assert forward(pool, book, md, [ReqStep(rid, 0, len(t), first_slot(tables[rid], 0), 0, t)], None,
                       kept=kept) == []
    found = []
    for fwd in range(6):
        reqs, seqs = [], []
        for rid in ("a", "b"):
            c = len(toks[rid])
            toks[rid].append(10 * fwd + len(rid))
            reqs.append(ReqStep(rid, c, 1, first_slot(tables[rid], c), c, toks[rid][c:]))
            seqs.append(c + 1)
        md = bufs.metadata([tables["a"], tables["b"]], seqs, [1, 1])
        if fwd == 3:
            bufs.table[1, 0] = 5  # b's first block redirected to one it never wrote
        if fwd == 5:
            pool.kv[1, 1, 0] += 1  # a's position 1 no longer holds its token
        found.append(forward(pool, book, md, reqs, None, kept=kept))
    assert found[0] == found[1] == found[2] == found[4] == []
    assert found[3] and {v.row for v in found[3]} == {1}
    assert found[5] and {v.slot for v in found[5]} == {1 * BS + 1}
    assert kept.reused == 5  # the decode forwards ran on one kept step
    # a table entry past the pool, written into the kept step's view: refused (values are checked on
    # each use), counted as the canary's own error in log mode, never read
    errors = pool.canary.stats()["internal_errors"]
    c = len(toks["a"])
    md = bufs.metadata([tables["a"], tables["b"]], [c + 1, len(toks["b"]) + 1], [1, 1])
    bufs.table[0, 0] = 10**6
    forward(pool, book, md, [ReqStep("a", c, 1, first_slot(tables["a"], c), c, [99])], None, kept=kept)
    assert kept.reused == 6 and pool.canary.stats()["internal_errors"] > errors
