"""The fused CPU loops over cold cache: slots re-fingerprinted against their stamps (the scrub, and
the patrol's runs of neighbouring slots), the guard over the reserved slots and the guarded live
ones, and content fingerprints of any slots. Like :mod:`kvcanary.fused.ops`, each writes its
violation rows straight into the canary's ring and bumps its counters in place.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.errors import KvCanaryError
from kvcanary.fused._core import JIT, ld_i32, ld_i64, st_i64
from kvcanary.fused._step import bump, checked_out, record, ring_args
from kvcanary.fused.cache import njit
from kvcanary.fused.fold import SourceTable, fold_slot, fold_slots
from kvcanary.fused.snapshot import same, take
from kvcanary.violations import Check, Counter, Site

_STEPS, _C_CONT = int(Counter.STEPS), int(Check.CONTENT)
_K_SCRUBBED, _K_SCBYTES = int(Counter.SLOTS_SCRUBBED), int(Counter.CONTENT_BYTES_SCRUBBED)
_K_GUARD, _SITE_GUARD = int(Counter.GUARD_CHECKS), int(Site.GUARD)


@njit(inline="always", **JIT)
def scrub_one(stamps, num_slots, src, runs, keys, s, counters, ring, cap, site, step_id):  # type: ignore[no-untyped-def]
    """Re-fingerprint slot ``s`` against its stamp; 1 when it holds one (a live slot), else 0."""
    if s < 0 or s >= num_slots:
        return 0
    sa = stamps + 32 * s
    pos = ld_i64(sa + 8)
    if pos < 0:
        return 0
    if src.shape[0] > 0:
        exp = fold_slot(src, runs, keys, s)
        cont = ld_i64(sa + 24)
        if cont != exp:
            record(counters, ring, cap, site, _C_CONT, step_id, -1, s, pos, -1, ld_i64(sa), pos, 0, ld_i64(sa + 16),
                   exp, cont, -1)
    return 1


@njit(inline="always", **JIT)
def scrub_run(stamps, num_slots, src, runs, keys, first, n, counters, ring, cap, site, step_id):  # type: ignore[no-untyped-def]
    """:func:`scrub_one` of the ``n`` slots from ``first`` on (mod ``num_slots``), folded together
    (:func:`~kvcanary.fused.fold.fold_slots`); the live slots among them."""
    slots = np.empty(max(n, 0), dtype=np.int64)
    m = 0
    for i in range(n):
        s = (first + i) % num_slots
        if ld_i64(stamps + 32 * s + 8) >= 0:
            slots[m] = s
            m += 1
    if src.shape[0] == 0:
        return m
    exps = fold_slots(src, runs, keys, slots, m)
    for j in range(m):
        s = slots[j]
        sa = stamps + 32 * s
        exp, cont, pos = exps[j], ld_i64(sa + 24), ld_i64(sa + 8)
        if cont != exp:
            record(counters, ring, cap, site, _C_CONT, step_id, -1, s, pos, -1, ld_i64(sa), pos, 0, ld_i64(sa + 16),
                   exp, cont, -1)
    return m


@njit(**JIT)
def _scrub(stamps, num_slots, src, runs, keys, slots, esz, n, counters, ring, cap, bps, site):  # type: ignore[no-untyped-def]
    step_id = ld_i64(counters + 8 * _STEPS)
    live = 0
    for i in range(n):
        s = ld_i64(slots + 8 * i) if esz == 8 else ld_i32(slots + 4 * i)
        live += scrub_one(stamps, num_slots, src, runs, keys, s, counters, ring, cap, site, step_id)
    bump(counters, _K_SCRUBBED, live)
    bump(counters, _K_SCBYTES, live * bps)


@njit(**JIT)
def _guard(stamps, src, runs, keys, slots, nres, n, base, hit, was, got, counters, ring, cap, regions, nreg,
           snap):  # type: ignore[no-untyped-def]
    step_id = ld_i64(counters + 8 * _STEPS)
    first = 0
    if nreg:  # the reserved slots' bytes as they were when their fingerprints were taken: none changed
        if same(regions, nreg, snap):
            first = nres
        else:
            take(regions, nreg, snap)  # the fingerprints below are taken of these bytes
    for i in range(first, n):
        s = ld_i64(slots + 8 * i)
        if i >= nres and ld_i64(stamps + 32 * s + 8) < 0:
            continue  # a guarded slot without a stamp: nothing to check it against
        fp = fold_slot(src, runs, keys, s)
        if i < nres:  # a reserved slot: against its fingerprint, re-taken on a change
            b = ld_i64(base + 8 * i)
            if fp != b:
                if ld_i64(hit + 8 * i) < 0:
                    st_i64(hit + 8 * i, step_id)
                    st_i64(was + 8 * i, b)
                    st_i64(got + 8 * i, fp)
                st_i64(base + 8 * i, fp)
            continue
        sa = stamps + 32 * s
        pos = ld_i64(sa + 8)
        cont = ld_i64(sa + 24)
        if pos >= 0 and cont != fp:  # a guarded live slot: against its stamp
            record(counters, ring, cap, _SITE_GUARD, _C_CONT, step_id, -1, s, pos, -1, ld_i64(sa), pos, 0,
                   ld_i64(sa + 16), fp, cont, -1)
    bump(counters, _K_GUARD, n)


@njit(**JIT)
def _content(src, runs, keys, num_slots, slots, esz, n, out):  # type: ignore[no-untyped-def]
    has_src = src.shape[0] > 0
    for i in range(n):
        s = ld_i64(slots + 8 * i) if esz == 8 else ld_i32(slots + 4 * i)
        st_i64(out + 8 * i, fold_slot(src, runs, keys, s) if has_src and 0 <= s < num_slots else 0)


# ---- the Python side: descriptors in, the compiled loop, nothing else --------------------------


def _slots_addr(slots: torch.Tensor) -> tuple[torch.Tensor, int]:
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        raise KvCanaryError(f"slots: expected a 1-d int32 or int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    slots = slots.contiguous()
    return slots, slots.element_size()


def scrub(stamps: torch.Tensor, src: SourceTable, slots: torch.Tensor, counters: torch.Tensor, ring: torch.Tensor,
          site: Site = Site.SCRUB) -> None:
    """Re-fingerprint the stamped ``slots`` and compare with their stamps (slots outside the pool
    and unstamped ones are passed over). Mutates ``counters`` and ``ring``."""
    c, rg, cap = ring_args(counters, ring)
    slots, esz = _slots_addr(slots)
    _scrub(checked_out(stamps, (stamps.shape[0], 4)), stamps.shape[0], src.src, src.runs, src.keys,
           slots.data_ptr(), esz, slots.shape[0], c, rg, cap, src.bytes_per_slot, int(site))


def content(slots: torch.Tensor, src: SourceTable, num_slots: int, out: torch.Tensor) -> None:
    """Fingerprint ``slots`` into ``out`` (int64 ``[n]``); a slot outside ``[0, num_slots)`` gives 0."""
    slots, esz = _slots_addr(slots)
    _content(src.src, src.runs, src.keys, num_slots, slots.data_ptr(), esz, slots.shape[0],
             checked_out(out, (slots.shape[0],)))


def guard(stamps: torch.Tensor, src: SourceTable, slots: torch.Tensor, nres: int, base: torch.Tensor,
          hit: torch.Tensor, was: torch.Tensor, got: torch.Tensor, counters: torch.Tensor, ring: torch.Tensor,
          snapshot: tuple[int, int, int] | None = None) -> None:
    """:meth:`kvcanary.canary.Canary.guard` in one pass: ``slots`` (int64, in the pool) are the
    ``nres`` reserved slots, then the guarded live ones. A reserved slot whose fingerprint differs
    from ``base`` gets the step in ``hit`` (if none yet), the fingerprints before and after in
    ``was`` and ``got``, and ``base`` the new one; a guarded slot that holds a stamp is compared with
    it, a mismatch recorded in the ring (site ``guard``). Counts ``guard_checks``. ``snapshot``: the
    reserved slots' regions' address, their count and the snapshot's address
    (:mod:`kvcanary.fused.snapshot`), which skip the reserved slots whose bytes are unchanged."""
    c, rg, cap = ring_args(counters, ring)
    addr = [checked_out(t, (nres,)) for t in (base, hit, was, got)]
    reg, nreg, at = snapshot if snapshot is not None else (0, 0, 0)
    _guard(checked_out(stamps, (stamps.shape[0], 4)), src.src, src.runs, src.keys, checked_out(slots, (slots.shape[0],)),
           nres, slots.shape[0], *addr, c, rg, cap, reg, nreg, at)
