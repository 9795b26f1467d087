"""vLLM's per-layer keep: what each layer's forward hands the one call after the forward
(:func:`kvcanary.fused.audit.check_forward`), as compiled loops the layer calls by address.

- :func:`keep_layer`, before the layer's attention (its cache write has just run): the layer's write
  check of every new token and its part of each new token's content fingerprint;
- :func:`keep_layer_at`: the same with its tables given by address (:func:`keep_tables`), four
  integers where the numba dispatcher's checks of 14 arrays cost more than a decode batch's check,
  called through its compiled entry (:func:`direct`), past the dispatcher;
- :func:`keep_queries`, after the attention: a copy of the layer's audited queries' query and output
  rows, which the engine may reuse in a later layer.

The engine side is :class:`kvcanary.engines.vllm.wide.WideForward`.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types

from kvcanary.audit.tables import (L_DIM, L_ESIZE, L_HEADS, L_MAX_SLOT, L_STEP, Q_HEAD, Q_LAYER, Q_TOKEN, S_K, S_O,
                                   S_Q, S_V)
from typing import Any, Callable

from kvcanary.fused._core import JIT, i64_pointer, ld_u8, u64_pointer
from kvcanary.fused.fold import fold_row, fold_source
from kvcanary.fused._step import NNEW, NS, rd
from kvcanary.fused.audit import check_write
from kvcanary.fused.cache import njit


@njit(inline="always", **JIT)
def _fold_token(c, step, g, t, f0, f1, fsrc, fruns, fkeys, facc, fcnt):  # type: ignore[no-untyped-def]
    """New token ``t``'s part of its fingerprint in sources ``f0`` to ``f1``, added into ``facc[g, t]``
    and counted in ``fcnt[g, t]`` (see :func:`keep_layer`); nothing for a token without a slot in the pool."""
    s = rd(step, NS, t)
    if s < 0 or s > c[L_MAX_SLOT]:
        return
    part = np.uint64(0)
    for i in range(f0, f1):
        part += fold_source(fsrc, fruns, fkeys, i, s)
    facc[g, t] += part
    fcnt[g, t] += f1 - f0


@njit(inline="always", **JIT)
def _fold_rows(c, step, g, t, f0, f1, frow, frkeys, ka, va, strides, facc, fcnt):  # type: ignore[no-untyped-def]
    """:func:`_fold_token` from the token's computed K and V rows (contiguous) instead of the cache:
    for a token whose write check found the cache's rows equal to them, bit for bit, and sources whose
    keys :func:`kvcanary.engines.vllm.fold.row_keys` put in a row's order (``frow[i]``: the first
    key, the word's width, 0 for K and 1 for V)."""
    s = rd(step, NS, t)
    if s < 0 or s > c[L_MAX_SLOT]:
        return
    n = c[L_HEADS] * c[L_DIM] * c[L_ESIZE]
    part = np.uint64(0)
    for i in range(f0, f1):
        w = frow[i, 1]
        at = ka + t * strides[S_K] if frow[i, 2] == 0 else va + t * strides[S_V]
        part += fold_row(at, w, frkeys, frow[i, 0], n // w)
    facc[g, t] += part
    fcnt[g, t] += f1 - f0


@njit(**JIT)
def keep_layer(layers, lay, ka, va, check, strides, steps, toks, half, head, fsrc, fruns, fkeys, lfold, frow, frkeys,
               facc, fcnt):  # type: ignore[no-untyped-def]
    """Inside one layer's forward, right after its cache write and before its attention reads the
    cache: where ``check`` is not 0, its write check (``ka``: its computed K's address, 0: none;
    ``va``: its V's) into the ``half`` and ``head`` rows of layer ``lay`` (see
    :func:`kvcanary.fused.audit.check_forward`), and the layer's part of every new token's
    fingerprint.

    The fold: sources ``lfold[lay, 0]`` to ``lfold[lay, 1]`` of the source table
    ``fsrc``/``fruns``/``fkeys`` (:class:`kvcanary.fused.fold.SourceTable`'s arrays, every group's
    together) are added into ``facc[g, t]`` for new token ``t`` of the layer's step ``g``, and counted in
    ``fcnt[g, t]`` (``facc`` of no columns: nothing folded). Where the layer's computed K and V are
    given, contiguous, and every source of the layer has its keys in a row's order (``frow[i, 0] >=
    0``, ``frkeys``), a token is folded from those rows (a loop the compiler vectorises) where its
    write check found the cache equal to them, or where its writes are not checked (``check`` 0: the
    fingerprint is then of what the layer meant to write, and a wrong write is found later by the
    content verify); any other token from the cache. Returns the number of checked tokens whose
    write differs (their ``half`` entries not 0)."""
    c = layers[lay]
    g = c[L_STEP]
    step = steps[g]
    f0, f1 = lfold[lay, 0], lfold[lay, 1]
    nf = min(facc.shape[1], step[NNEW]) if 0 <= f0 < f1 <= fsrc.shape[0] and facc.shape[1] > 0 else 0
    nw = toks.shape[0] if ka != 0 and va != 0 and check != 0 else 0
    hrow, drow = half[lay], head[lay]
    esz, nd = c[L_ESIZE], c[L_DIM]
    # fold from the computed rows: both contiguous, and every source of the layer keyed in a row's order
    rows = (nf > 0 and ka != 0 and va != 0 and f1 <= frow.shape[0] and strides[S_K + 2] == esz
            and strides[S_K + 1] == nd * esz and strides[S_V + 2] == esz and strides[S_V + 1] == nd * esz)
    if rows:
        for i in range(f0, f1):
            if frow[i, 0] < 0:
                rows = False
    ft = 0
    differ = 0
    for i in range(nw):
        t = toks[i]
        hf, first = check_write(c, ka, va, strides, step, t)
        hrow[i], drow[i] = hf, first
        if hf != 0:
            differ += 1
        while ft < t and ft < nf:  # a token whose write is not checked: from the cache
            _fold_token(c, step, g, ft, f0, f1, fsrc, fruns, fkeys, facc, fcnt)
            ft += 1
        if ft == t and ft < nf:
            if rows and hf == 0:
                _fold_rows(c, step, g, ft, f0, f1, frow, frkeys, ka, va, strides, facc, fcnt)
            else:
                _fold_token(c, step, g, ft, f0, f1, fsrc, fruns, fkeys, facc, fcnt)
            ft += 1
    for t in range(ft, nf):
        if rows and nw == 0:  # writes not checked: from the rows the layer computed
            _fold_rows(c, step, g, t, f0, f1, frow, frkeys, ka, va, strides, facc, fcnt)
        else:
            _fold_token(c, step, g, t, f0, f1, fsrc, fruns, fkeys, facc, fcnt)
    return differ


# keep_layer's tables, in its order, for keep_layer_at: each one's name, dimensions and dtype
KEEP_TABLES = tuple((name, nd, np.dtype(dt)) for name, nd, dt in (
    ("layers", 2, np.int64), ("strides", 1, np.int64), ("steps", 2, np.int64), ("toks", 1, np.int64),
    ("half", 2, np.int64), ("head", 2, np.int64), ("fsrc", 2, np.int64), ("fruns", 1, np.int64),
    ("fkeys", 1, np.uint64), ("lfold", 2, np.int64), ("frow", 2, np.int64), ("frkeys", 1, np.uint64),
    ("facc", 2, np.uint64), ("fcnt", 2, np.int64)))
NUM_TABLES = len(KEEP_TABLES)


def keep_tables(*tables: np.ndarray) -> np.ndarray:
    """:func:`keep_layer`'s tables (``KEEP_TABLES``' order, after ``lay``, ``ka`` and ``va``) as one
    int64 array of each one's address and shape (three columns each), whose address
    :func:`keep_layer_at` takes. The tables, and this array, must outlive its use; each must be
    C-contiguous, of its dimensions and dtype. Made once a forward: the addresses are read by a
    compiled call (numpy's array interface costs a microsecond a table)."""
    if len(tables) != len(KEEP_TABLES):
        raise ValueError(f"keep_tables: expected {len(KEEP_TABLES)} tables ({', '.join(n for n, _, _ in KEEP_TABLES)}),"
                         f" got {len(tables)}")
    for (name, ndim, dtype), t in zip(KEEP_TABLES, tables):
        if t.ndim != ndim or t.dtype != dtype or not t.flags.c_contiguous:
            raise ValueError(f"keep_tables: {name} must be a C-contiguous {ndim}-d {dtype.name} array, "
                             f"got {t.ndim}-d {t.dtype} (C-contiguous: {t.flags.c_contiguous})")
    out = np.empty(3 * len(tables), dtype=np.int64)
    _tables_at(out, *tables)
    return out


@njit(inline="always", **JIT)
def _at1(out, i, t):  # type: ignore[no-untyped-def]
    out[3 * i], out[3 * i + 1], out[3 * i + 2] = t.ctypes.data, t.shape[0], 0


@njit(inline="always", **JIT)
def _at2(out, i, t):  # type: ignore[no-untyped-def]
    out[3 * i], out[3 * i + 1], out[3 * i + 2] = t.ctypes.data, t.shape[0], t.shape[1]


@njit(**JIT)
def _tables_at(out, layers, strides, steps, toks, half, head, fsrc, fruns, fkeys, lfold, frow, frkeys, facc,
               fcnt):  # type: ignore[no-untyped-def]
    """Each table's address and shape into ``out`` (:func:`keep_tables`, which checked them)."""
    _at2(out, 0, layers)
    _at1(out, 1, strides)
    _at2(out, 2, steps)
    _at1(out, 3, toks)
    _at2(out, 4, half)
    _at2(out, 5, head)
    _at2(out, 6, fsrc)
    _at1(out, 7, fruns)
    _at1(out, 8, fkeys)
    _at2(out, 9, lfold)
    _at2(out, 10, frow)
    _at1(out, 11, frkeys)
    _at2(out, 12, facc)
    _at2(out, 13, fcnt)


@njit(inline="always", **JIT)
def _i1(at, i):  # type: ignore[no-untyped-def]
    return carray(i64_pointer(at[3 * i]), at[3 * i + 1])


@njit(inline="always", **JIT)
def _i2(at, i):  # type: ignore[no-untyped-def]
    return carray(i64_pointer(at[3 * i]), (at[3 * i + 1], at[3 * i + 2]))


@njit(inline="always", **JIT)
def _u1(at, i):  # type: ignore[no-untyped-def]
    return carray(u64_pointer(at[3 * i]), at[3 * i + 1])


@njit(inline="always", **JIT)
def _u2(at, i):  # type: ignore[no-untyped-def]
    return carray(u64_pointer(at[3 * i]), (at[3 * i + 1], at[3 * i + 2]))


@njit(**JIT)
def keep_layer_at(tables, lay, ka, va, check):  # type: ignore[no-untyped-def]
    """:func:`keep_layer` with its tables given by address (``tables``: the address of
    :func:`keep_tables`' array): the call runs inside every layer, where the dispatcher's checks of
    14 arrays cost more than the write check of a decode batch; five integers cost it a fraction,
    and nothing through :func:`direct`. Returns what :func:`keep_layer` returns."""
    at = carray(i64_pointer(tables), 3 * NUM_TABLES)
    return keep_layer(_i2(at, 0), lay, ka, va, check, _i1(at, 1), _i2(at, 2), _i1(at, 3), _i2(at, 4), _i2(at, 5),
                      _i2(at, 6), _i1(at, 7), _u1(at, 8), _i2(at, 9), _i2(at, 10), _u1(at, 11), _u2(at, 12),
                      _i2(at, 13))


KEEP_LAYER_AT = (types.int64,) * 5  # keep_layer_at's one signature: its five arguments, integers


def direct(fn: Callable[..., Any], signature: tuple[Any, ...]) -> Callable[..., Any]:
    """``fn``'s compiled code for ``signature`` as a callable that skips the numba dispatcher's typing
    of its arguments (a microsecond or so a call, more inside a layer whose matrix products left the
    core's caches cold). It converts each argument to the signature's type without a check (a float
    to an integer's place is truncated): its callers pass what the signature says. ``fn`` itself
    where it is not a numba dispatcher (a fault may replace it) or the signature cannot be compiled."""
    get = getattr(fn, "get_overload", None)
    compile_ = getattr(fn, "compile", None)
    if get is None or compile_ is None:
        return fn
    try:
        compile_(signature)  # loaded from the loops' cache where compiled before (kvcanary warmup)
        return get(signature)  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - the dispatcher still works: it is the fallback
        return fn


@njit(**JIT)
def keep_queries(layers, lay, qa, oa, strides, qt, kept):  # type: ignore[no-untyped-def]
    """After one layer's attention, a copy of its audited queries' rows, the query at ``qa`` and the
    output at ``oa``, into ``kept`` (``[S, 2, dim * element size]`` bytes: a query's table row ``s``
    holds its query at ``[s, 0]`` and its output at ``[s, 1]``), for
    :func:`kvcanary.fused.audit.check_forward` after the forward: the engine may reuse those tensors'
    memory in a later layer."""
    esz, nd = layers[lay, L_ESIZE], layers[lay, L_DIM]
    for s in range(qt.shape[0]):
        if qt[s, Q_LAYER] != lay:
            continue
        tok, hd = qt[s, Q_TOKEN], qt[s, Q_HEAD]
        q0 = qa + tok * strides[S_Q] + hd * strides[S_Q + 1]
        o0 = oa + tok * strides[S_O] + hd * strides[S_O + 1]
        for d in range(nd):
            for b in range(esz):
                kept[s, 0, d * esz + b] = ld_u8(q0 + d * strides[S_Q + 2] + b)
                kept[s, 1, d * esz + b] = ld_u8(o0 + d * strides[S_O + 2] + b)
