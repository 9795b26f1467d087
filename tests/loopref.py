"""A per-slot Python loop of the checks: slow and obviously correct; the torch path must match it."""

from __future__ import annotations

import torch

from kvcanary import hashing as h
from kvcanary.checks import CONTENT, LINK, POSITION, TOKEN
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import Check


def slot_bytes(layout: KvLayout, slot: int) -> list[bytes]:
    """Each source's fingerprinted bytes of ``slot``, read through plain indexing."""
    out = []
    for s in layout.sources:
        st = s.tensor.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
        page, off = divmod(slot, s.page_size)
        base = s.offset + page * s.page_stride + off * s.token_stride
        buf = b""
        for r in range(s.rows):
            a = base + r * s.row_stride
            buf += bytes(raw[a : a + s.row_bytes].tolist())
        out.append(buf[: s.read_bytes])
    return out


def lookup(step: Step, r: int, p: int) -> int:
    trow = r if step.table_rows is None else int(step.table_rows[r])
    if p < 0 or p >= step.table_span:
        return -1
    if step.slot_table is not None:
        return int(step.slot_table[trow, p])
    bs = step.block_size
    return int(step.table[trow, p // bs]) * bs + p % bs


def verify(stamps: torch.Tensor, layout: KvLayout, step: Step, content: set[int] | None = None) -> dict:
    """{(row, position): checks} for every failing read entry; ``content``: entry indices to fingerprint
    (``None``: all)."""
    n = stamps.shape[0]
    out: dict[tuple[int, int], int] = {}
    e = -1
    for r in range(step.num_rows):
        if step.row_valid is not None and not bool(step.row_valid[r]):
            continue
        start = 0 if step.read_starts is None else int(step.read_starts[r])
        for p in range(start, int(step.cached_lens[r])):
            e += 1
            s = lookup(step, r, p)
            if not 0 <= s < n:
                out[(r, p)] = Check.BAD_SLOT
                continue
            tok, pos, link, cont = (int(x) for x in stamps[s])
            if pos == -1:
                out[(r, p)] = Check.EMPTY
                continue
            c = 0
            if pos != p:
                c |= Check.POSITION
            prev = None
            checkable = p == 0
            if p > start:
                ps = lookup(step, r, p - 1)
                if 0 <= ps < n:
                    prev, checkable = int(stamps[ps, LINK]), True
            if checkable and h.signed(h.py_link(prev, tok, pos)) != link:
                c |= Check.LINK
            if step.expected_tokens is not None and p < step.expected_tokens.shape[1]:
                et = int(step.expected_tokens[r if step.expected_rows is None else int(step.expected_rows[r]), p])
                if et != -1 and et != tok:
                    c |= Check.TOKEN
            if layout.sources and (content is None or e in content):
                if h.signed(h.py_content(slot_bytes(layout, s))) != cont:
                    c |= Check.CONTENT
            if c:
                out[(r, p)] = c
    return out


def stamp(stamps: torch.Tensor, layout: KvLayout, step: Step) -> dict:
    """Apply the step's writes to ``stamps`` serially; returns {token index: write checks}."""
    out: dict[int, int] = {}
    offs = [int(x) for x in step.new_offsets]
    before = stamps.clone()  # every chain starts from the stamps as they were before the step
    for r in range(step.num_rows):
        valid = step.row_valid is None or bool(step.row_valid[r])
        cached = int(step.cached_lens[r])
        prev = None
        if cached > 0:
            ps = lookup(step, r, cached - 1)
            prev = int(before[ps, LINK]) if 0 <= ps < stamps.shape[0] else 0
        for j, i in enumerate(range(offs[r], offs[r + 1])):
            s = int(step.new_slots[i])
            tok, pos = int(step.new_tokens[i]), int(step.new_positions[i])
            link = h.py_link(prev, tok, pos)
            prev = link
            if s < 0 or not valid:
                continue
            c = 0
            if pos != cached + j:
                c |= Check.WRITE_POSITION
            if lookup(step, r, cached + j) != s:
                c |= Check.WRITE_TABLE
            if step.expected_new_tokens is not None and int(step.expected_new_tokens[i]) not in (-1, tok):
                c |= Check.WRITE_INPUT_TOKEN
            if step.expected_new_positions is not None and int(step.expected_new_positions[i]) != pos:
                c |= Check.WRITE_INPUT_POSITION
            cont = h.py_content(slot_bytes(layout, s)) if layout.sources else 0
            stamps[s, TOKEN], stamps[s, POSITION] = tok, pos
            stamps[s, LINK], stamps[s, CONTENT] = h.signed(link), h.signed(cont)
            if c:
                out[i] = c
    return out
