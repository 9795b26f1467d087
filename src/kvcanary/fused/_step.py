"""A step as one int64 descriptor array the compiled loops read, and the slot lookup on it."""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.fused._core import JIT, addr, addr2, ld, ld_i64, st_i64
from kvcanary.fused.cache import njit
from kvcanary.step import _SLOT_LIMIT, Step
from kvcanary.violations import NUM_COUNTERS, NUM_FIELDS

# 1-d tensors: address, element size, stride (elements); address 0: absent
CL, NO, NT, NP, NS, TR, RS, RV, ENT, ENP, WF, ER = (3 * i for i in range(12))
TAB, ET = 36, 42  # 2-d tensors: address, element size, row stride, column stride, rows, columns
NROWS, NNEW, BSIZE, IS_BLOCK, SPAN = 48, 49, 50, 51, 52
DESC_LEN = 53
_ONE_D = ("cached_lens", "new_offsets", "new_tokens", "new_positions", "new_slots", "table_rows", "read_starts",
          "row_valid", "expected_new_tokens", "expected_new_positions", "written_from", "expected_rows")


def describe(step: Step) -> np.ndarray:
    """The descriptor of ``step`` (shapes already checked); it points into the step's tensors, which
    must outlive its use. Kept in the step's :meth:`~kvcanary.step.Step.memo` for its next op, the
    entries of a field assigned through :meth:`~kvcanary.step.Step.assign_new` remade (a new array:
    one handed out before keeps what it described)."""
    memo = step.memo()
    got = memo.get("fused_desc")
    changed = memo.pop("changed", None)
    if got is not None and changed:
        got = got.copy()
        for name in changed:
            f = 3 * _ONE_D.index(name)
            got[f:f + 3] = addr(getattr(step, name))
        memo["fused_desc"] = got
    if got is not None:
        return got  # type: ignore[no-any-return]
    d: list[int] = []
    for name in _ONE_D:
        d += addr(getattr(step, name))
    block = step.block_table is not None
    d += addr2(step.table)
    d += addr2(step.expected_tokens)
    d += (step.num_rows, step.num_new, step.block_size, int(block), step.table_span)
    out = memo["fused_desc"] = np.array(d, dtype=np.int64)
    return out


@njit(inline="always", **JIT)
def rd(d, f, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of the 1-d tensor at field ``f``."""
    return ld(d[f], d[f + 1], i * d[f + 2])


@njit(inline="always", **JIT)
def rd2(d, f, i, j):  # type: ignore[no-untyped-def]
    return ld(d[f], d[f + 1], i * d[f + 2] + j * d[f + 3])


@njit(inline="always", **JIT)
def valid(d, r):  # type: ignore[no-untyped-def]
    return d[RV] == 0 or rd(d, RV, r) != 0


@njit(inline="always", **JIT)
def start(d, r):  # type: ignore[no-untyped-def]
    return 0 if d[RS] == 0 else rd(d, RS, r)


@njit(inline="always", **JIT)
def expected_row(d, r):  # type: ignore[no-untyped-def]
    """The row of ``expected_tokens`` step row ``r`` reads (in range: validated)."""
    return r if d[ER] == 0 else rd(d, ER, r)


@njit(inline="always", **JIT)
def table_row(d, r):  # type: ignore[no-untyped-def]
    """The table row of step row ``r``; -1 outside the table (a validated step has none)."""
    t = r if d[TR] == 0 else rd(d, TR, r)
    return t if 0 <= t < d[TAB + 4] else -1


_LIM = _SLOT_LIMIT


@njit(inline="always", **JIT)
def lookup(d, r, p):  # type: ignore[no-untyped-def]
    """The slot of position ``p`` of step row ``r``: :meth:`kvcanary.step.Step.lookup`, element-wise."""
    t = table_row(d, r)
    span = d[SPAN]
    if t < 0 or p < 0 or p >= span:
        return -1
    if d[IS_BLOCK] == 0:
        return rd2(d, TAB, t, p)
    bs = d[BSIZE]
    e = rd2(d, TAB, t, p // bs)
    lim = _LIM // bs
    if e < -lim or e > lim:
        return -1
    return e * bs + p % bs


@njit(inline="always", **JIT)
def bump(counters, i, v):  # type: ignore[no-untyped-def]
    a = counters + 8 * i
    st_i64(a, ld_i64(a) + v)


@njit(inline="always", **JIT)
def record(counters, ring, cap, f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13):  # type: ignore[no-untyped-def]
    """Append one violation row to the ring (counter 11 is the rows ever recorded)."""
    n = ld_i64(counters + 8 * 11)
    a = ring + 8 * 14 * (n % cap)
    st_i64(a, f0)
    st_i64(a + 8, f1)
    st_i64(a + 16, f2)
    st_i64(a + 24, f3)
    st_i64(a + 32, f4)
    st_i64(a + 40, f5)
    st_i64(a + 48, f6)
    st_i64(a + 56, f7)
    st_i64(a + 64, f8)
    st_i64(a + 72, f9)
    st_i64(a + 80, f10)
    st_i64(a + 88, f11)
    st_i64(a + 96, f12)
    st_i64(a + 104, f13)
    st_i64(counters + 8 * 11, n + 1)


def checked_out(t: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Address of an int64 tensor the loops write: contiguous, of ``shape``, on the CPU."""
    if t.dtype is not torch.int64 or t.shape != shape or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"expected a contiguous int64 CPU tensor of shape {shape}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t.data_ptr()


def ring_args(counters: torch.Tensor, ring: torch.Tensor) -> tuple[int, int, int]:
    """The counters' and the violation ring's addresses and the ring's capacity, as the loops take them."""
    return (checked_out(counters, (NUM_COUNTERS,)), checked_out(ring, (ring.shape[0], NUM_FIELDS)), ring.shape[0])
