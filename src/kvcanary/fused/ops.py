"""The fused CPU implementation of each step op (verify, stamp, their seeds): one compiled
loop over the step's rows and slots, bit for bit the torch reference (:mod:`kvcanary.checks`),
writing violation rows straight into the canary's ring and bumping its counters in place, as the
Triton kernels do. The loops over cold cache (scrub, guard, content) are in :mod:`kvcanary.fused.scrub`,
the step's value check in :mod:`kvcanary.fused.steps`.

Each loop runs on the calling thread (no thread pool of its own, so it never competes with the
engine's), allocates nothing per read slot (the stamp op keeps a few words per written slot to
find duplicate writes) and reads only the step fields an op needs.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.checks import EMPTY_POS, SEED_GIVEN, SEED_STORED, SEED_UNKNOWN, UNKNOWN_POS
from kvcanary.fused._core import JIT, SEED, finish_content, g_term, ld, ld_i64, link_next, prefetch, st_i64
from kvcanary.fused.fold import SourceTable, fold_slot, fold_slots
from kvcanary.fused._step import (CL, ENP, ENT, ET, NNEW, NO, NP, NROWS, NS, NT, WF, bump, checked_out,
                                  describe, expected_row, lookup, rd, rd2, record, ring_args, start, table_row,
                                  valid)
from kvcanary.fused._step import _LIM, TAB, BSIZE, IS_BLOCK, SPAN
from kvcanary.fused.cache import njit
from kvcanary.step import Step
from kvcanary.violations import Check, Counter, Site

_B = np.uint64(0x9E3779B97F4A7C15)
_STEPS = int(Counter.STEPS)
_C_POS, _C_LINK, _C_TOK, _C_CONT = int(Check.POSITION), int(Check.LINK), int(Check.TOKEN), int(Check.CONTENT)
_C_EMPTY, _C_BAD = int(Check.EMPTY), int(Check.BAD_SLOT)
_C_WPOS, _C_WTAB, _C_WTOK = int(Check.WRITE_POSITION), int(Check.WRITE_TABLE), int(Check.WRITE_INPUT_TOKEN)
_C_WEPOS, _C_DUP = int(Check.WRITE_INPUT_POSITION), int(Check.WRITE_DUPLICATE)
_K_VER, _K_LINKS, _K_UNLINKED = int(Counter.SLOTS_VERIFIED), int(Counter.LINKS_CHECKED), int(Counter.LINKS_UNCHECKED)
_K_CSLOTS, _K_CSKIP = int(Counter.CONTENT_SLOTS_VERIFIED), int(Counter.CONTENT_SLOTS_SKIPPED)
_K_CBYTES, _K_UNVER = int(Counter.CONTENT_BYTES_VERIFIED), int(Counter.SLOTS_UNVERIFIABLE)
_K_STAMPED, _K_SBYTES = int(Counter.SLOTS_STAMPED), int(Counter.CONTENT_BYTES_STAMPED)
_SITE_VERIFY, _SITE_WRITE = int(Site.VERIFY), int(Site.WRITE)
ALL, BEFORE_WRITES, AFTER_WRITES = 0, 1, 2  # which reads verify takes (Step.split_reads)


@njit(inline="always", **JIT)
def _range(d, r, part):  # type: ignore[no-untyped-def]
    """The positions ``[lo, hi)`` row ``r`` reads in ``part`` (empty for a padding row)."""
    if not valid(d, r):
        return 0, 0
    lo = start(d, r)
    hi = rd(d, CL, r)
    if part != ALL and d[WF] != 0:
        e = min(max(rd(d, WF, r), lo), hi)
        if part == BEFORE_WRITES:
            hi = e
        else:
            lo = e
    return lo, max(hi, lo)


_AHEAD, _AHEAD_BLOCKS = 16, 2  # how far ahead verify fetches stamps: slots (slot tables), blocks


@njit(inline="always", **JIT)
def _fetch_block(stamps, num_slots, row, tesz, tcs, col, span, bs, lim):  # type: ignore[no-untyped-def]
    """Fetch the stamps of block column ``col`` of a block table row early (up to 1 KiB of them: the
    hardware carries a longer run on)."""
    if col * bs < span:
        e = ld(row, tesz, col * tcs)
        if 0 <= e <= lim and e * bs < num_slots:
            first = stamps + 32 * e * bs
            for a in range(0, min(32 * bs, 1024), 64):
                prefetch(first + a)


@njit(inline="always", **JIT)
def _window(d, part, num_slots, src, runs, keys, cur, k, n):  # type: ignore[no-untyped-def]
    """The content fingerprints of the verify window: the ``k`` read entries from entry ``cur`` on
    (mod ``n``, the reads in the order :func:`_verify` walks them), the ``j``-th at ``[j]`` (0: an
    entry without a slot), folded by :func:`~kvcanary.fused.fold.fold_slots` (the window's slots
    are mostly neighbours in a page)."""
    nrows = d[NROWS]
    first = np.zeros(nrows + 1, dtype=np.int64)  # the rows' first entries (and the end)
    lows = np.zeros(max(nrows, 1), dtype=np.int64)
    for r in range(nrows):
        lo, hi = _range(d, r, part)
        lows[r] = lo
        first[r + 1] = first[r] + hi - lo
    slots = np.full(k, -1, dtype=np.int64)
    r = 0
    e = cur  # (cur + j) mod n, counted along
    for j in range(k):
        if e < first[r]:  # wrapped round to the first entry
            r = 0
        while e >= first[r + 1]:
            r += 1
        s = lookup(d, r, lows[r] + e - first[r])
        if 0 <= s < num_slots:
            slots[j] = s
        e += 1
        if e == n:
            e = 0
    return fold_slots(src, runs, keys, slots, k)


@njit(**JIT)
def _verify(d, stamps, num_slots, src, runs, keys, counters, cursor, content_slots, ring, cap, bps, part, led_at,  # type: ignore[no-untyped-def]
            led_before, forward):
    """Verify the reads of ``part``; with a ledger (``led_at`` non-empty: the canary's
    :class:`~kvcanary.harm.CheckLedger` arrays) and a content budget, the read entries of the content
    window are marked as fingerprinted at ``forward``, as :meth:`CheckLedger.window` takes them."""
    nrows = d[NROWS]
    n = 0
    for r in range(nrows):
        lo, hi = _range(d, r, part)
        n += hi - lo
    has_content = src.shape[0] > 0 and n > 0
    cur = 0
    k = n
    if has_content:
        cur = ld_i64(cursor) % n
        if content_slots >= 0:
            k = min(content_slots, n)
    conts = _window(d, part, num_slots, src, runs, keys, cur, k, n) if has_content else np.zeros(0, dtype=np.int64)
    step_id = ld_i64(counters + 8 * _STEPS)
    has_et = d[ET] != 0
    et_w = d[ET + 5]
    mark = led_at.shape[0] > 0 and content_slots > 0 and n > 0
    # the table's and expected tokens' descriptors in locals: the loop stores through raw addresses,
    # which the compiler cannot tell apart from the descriptor, so it would load these again per slot
    tab, tesz, trs, tcs = d[TAB], d[TAB + 1], d[TAB + 2], d[TAB + 3]
    et, eesz, ers, ecs = d[ET], d[ET + 1], d[ET + 2], d[ET + 3]
    span, is_block, bs = d[SPAN], d[IS_BLOCK] != 0, d[BSIZE]
    lim = _LIM // bs
    # the read entry's place in the content window, (e - cur) mod n for the e-th entry, kept as a running
    # count (a division per slot is dozens of cycles, thousands of slots a forward)
    w = (n - cur) % n if n > 0 else 0
    nlinked = nreadable = nunknown = nsel = 0
    for r in range(nrows):
        lo, hi = _range(d, r, part)
        bad_p = unknown_p = False
        link_p = slot_p = np.int64(0)
        t = table_row(d, r)
        row = tab + t * trs * tesz
        et_row = et + expected_row(d, r) * ers * eesz
        col = np.int64(-1)  # the block column of ``pos`` (-1: not reached yet), ``off`` its offset in it
        off = np.int64(0)
        entry = np.int64(0)
        for pos in range(lo, hi):
            # lookup(d, r, pos): positions are consecutive, so the block column and offset move with
            # them (no division per slot); the stamps a few slots or blocks ahead are fetched early
            # (blocks lie anywhere in the pool: each one's first stamp would be a wait on memory)
            slot = np.int64(-1)
            if t >= 0 and 0 <= pos < span:
                if not is_block:
                    slot = ld(row, tesz, pos * tcs)
                    if pos + _AHEAD < hi and pos + _AHEAD < span:
                        ahead = ld(row, tesz, (pos + _AHEAD) * tcs)
                        if 0 <= ahead < num_slots:
                            prefetch(stamps + 32 * ahead)
                else:
                    if col < 0 or off == bs:
                        if col < 0:
                            col = pos // bs
                            off = pos - col * bs
                        else:
                            col += 1
                            off = 0  # type: ignore[assignment]
                        entry = ld(row, tesz, col * tcs)
                        _fetch_block(stamps, num_slots, row, tesz, tcs, col + _AHEAD_BLOCKS, span, bs, lim)
                    if -lim <= entry <= lim:
                        slot = entry * bs + off
                    off += 1
            bad = slot < 0 or slot >= num_slots
            sa = stamps + 32 * (0 if bad else slot)
            s_tok, s_pos, s_link, s_cont = ld_i64(sa), ld_i64(sa + 8), ld_i64(sa + 16), ld_i64(sa + 24)
            empty = s_pos == EMPTY_POS and not bad
            unknown = s_pos == UNKNOWN_POS and not bad
            readable = not (bad or empty or unknown)
            has_pred = pos > lo
            linked = readable and (pos == 0 or (has_pred and not bad_p and not unknown_p))
            exp_link = np.int64(0)
            if linked:
                exp_link = link_next(SEED if pos == 0 else link_p, s_tok, s_pos)
            checks = 0
            if bad:
                checks |= _C_BAD
            if empty:
                checks |= _C_EMPTY
            if readable and s_pos != pos:
                checks |= _C_POS
            if linked and s_link != exp_link:
                checks |= _C_LINK
            exp_tok = -1
            if has_et:
                if pos < et_w:
                    exp_tok = ld(et_row, eesz, pos * ecs)
                if readable and exp_tok != -1 and s_tok != exp_tok:
                    checks |= _C_TOK
            if mark and w < k and not bad:
                mark_checked(led_at, led_before, slot, forward)
            exp_cont = np.int64(0)
            if has_content and readable and w < k:
                exp_cont = conts[w]
                nsel += 1
                if s_cont != exp_cont:
                    checks |= _C_CONT
            if checks:
                record(counters, ring, cap, _SITE_VERIFY, checks, step_id, r, slot, pos, exp_tok, s_tok, s_pos,
                       exp_link, s_link, exp_cont, s_cont, slot_p if has_pred else -1)
            nlinked += linked
            nreadable += readable
            nunknown += unknown
            bad_p, unknown_p, link_p, slot_p = bad, unknown, s_link, slot  # type: ignore[assignment]
            w += 1
            if w == n:
                w = 0
    if has_content:
        bump(counters, _K_CSLOTS, nsel)
        bump(counters, _K_CSKIP, n - k)
        bump(counters, _K_CBYTES, nsel * bps)
        st_i64(cursor, ld_i64(cursor) + k)
    bump(counters, _K_VER, n)
    bump(counters, _K_LINKS, nlinked)
    bump(counters, _K_UNLINKED, nreadable - nlinked)
    bump(counters, _K_UNVER, nunknown)
    return n


@njit(inline="always", **JIT)
def _prefix_link(d, r, n):  # type: ignore[no-untyped-def]
    """The link of position ``n - 1`` from the row's expected tokens, and whether all were known."""
    link = np.uint64(0)
    er = expected_row(d, r)
    for p in range(n):
        t = rd2(d, ET, er, p)
        if t < 0:
            return np.int64(0), False
        g = g_term(t, p)
        link = (np.uint64(SEED) * _B + g) if p == 0 else link * _B + g
    return np.int64(link), True


@njit(**JIT)
def _seeds(d, stamps, num_slots, seed, mode):  # type: ignore[no-untyped-def]
    """:func:`kvcanary.checks.canonical_seeds`, into ``seed`` and ``mode`` (int64 ``[R]``)."""
    for r in range(d[NROWS]):
        cached = rd(d, CL, r)
        ps = lookup(d, r, cached - 1)
        inside = 0 <= ps < num_slots
        pa = stamps + 32 * (ps if inside else 0)
        unknown = cached > 0 and inside and ld_i64(pa + 8) == UNKNOWN_POS and valid(d, r)
        seed[r] = (ld_i64(pa + 16) if inside else 0) if cached > 0 else SEED
        mode[r] = SEED_STORED
        if unknown:
            mode[r] = SEED_UNKNOWN
            if d[ET] != 0:
                n = min(cached, d[ET + 5])
                link, known = _prefix_link(d, r, n)
                if known and n == cached:
                    seed[r], mode[r] = link, SEED_GIVEN


@njit(**JIT)
def _stamp(d, stamps, num_slots, src, runs, keys, counters, ring, cap, bps, seed, mode, pre_acc,
           pre_cnt):  # type: ignore[no-untyped-def]
    """Stamp the step's writes and check them. ``pre_acc[t]`` and ``pre_cnt[t]``: new token ``t``'s
    fingerprint already folded over ``pre_cnt[t]`` of the sources (unfinished, see
    :func:`kvcanary.fused.fold.fold_source`); where that is all of them it is the token's content,
    else the slot is folded here (empty arrays: every slot is)."""
    nrows, nnew = d[NROWS], d[NNEW]
    npre = pre_cnt.shape[0]
    nsrc = src.shape[0]
    step_id = ld_i64(counters + 8 * _STEPS)
    has_src = src.shape[0] > 0
    # the written slots, to find two writes to one slot before any stamp lands
    w_tok = np.empty(nnew, dtype=np.int64)
    w_slot = np.empty(nnew, dtype=np.int64)
    nw = 0
    for r in range(nrows):
        ok = valid(d, r)
        o0, o1 = rd(d, NO, r), rd(d, NO, r + 1)
        for t in range(o0, o1):
            slot = rd(d, NS, t)
            if ok and 0 <= slot < num_slots:
                w_tok[nw] = t
                w_slot[nw] = slot
                nw += 1
    order = np.argsort(w_slot[:nw], kind="mergesort")
    dup = np.zeros(nnew, dtype=np.bool_)
    for i in range(1, nw):
        a, b = order[i - 1], order[i]
        if w_slot[a] == w_slot[b]:
            dup[w_tok[a]] = True
            dup[w_tok[b]] = True
    nkept = 0
    for r in range(nrows):
        ok = valid(d, r)
        cached = rd(d, CL, r)
        lost = mode[r] == SEED_UNKNOWN
        o0, o1 = rd(d, NO, r), rd(d, NO, r + 1)
        link = np.uint64(0)
        for t in range(o0, o1):
            j = t - o0
            tok, pos, slot = rd(d, NT, t), rd(d, NP, t), rd(d, NS, t)
            g = g_term(tok, pos)
            link = (np.uint64(seed[r]) * _B + g) if j == 0 else link * _B + g
            if not (ok and slot >= 0):
                continue  # padding: advances the chain, writes nothing
            exp_pos = cached + j
            stamped = slot < num_slots
            checks = 0
            if pos != exp_pos:
                checks |= _C_WPOS
            table_slot = lookup(d, r, exp_pos)
            if table_slot != slot:
                checks |= _C_WTAB
            if not stamped:
                checks |= _C_BAD
            exp_tok = -1
            if d[ENT] != 0:
                exp_tok = rd(d, ENT, t)
                if exp_tok != -1 and tok != exp_tok:
                    checks |= _C_WTOK
            if d[ENP] != 0 and pos != rd(d, ENP, t):
                checks |= _C_WEPOS
            content = np.int64(0)
            if stamped:
                if has_src:
                    if t < npre and pre_cnt[t] == nsrc:
                        content = finish_content(pre_acc[t])
                    else:
                        content = fold_slot(src, runs, keys, slot)
                sa = stamps + 32 * slot
                if dup[t]:
                    checks |= _C_DUP
                    st_i64(sa, -1)
                    st_i64(sa + 8, EMPTY_POS)
                    st_i64(sa + 16, 0)
                    st_i64(sa + 24, 0)
                elif lost:
                    st_i64(sa, -1)
                    st_i64(sa + 8, UNKNOWN_POS)
                    st_i64(sa + 16, 0)
                    st_i64(sa + 24, 0)
                else:
                    st_i64(sa, tok)
                    st_i64(sa + 8, pos)
                    st_i64(sa + 16, np.int64(link))
                    st_i64(sa + 24, content)
                    nkept += 1
            if checks:
                record(counters, ring, cap, _SITE_WRITE, checks, step_id, r, slot, exp_pos, exp_tok, tok, pos, 0,
                       np.int64(link), 0, content, table_slot)
    bump(counters, _K_STAMPED, nkept)
    bump(counters, _K_SBYTES, nkept * bps)


@njit(inline="always", **JIT)
def mark_checked(led_at, led_before, s, forward):  # type: ignore[no-untyped-def]
    """:meth:`kvcanary.harm.CheckLedger.mark` of one slot in the pool."""
    if led_at[s] != forward:
        led_before[s] = led_at[s]
        led_at[s] = forward


# ---- the Python side: descriptors in, the compiled loop, nothing else --------------------------


_NO_LEDGER = np.zeros(0, dtype=np.int64)
_NO_FOLD = np.zeros(0, dtype=np.uint64)  # no token's fingerprint folded before the stamp


def verify(stamps: torch.Tensor, src: SourceTable, step: Step, counters: torch.Tensor, cursor: torch.Tensor,
           content_slots: int | None, ring: torch.Tensor, part: int = ALL) -> int:
    """Verify the reads of ``step`` (``part``: all, or those before / after this step's writes, as
    :meth:`~kvcanary.step.Step.split_reads` splits them; a step without ``written_from`` has all
    its reads before). Mutates ``counters``, ``cursor`` and ``ring``; returns the slots verified."""
    if part == AFTER_WRITES and step.written_from is None:
        return 0
    c, rg, cap = ring_args(counters, ring)
    st = checked_out(stamps, (stamps.shape[0], 4))
    return int(_verify(describe(step), st, stamps.shape[0], src.src, src.runs, src.keys, c,
                       checked_out(cursor, (1,)), -1 if content_slots is None else content_slots, rg, cap,
                       src.bytes_per_slot, part, _NO_LEDGER, _NO_LEDGER, 0))


def seeds(stamps: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvcanary.checks.canonical_seeds`."""
    seed = torch.empty(step.num_rows, dtype=torch.int64)
    mode = torch.empty(step.num_rows, dtype=torch.int64)
    _seeds(describe(step), checked_out(stamps, (stamps.shape[0], 4)), stamps.shape[0], seed.numpy(), mode.numpy())
    return seed, mode


def stamp(stamps: torch.Tensor, src: SourceTable, step: Step, counters: torch.Tensor, ring: torch.Tensor,
          unknown_possible: bool = True) -> None:
    """Stamp the writes of ``step`` and check them. Mutates ``stamps``, ``counters`` and ``ring``."""
    c, rg, cap = ring_args(counters, ring)
    d = describe(step)
    st = checked_out(stamps, (stamps.shape[0], 4))
    seed = np.empty(step.num_rows, dtype=np.int64)
    mode = np.empty(step.num_rows, dtype=np.int64)
    _seeds(d, st, stamps.shape[0], seed, mode)
    _stamp(d, st, stamps.shape[0], src.src, src.runs, src.keys, c, rg, cap, src.bytes_per_slot, seed, mode, _NO_FOLD,
           _NO_LEDGER)
