"""The checks as vectorized torch ops: the CPU path and the reference the GPU kernels match bit for bit.

Stamps are an int64 tensor ``[num_slots, 4]`` with columns :data:`TOKEN`, :data:`POSITION`,
:data:`LINK`, :data:`CONTENT`; an unwritten slot holds ``EMPTY_STAMP``. Each op returns the
violation rows it found (int64 ``[n, NUM_FIELDS]``) and adds to ``counters`` in place.
"""

from __future__ import annotations

import torch

from kvcanary import hashing
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import NUM_FIELDS, Check, Counter, Site

TOKEN, POSITION, LINK, CONTENT = 0, 1, 2, 3
# A slot's state is in its position column: >= 0 stamped, EMPTY (never written, or released when the
# engine freed it: a read is a violation), UNKNOWN (written while this canary was not watching: a
# canary attached to a warm engine, or one of its own ops failed; a read is counted, never reported)
EMPTY_POS, UNKNOWN_POS = -1, -2
EMPTY_STAMP = (-1, EMPTY_POS, 0, 0)
UNKNOWN_STAMP = (-1, UNKNOWN_POS, 0, 0)
_SEED = hashing.signed(hashing.LINK_SEED)
_B = hashing.signed(hashing.LINK_B)
_SEED_B = hashing.signed(hashing.LINK_SEED * hashing.LINK_B)


def new_stamps(num_slots: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A stamp pool of ``num_slots`` empty stamps, int64 ``[num_slots, 4]``."""
    return torch.tensor(EMPTY_STAMP, dtype=torch.int64, device=device).repeat(num_slots, 1)


def set_state(stamps: torch.Tensor, slots: torch.Tensor | None, stamp: tuple[int, int, int, int]) -> None:
    """Overwrite the stamps of ``slots`` (int64 ``[n]``; ``None``: every slot) with ``stamp``."""
    value = torch.tensor(stamp, dtype=torch.int64, device=stamps.device)
    if slots is None:
        stamps[:] = value
    else:
        stamps[slots] = value


def rows_of(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For counts ``[R]``: the row of each of ``sum(counts)`` items and each item's index in its row."""
    r = counts.shape[0]
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if r else 0
    row = torch.repeat_interleave(torch.arange(r, device=counts.device), counts, output_size=total)
    idx = torch.arange(total, device=counts.device) - (ends - counts)[row]
    return row, idx


def read_counts(step: Step) -> torch.Tensor:
    """Slots each row reads this step, int64 ``[R]`` (0 for padding rows)."""
    start = step.starts()
    return torch.where(step.valid_rows(), step.cached_lens.long() - start, 0).clamp_min(0)


SEED_STORED, SEED_GIVEN, SEED_UNKNOWN = 0, 1, 2  # how a row's chain of new tokens is seeded


def canonical_seeds(stamps: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's chain of new tokens starts, and how that was found: int64 ``[R]`` each.

    A link must be a function of the prefix alone (prefix caches swap identical blocks between
    requests), so a row whose predecessor slot is unknown cannot seed from that slot's stamp.
    Where the step knows the row's whole prefix (``expected_tokens``, no -1 before ``cached_len``)
    the seed is the prefix's own link, computed by a scan (``SEED_GIVEN``); otherwise the row's new
    tokens are stamped unknown too (``SEED_UNKNOWN``). Other rows keep seeding from the stored
    stamp (``SEED_STORED``). The first tensor holds every row's seed: the link stamped at position
    ``cached_len - 1`` before this step's writes, the seed at a sequence head, 0 for an unreadable
    predecessor (already reported by verify), or the prefix's own link. Reads tensor values: the
    CPU path, or a prologue while unknown slots may exist.
    """
    r = step.num_rows
    cached = step.cached_lens.long()
    pslot = step.lookup(torch.arange(r, device=cached.device), cached - 1)
    inside = (pslot >= 0) & (pslot < stamps.shape[0])
    pred = stamps[torch.where(inside, pslot, 0)]
    unknown = (cached > 0) & inside & (pred[:, POSITION] == UNKNOWN_POS) & step.valid_rows()
    mode = torch.where(unknown, SEED_UNKNOWN, SEED_STORED)
    seed = torch.where(cached > 0, torch.where(inside, pred[:, LINK], 0), _SEED)
    et = step.expected_tokens
    if et is None or not bool(unknown.any()):
        return seed, mode
    rows = unknown.nonzero().squeeze(1)
    n = cached[rows].clamp(max=et.shape[1])
    row, p = rows_of(n)
    tok = et[step.expected_row_of(rows[row]), p].long()
    missing = torch.zeros(rows.shape[0], dtype=torch.int64, device=cached.device)
    missing.index_add_(0, row, (tok < 0).long())  # tokens of the prefix the step does not know
    full = (missing == 0) & (n == cached[rows])
    head = torch.where(p == 0, _SEED_B, 0)
    link = hashing.affine_scan(torch.where(p == 0, 0, _B), hashing.g_term(tok, p) + head)
    last = torch.cumsum(n, 0) - 1
    got = link[last.clamp(min=0)]
    seed[rows] = torch.where(full, got, seed[rows])
    mode[rows] = torch.where(full, SEED_GIVEN, SEED_UNKNOWN)
    return seed, mode


_BUMP_IDX: dict[tuple[object, ...], torch.Tensor] = {}


def _bump(counters: torch.Tensor, *pairs: tuple[Counter, int | torch.Tensor]) -> None:
    """Add to several counters with one indexed add (the torch path runs where reading a count is cheap)."""
    key = (counters.device, *(c for c, _ in pairs))
    idx = _BUMP_IDX.get(key)
    if idx is None:
        idx = _BUMP_IDX[key] = torch.tensor([int(c) for c, _ in pairs], device=counters.device)
    vals = torch.tensor([int(v) for _, v in pairs], dtype=torch.int64, device=counters.device)
    counters.index_add_(0, idx, vals)


def pack(site: Site, checks: torch.Tensor, step_id: int, cols: list[torch.Tensor]) -> torch.Tensor:
    """Violation rows for the entries with a non-zero ``checks``; ``cols`` are fields 3.. in order."""
    hit = checks != 0
    n = int(hit.sum())
    out = torch.empty(n, NUM_FIELDS, dtype=torch.int64, device=checks.device)
    if n:
        out[:, 0] = int(site)
        out[:, 1] = checks[hit]
        out[:, 2] = step_id
        for i, c in enumerate(cols):
            out[:, 3 + i] = c[hit]
    return out


def verify(
    stamps: torch.Tensor,
    layout: KvLayout,
    step: Step,
    counters: torch.Tensor,
    cursor: torch.Tensor,
    content_slots: int | None,
    step_id: int,
) -> torch.Tensor:
    """Verify every slot the step reads: position, link, token, and content within the budget.

    Parameters
    ----------
    stamps : int64 ``[num_slots, 4]``
    counters : int64 ``[NUM_COUNTERS]``, updated in place
    cursor : int64 ``[1]`` rotating start of the content window, advanced in place
    content_slots : content checks per step (``None``: every read slot)
    """
    num_slots = stamps.shape[0]
    start = step.starts()
    row, idx = rows_of(read_counts(step))
    pos = start[row] + idx
    slot = step.lookup(row, pos)
    bad = slot.clamp(0, num_slots - 1) != slot
    sl = torch.where(bad, 0, slot)  # a bad slot's record shows slot 0's stamp, as the kernels do
    s_tok, s_pos, s_link, s_cont = stamps[sl].unbind(1)
    empty = (s_pos == EMPTY_POS) & ~bad
    unknown = (s_pos == UNKNOWN_POS) & ~bad
    readable = ~(bad | empty | unknown)
    # a row's entries are consecutive: an entry's predecessor is the previous entry; an unknown
    # predecessor's link says nothing about this slot's
    has_pred = idx > 0
    pred_ok = has_pred & ~bad.roll(1) & ~unknown.roll(1)
    linked = readable & ((pos == 0) | pred_ok)
    prev_link = torch.where(pos == 0, _SEED, s_link.roll(1))
    exp_link = torch.where(linked, hashing.link_next(prev_link, s_tok, s_pos), 0)
    pos_bad = readable & (s_pos != pos)
    link_bad = linked & (s_link != exp_link)
    failed = bad | empty | pos_bad | link_bad

    exp_tok = None
    if step.expected_tokens is not None:
        et = step.expected_tokens
        inside = pos < et.shape[1]
        exp_tok = torch.where(inside, et[step.expected_row_of(row), torch.where(inside, pos, 0)].long(), -1)
        tok_bad = readable & (exp_tok != -1) & (s_tok != exp_tok)
        failed |= tok_bad

    n = pos.shape[0]
    content_bad = exp_content = None
    if layout.sources and n:
        cur = cursor % n
        k = n if content_slots is None else min(content_slots, n)
        in_window = (torch.arange(n, device=pos.device) - cur) % n < k
        sel = in_window & readable
        which = sel.nonzero().squeeze(1)
        exp_content = torch.zeros_like(pos)
        exp_content[which] = layout.fingerprint(slot[which])
        content_bad = sel & (s_cont != exp_content)
        failed |= content_bad
        nsel = which.shape[0]
        _bump(counters, (Counter.CONTENT_SLOTS_VERIFIED, nsel), (Counter.CONTENT_SLOTS_SKIPPED, n - k),
              (Counter.CONTENT_BYTES_VERIFIED, nsel * layout.content_bytes_per_slot))
        cursor += k

    nlinked = int(linked.sum())
    _bump(counters, (Counter.SLOTS_VERIFIED, n), (Counter.LINKS_CHECKED, nlinked),
          (Counter.LINKS_UNCHECKED, int(readable.sum()) - nlinked), (Counter.SLOTS_UNVERIFIABLE, int(unknown.sum())))
    if not bool(failed.any()):  # the clean path builds no violation rows
        return torch.empty(0, NUM_FIELDS, dtype=torch.int64, device=pos.device)
    checks = (bad * int(Check.BAD_SLOT) + empty * int(Check.EMPTY) + pos_bad * int(Check.POSITION)
              + link_bad * int(Check.LINK))
    if exp_tok is not None:
        checks += tok_bad * int(Check.TOKEN)
    if content_bad is not None:
        checks += content_bad * int(Check.CONTENT)
    pred = torch.where(has_pred, slot.roll(1), -1)
    zero = torch.zeros_like(pos)
    cols = [row, slot, pos, torch.full_like(pos, -1) if exp_tok is None else exp_tok, s_tok, s_pos, exp_link,
            s_link, zero if exp_content is None else exp_content, s_cont, pred]
    return pack(Site.VERIFY, checks, step_id, cols)


def stamp(
    stamps: torch.Tensor,
    layout: KvLayout,
    step: Step,
    counters: torch.Tensor,
    step_id: int,
    seeds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Stamp every slot the step wrote (after the forward), and check the writes.

    The links of all new tokens come from one parallel scan; each row's chain starts from the
    stamp of the slot at ``cached_len - 1`` (or the seed at a sequence head). Padding tokens
    (slot < 0) advance their row's chain but are not stamped; padding rows stamp nothing. Two
    tokens of one step written to one slot is an engine bug: each of them is reported
    (``WRITE_DUPLICATE``) and the slot is left unstamped.

    A row whose predecessor slot is unknown seeds from its prefix instead (:func:`canonical_seeds`;
    ``seeds`` passes them in when already computed), or stamps its slots unknown.

    Parameters
    ----------
    stamps : int64 ``[num_slots, 4]``, updated in place
    counters : int64 ``[NUM_COUNTERS]``, updated in place
    """
    offs = step.new_offsets.long()
    counts = offs[1:] - offs[:-1]
    row, j = rows_of(counts)
    tok, pos, slot = step.new_tokens.long(), step.new_positions.long(), step.new_slots.long()
    cached = step.cached_lens.long()
    writes = (slot >= 0) & step.valid_rows()[row]
    stamped = writes & (slot < stamps.shape[0])  # a slot outside the pool is reported, not stamped
    exp_pos = cached[row] + j

    given, mode = canonical_seeds(stamps, step) if seeds is None else seeds
    seed = given[row]
    lost = (mode == SEED_UNKNOWN)[row]  # a chain whose prefix is unknown: its slots become unknown too
    head = j == 0
    g = hashing.g_term(tok, pos)
    # every token of a row advances its chain, padding ones too (a window engine sends the oldest
    # tokens of a long prefill to a trash slot, but they are still part of the prefix)
    b = g + torch.where(head, seed * _B, 0)
    if bool(head.all()):  # one token per row (decode): every map is constant, no scan needed
        link = b
    else:
        link = hashing.affine_scan(torch.where(head, 0, _B), b)

    table_slot = step.lookup(row, exp_pos)
    wpos_bad = writes & (pos != exp_pos)
    wtab_bad = writes & (table_slot != slot)
    out_bad = writes & ~stamped
    failed = wpos_bad | wtab_bad | out_bad
    exp_tok = tok_bad = epos_bad = None
    if step.expected_new_tokens is not None:
        exp_tok = step.expected_new_tokens.long()
        tok_bad = writes & (exp_tok != -1) & (tok != exp_tok)  # -1: not known yet
        failed |= tok_bad
    if step.expected_new_positions is not None:
        epos_bad = writes & (pos != step.expected_new_positions.long())
        failed |= epos_bad

    w = stamped.nonzero().squeeze(1)
    ws = slot[w]
    content = layout.fingerprint(ws)
    # which of two writes to one slot landed is unknown: EMPTY makes a later read of it a violation
    srt, order = torch.sort(ws)
    eq = srt[1:] == srt[:-1]
    twin = torch.zeros(srt.shape, dtype=torch.bool, device=ws.device)  # sorted: equal to a neighbour
    twin[1:] |= eq
    twin[:-1] |= eq
    dup_w = torch.empty_like(twin)
    dup_w[order] = twin
    gone = lost[w] & ~dup_w
    kept = ~dup_w & ~gone
    stamps[ws[kept]] = torch.stack([tok[w], pos[w], link[w], content], dim=1)[kept]
    if bool(dup_w.any()):
        stamps[ws[dup_w]] = torch.tensor(EMPTY_STAMP, dtype=torch.int64, device=stamps.device)
    if bool(gone.any()):
        stamps[ws[gone]] = torch.tensor(UNKNOWN_STAMP, dtype=torch.int64, device=stamps.device)
    dup = torch.zeros_like(stamped)
    dup[w] = dup_w
    failed |= dup
    nkept = int(kept.sum())
    _bump(counters, (Counter.SLOTS_STAMPED, nkept),
          (Counter.CONTENT_BYTES_STAMPED, nkept * layout.content_bytes_per_slot))
    if not bool(failed.any()):
        return torch.empty(0, NUM_FIELDS, dtype=torch.int64, device=tok.device)
    checks = (wpos_bad * int(Check.WRITE_POSITION) + wtab_bad * int(Check.WRITE_TABLE)
              + out_bad * int(Check.BAD_SLOT) + dup * int(Check.WRITE_DUPLICATE))
    if tok_bad is not None:
        checks += tok_bad * int(Check.WRITE_INPUT_TOKEN)
    if epos_bad is not None:
        checks += epos_bad * int(Check.WRITE_INPUT_POSITION)
    full_content = torch.zeros_like(tok)
    full_content[w] = content
    zero = torch.zeros_like(tok)
    cols = [row, slot, exp_pos, torch.full_like(tok, -1) if exp_tok is None else exp_tok, tok, pos, zero, link,
            zero, full_content, table_slot]
    return pack(Site.WRITE, checks, step_id, cols)


def scrub(
    stamps: torch.Tensor,
    layout: KvLayout,
    slots: torch.Tensor,
    counters: torch.Tensor,
    step_id: int,
    site: Site = Site.SCRUB,
) -> torch.Tensor:
    """Re-fingerprint stamped ``slots`` (int64 ``[n]``) and compare with their stamps.

    Slots that were never stamped (or were released) are skipped and not counted.
    """
    st = stamps[slots]
    live = st[:, POSITION] >= 0
    ls = slots[live]
    exp = layout.fingerprint(ls)
    got = st[live]
    checks = torch.where(got[:, CONTENT] != exp, int(Check.CONTENT), 0) if layout.sources else torch.zeros_like(exp)
    _bump(counters, (Counter.SLOTS_SCRUBBED, ls.shape[0]),
          (Counter.CONTENT_BYTES_SCRUBBED, ls.shape[0] * layout.content_bytes_per_slot))
    m1 = torch.full_like(ls, -1)
    zero = torch.zeros_like(ls)
    cols = [m1, ls, got[:, POSITION], m1, got[:, TOKEN], got[:, POSITION], zero, got[:, LINK], exp,
            got[:, CONTENT], m1]
    return pack(site, checks, step_id, cols)
