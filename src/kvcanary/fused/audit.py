"""The write check and the read audit (:mod:`kvcanary.audit`) as compiled CPU loops: one call per
layer for each, on tensors passed as byte descriptors, so a protected forward pays a few
microseconds per layer instead of a few dozen torch ops.

Descriptors (int64 arrays, byte addresses and byte strides):

- a row tensor (computed K or V, queries, attention outputs): ``(address, token stride, head
  stride, dim stride)``;
- a cache: ``(address, block size, block stride, token-in-block stride, head stride, dim stride,
  tile, tile stride, strip, strip stride)``; the element (slot ``s``, head ``h``, dim ``d``) lives
  at ``address + (s // block) * block stride + (t // tile) * tile stride + (t % tile) * token stride
  + h * head stride + (d // strip) * strip stride + (d % strip) * dim stride``, ``t = s % block``
  (:func:`slot_at`): at plain strides (transformers' token rows, vLLM's ``vec`` and ``vec16``
  layouts) a tile is the block and a strip the head; vLLM's ``amx`` layout interleaves 16-token
  tiles of K and 16-dim strips of V.

Floats are read as fp32 (code 0), bf16 (1) or fp16 (2) and computed in float64; the write check
compares raw bits (2 or 4 bytes an element). Both equal the torch reference
(:func:`kvcanary.audit.reference.attend`, :func:`kvcanary.audit.reference.write_mismatch`) within float rounding.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from kvcanary.audit.tables import (D_BLOCK, D_BLOCK_STRIDE, D_DIM_STRIDE, D_HEAD_STRIDE, D_STRIP, D_STRIP_STRIDE,
                                   D_TILE, D_TILE_STRIDE, D_TOKEN_STRIDE, DESCRIPTOR_COLUMNS, F_SCALE,
                                   F_SOFTCAP, F_TOL_BASE, F_TOL_SLOPE, FLOATS_PER_LAYER, L_CODE, L_DIM, L_ESIZE,
                                   L_HEADS, L_K, L_MAX_SLOT, L_QCODE, L_STEP, L_V, LAYER_COLUMNS, PTR_K, PTR_O, PTR_Q,
                                   PTR_V, Q_CACHED, Q_HEAD, Q_KV_HEAD, Q_LAYER, Q_LOCAL, Q_PICKED, Q_POSITION, Q_ROW,
                                   Q_SINK, Q_START, Q_TOKEN, S_K, S_O, S_Q, S_V)
from kvcanary.fused._core import (JIT, fold_row, fold_source, i64_pointer, ld_i64, ld_u8, ld_u16, ld_u32, prefetch,
                                  u64_pointer)
from kvcanary.fused._step import NNEW, NS, lookup, rd
from kvcanary.fused.cache import njit


@intrinsic
def ld_f32(typingctx, addr):  # type: ignore[no-untyped-def]
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        v = builder.load(builder.inttoptr(args[0], ir.FloatType().as_pointer()), align=1)
        return builder.fpext(v, ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def ld_f16(typingctx, addr):  # type: ignore[no-untyped-def]
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        v = builder.load(builder.inttoptr(args[0], ir.HalfType().as_pointer()), align=1)
        return builder.fpext(v, ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def ld_bf16(typingctx, addr):  # type: ignore[no-untyped-def]
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        bits = builder.load(builder.inttoptr(args[0], ir.IntType(16).as_pointer()), align=1)
        wide = builder.shl(builder.zext(bits, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.fpext(builder.bitcast(wide, ir.FloatType()), ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(inline="always", **JIT)
def ldf(addr, dt):  # type: ignore[no-untyped-def]
    if dt == 0:
        return ld_f32(addr)
    if dt == 1:
        return ld_bf16(addr)
    return ld_f16(addr)


@njit(inline="always", **JIT)
def load_row(addr, stride, dt, buf):  # type: ignore[no-untyped-def]
    """``buf.shape[0]`` floats of code ``dt`` from ``addr`` (stride ``stride`` bytes) into ``buf``."""
    if dt == 0:
        for d in range(buf.shape[0]):
            buf[d] = ld_f32(addr + d * stride)
    elif dt == 1:
        for d in range(buf.shape[0]):
            buf[d] = ld_bf16(addr + d * stride)
    else:
        for d in range(buf.shape[0]):
            buf[d] = ld_f16(addr + d * stride)


@njit(inline="always", **JIT)
def slot_at(cd, s):  # type: ignore[no-untyped-def]
    """The address of slot ``s``'s element (head 0, dim 0) in the cache of descriptor ``cd``."""
    bs, tile = cd[D_BLOCK], cd[D_TILE]
    t = s % bs
    return cd[0] + (s // bs) * cd[D_BLOCK_STRIDE] + (t // tile) * cd[D_TILE_STRIDE] + (t % tile) * cd[D_TOKEN_STRIDE]


@njit(inline="always", **JIT)
def load_strips(addr, cd, dt, buf):  # type: ignore[no-untyped-def]
    """A cache row of ``buf.shape[0]`` floats of code ``dt`` (one head of one slot, from ``addr``) into
    ``buf``, strip by strip (descriptor ``cd``)."""
    strip = cd[D_STRIP]
    for i in range(buf.shape[0] // strip):
        load_row(addr + i * cd[D_STRIP_STRIDE], cd[D_DIM_STRIDE], dt, buf[i * strip:(i + 1) * strip])


@njit(inline="always", **JIT)
def ldbits(addr, esz):  # type: ignore[no-untyped-def]
    if esz == 2:
        return ld_u16(addr)
    if esz == 4:
        return ld_u32(addr)
    if esz == 8:
        return ld_i64(addr)
    return ld_u8(addr)


@njit(inline="always", **JIT)
def _differs(a, sa, b, cd, esz, nd):  # type: ignore[no-untyped-def]
    """Whether ``nd`` elements of ``esz`` bytes at ``a`` (stride ``sa``) and a cache row at ``b``
    (descriptor ``cd``'s strips) differ in any bit; 8 bytes at a time where both rows are contiguous,
    4 where each strip is."""
    sb, strip = cd[D_DIM_STRIDE], cd[D_STRIP]
    if sa == esz and sb == esz and strip == nd and (nd * esz) % 8 == 0:
        for w in range(nd * esz // 8):
            if ld_i64(a + 8 * w) != ld_i64(b + 8 * w):
                return True
        return False
    if sa == esz and sb == esz and (strip * esz) % 4 == 0:  # strips contiguous on both sides: 4-byte words
        words = strip * esz // 4  # (vLLM's amx K: one word, a dimension pair, a cache line)
        for i in range(nd // strip):
            ai, bi = a + 4 * words * i, b + i * cd[D_STRIP_STRIDE]
            for w in range(words):
                if ld_u32(ai + 4 * w) != ld_u32(bi + 4 * w):
                    return True
        return False
    for i in range(nd // strip):
        ai, bi = a + i * strip * sa, b + i * cd[D_STRIP_STRIDE]
        for d in range(strip):
            if ldbits(ai + d * sa, esz) != ldbits(bi + d * sb, esz):
                return True
    return False


@njit(inline="always", **JIT)
def _prefetch_rows(a, nbytes):  # type: ignore[no-untyped-def]
    """Hint the cache lines of ``nbytes`` contiguous bytes from ``a`` into the caches."""
    for b in range(0, nbytes + 63, 64):
        prefetch(min(a + b, a + nbytes - 1))


@njit(inline="always", **JIT)
def _error(ck, cv, dt, qv, ov, step, r, lo, p, kvh, cached, shift, limit, scale, softcap, sink, has_sink,
           logits, slots, out, row):  # type: ignore[no-untyped-def]
    """One query's error against attention over positions ``[lo, p]`` of row ``r`` (the cached ones
    read ``shift`` blocks on), -1 where a position has no slot in the pool, and its
    probability-weighted mean |logit|. ``row``: scratch of the head size."""
    bs = ck[D_BLOCK]
    n = p - lo + 1
    nd = qv.shape[0]
    # every position's slot first, each K and V row hinted into the caches where it is contiguous: the
    # rows are in memory (spread over the pool's blocks), and loaded one by one each waits for its own
    esz = 4 if dt == 0 else 2
    hint_k = ck[D_DIM_STRIDE] == esz and ck[D_STRIP] == nd
    hint_v = cv[D_DIM_STRIDE] == esz and cv[D_STRIP] == nd
    for j in range(n):
        s = lookup(step, r, lo + j)
        if s < 0 or s > limit:  # no slot (or none in the pool: the canary's verify reports that)
            return -1.0, 0.0
        if shift != 0 and lo + j < cached:
            s = min(max(s + shift * bs, 0), limit)
        slots[j] = s
        if hint_k:
            _prefetch_rows(slot_at(ck, s) + kvh * ck[D_HEAD_STRIDE], nd * esz)
        if hint_v:
            _prefetch_rows(slot_at(cv, s) + kvh * cv[D_HEAD_STRIDE], nd * esz)
    mx = -math.inf
    for j in range(n):
        s = slots[j]
        load_strips(slot_at(ck, s) + kvh * ck[D_HEAD_STRIDE], ck, dt, row)
        x = 0.0
        for d in range(nd):
            x += qv[d] * row[d]
        x *= scale
        if softcap > 0:
            x = softcap * math.tanh(x / softcap)
        logits[j] = x
        mx = max(mx, x)
    if has_sink:
        mx = max(mx, sink)
    den = math.exp(sink - mx) if has_sink else 0.0
    weighted = 0.0
    for j in range(n):
        x = logits[j]
        logits[j] = math.exp(x - mx)
        den += logits[j]
        weighted += logits[j] * abs(x)
    for d in range(nd):
        out[d] = 0.0
    vmax = 0.0
    for j in range(n):
        s = slots[j]
        load_strips(slot_at(cv, s) + kvh * cv[D_HEAD_STRIDE], cv, dt, row)
        w = logits[j] / den
        for d in range(nd):
            out[d] += w * row[d]
            vmax = max(vmax, abs(row[d]))
    err = 0.0
    for d in range(nd):
        e = abs(ov[d] - out[d])
        if not e <= 1e300:  # NaN or infinite
            return 1e6, weighted / den
        err = max(err, e)
    return err / max(vmax, 1e-30), weighted / den


@njit(inline="always", **JIT)
def _check_write(c, ka, va, strides, step, t):  # type: ignore[no-untyped-def]
    """Batch token ``t``'s write check in one layer (layer row ``c``, its computed K and V at ``ka`` and
    ``va``): whether its K (bit 1) and V (bit 2) rows differ from the cache's at its slot, and the
    first KV head that differs (0: none; a token without a slot: ``(0, 0)``)."""
    s = rd(step, NS, t)
    if s < 0:
        return 0, 0
    esz, nh, nd = c[L_ESIZE], c[L_HEADS], c[L_DIM]
    ck, cv = c[L_K:L_K + DESCRIPTOR_COLUMNS], c[L_V:L_V + DESCRIPTOR_COLUMNS]
    kb, vb = slot_at(ck, s), slot_at(cv, s)
    hf = 0
    first = -1
    for h in range(nh):
        if _differs(ka + t * strides[S_K] + h * strides[S_K + 1], strides[S_K + 2], kb + h * ck[D_HEAD_STRIDE], ck,
                    esz, nd):
            hf |= 1
            first = h if first < 0 else first
        if _differs(va + t * strides[S_V] + h * strides[S_V + 1], strides[S_V + 2], vb + h * cv[D_HEAD_STRIDE], cv,
                    esz, nd):
            hf |= 2
            first = h if first < 0 else first
    return hf, first if first >= 0 else 0


@njit(inline="always", **JIT)
def _prefetch_writes(c, ka, va, strides, step, toks):  # type: ignore[no-untyped-def]
    """Hint the rows :func:`_check_writes` compares into the caches, where each head's row is contiguous
    on both sides (token-major caches): after the forward they are in memory, and compared one by one
    each waits for its own lines; hinted first, their loads overlap."""
    esz, nh, nd = c[L_ESIZE], c[L_HEADS], c[L_DIM]
    n = nd * esz
    ck, cv = c[L_K:L_K + DESCRIPTOR_COLUMNS], c[L_V:L_V + DESCRIPTOR_COLUMNS]
    if ck[D_DIM_STRIDE] != esz or cv[D_DIM_STRIDE] != esz or ck[D_STRIP] != nd or cv[D_STRIP] != nd \
            or strides[S_K + 2] != esz or strides[S_V + 2] != esz:
        return
    for i in range(toks.shape[0]):
        t = toks[i]
        s = rd(step, NS, t)
        if s < 0:
            continue
        kb, vb = slot_at(ck, s), slot_at(cv, s)
        for h in range(nh):
            _prefetch_rows(kb + h * ck[D_HEAD_STRIDE], n)
            _prefetch_rows(vb + h * cv[D_HEAD_STRIDE], n)
            _prefetch_rows(ka + t * strides[S_K] + h * strides[S_K + 1], n)
            _prefetch_rows(va + t * strides[S_V] + h * strides[S_V + 1], n)


@njit(inline="always", **JIT)
def _check_writes(c, ka, va, strides, steps, toks, half, head):  # type: ignore[no-untyped-def]
    """One layer's write check (layer row ``c``, its computed K and V at ``ka`` and ``va``):
    :func:`check_forward`'s ``half`` and ``head`` rows of that layer."""
    step = steps[c[L_STEP]]
    for i in range(toks.shape[0]):
        half[i], head[i] = _check_write(c, ka, va, strides, step, toks[i])


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
def keep_layer(layers, lay, ka, va, strides, steps, toks, half, head, fsrc, fruns, fkeys, lfold, frow, frkeys, facc,
               fcnt):  # type: ignore[no-untyped-def]
    """Inside one layer's forward, right after its cache write and before its attention reads the
    cache (the written rows and the computed ones are still in the core's caches): its write check
    (``ka``: its computed K's address, 0: none; ``va``: its V's) into the ``half`` and ``head`` rows of
    layer ``lay`` (see :func:`check_forward`), and the layer's part of every new token's fingerprint.

    The fold: sources ``lfold[lay, 0]`` to ``lfold[lay, 1]`` of the source table
    ``fsrc``/``fruns``/``fkeys`` (:class:`kvcanary.fused._core.SourceTable`'s arrays, every group's
    together) are added into ``facc[g, t]`` for new token ``t`` of the layer's step ``g``, and counted in
    ``fcnt[g, t]`` (``facc`` of no columns: nothing folded). A token whose write check found the cache
    equal to its computed K and V is folded from those rows (contiguous: a loop the compiler
    vectorises), where every source of the layer has its keys in a row's order (``frow[i, 0] >= 0``,
    ``frkeys``) and the rows are contiguous; any other from the cache."""
    c = layers[lay]
    g = c[L_STEP]
    step = steps[g]
    f0, f1 = lfold[lay, 0], lfold[lay, 1]
    nf = min(facc.shape[1], step[NNEW]) if 0 <= f0 < f1 <= fsrc.shape[0] and facc.shape[1] > 0 else 0
    nw = toks.shape[0] if ka != 0 else 0
    hrow, drow = half[lay], head[lay]
    esz, nd = c[L_ESIZE], c[L_DIM]
    # fold from the computed rows: both contiguous, and every source of the layer keyed in a row's order
    rows = (nf > 0 and nw > 0 and f1 <= frow.shape[0] and strides[S_K + 2] == esz and strides[S_K + 1] == nd * esz
            and strides[S_V + 2] == esz and strides[S_V + 1] == nd * esz)
    if rows:
        for i in range(f0, f1):
            if frow[i, 0] < 0:
                rows = False
    ft = 0
    for i in range(nw):
        t = toks[i]
        hf, first = _check_write(c, ka, va, strides, step, t)
        hrow[i], drow[i] = hf, first
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
        _fold_token(c, step, g, t, f0, f1, fsrc, fruns, fkeys, facc, fcnt)


# keep_layer's tables, in its order, for keep_layer_at: each one's name, dimensions and dtype
KEEP_TABLES = tuple((name, nd, np.dtype(dt)) for name, nd, dt in (
    ("layers", 2, np.int64), ("strides", 1, np.int64), ("steps", 2, np.int64), ("toks", 1, np.int64),
    ("half", 2, np.int64), ("head", 2, np.int64), ("fsrc", 2, np.int64), ("fruns", 1, np.int64),
    ("fkeys", 1, np.uint64), ("lfold", 2, np.int64), ("frow", 2, np.int64), ("frkeys", 1, np.uint64),
    ("facc", 2, np.uint64), ("fcnt", 2, np.int64)))


def keep_tables(*tables: np.ndarray) -> np.ndarray:
    """:func:`keep_layer`'s tables (``KEEP_TABLES``' order, after ``lay``, ``ka`` and ``va``) as one
    int64 array of each one's address and shape (three columns each), for :func:`keep_layer_at`. The
    tables must outlive its use; each must be C-contiguous, of its dimensions and dtype. Made once a
    forward: the addresses are read by a compiled call (numpy's array interface costs a microsecond
    a table)."""
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
def keep_layer_at(at, lay, ka, va):  # type: ignore[no-untyped-def]
    """:func:`keep_layer` with its tables given by address (``at``: :func:`keep_tables`): the call
    runs inside every layer, where the dispatcher's checks of 14 arrays cost more than the write
    check of a decode batch; four arguments cost it a fraction."""
    keep_layer(_i2(at, 0), lay, ka, va, _i1(at, 1), _i2(at, 2), _i1(at, 3), _i2(at, 4), _i2(at, 5), _i2(at, 6),
               _i1(at, 7), _u1(at, 8), _i2(at, 9), _i2(at, 10), _u1(at, 11), _u2(at, 12), _i2(at, 13))


@njit(**JIT)
def keep_queries(layers, lay, qa, oa, strides, qt, kept):  # type: ignore[no-untyped-def]
    """After one layer's attention, a copy of its audited queries' rows, the query at ``qa`` and the
    output at ``oa``, into ``kept`` (``[S, 2, dim * element size]`` bytes: a query's table row ``s``
    holds its query at ``[s, 0]`` and its output at ``[s, 1]``), for :func:`check_forward` after the
    forward: the engine may reuse those tensors' memory in a later layer."""
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


@njit(**JIT)
def check_forward(layers, ptrs, strides, steps, toks, qt, fl, half, head, err, shift, tols,
                  gathered):  # type: ignore[no-untyped-def]
    """Every layer's write check and audited queries of one forward in one call (the tables' columns:
    :mod:`kvcanary.audit.tables`).

    ``layers``: the layer table (``[L, LAYER_COLUMNS]``); ``ptrs[l]``: the addresses of layer
    ``l``'s computed K and V (0: no write check) and of its queries and outputs (0: no audit) this
    forward; ``strides``: their token, head and dim strides in bytes; ``steps``: the step
    descriptors the layers' ``L_STEP`` name. ``toks``: the batch tokens whose writes are checked:
    ``half[l, i]`` says whether token ``toks[i]``'s computed K (bit 1) and V (bit 2) rows differ
    from the cache's rows at its slot, ``head[l, i]`` the first KV head that differs.

    ``qt``: the query table (``[S, QUERY_COLUMNS]``); ``fl``: the float table (each layer's scale,
    soft-cap, tolerance base and slope, then the sinks' logits); ``gathered``: the queries and
    outputs hold the sampled rows only (a query's ``Q_LOCAL`` row). Fills ``err`` with each query's
    error (:func:`kvcanary.audit.reference.error`; -1: a position without a slot), ``tols`` with its
    tolerance, and ``shift`` with +1 or -1 where reading every cached block one page on or back
    gives the engine's output (tried above the tolerance only)."""
    ahead = 2  # layers whose rows are hinted before the one compared
    for lay in range(-ahead, layers.shape[0]):
        nxt = lay + ahead
        if nxt < layers.shape[0] and ptrs[nxt, PTR_K] != 0:
            c = layers[nxt]
            _prefetch_writes(c, ptrs[nxt, PTR_K], ptrs[nxt, PTR_V], strides, steps[c[L_STEP]], toks)
        if lay >= 0 and ptrs[lay, PTR_K] != 0:
            _check_writes(layers[lay], ptrs[lay, PTR_K], ptrs[lay, PTR_V], strides, steps, toks, half[lay], head[lay])
    if qt.shape[0] == 0:
        return
    width = 1
    nd_max = 1
    for s in range(qt.shape[0]):
        width = max(width, qt[s, Q_POSITION] - qt[s, Q_START] + 1)
        nd_max = max(nd_max, layers[qt[s, Q_LAYER], L_DIM])
    logits = np.empty(width, dtype=np.float64)
    slots = np.empty(width, dtype=np.int64)
    out = np.empty(nd_max, dtype=np.float64)
    qv = np.empty(nd_max, dtype=np.float64)
    ov = np.empty(nd_max, dtype=np.float64)
    scratch = np.empty(nd_max, dtype=np.float64)
    for s in range(qt.shape[0]):
        k, lay, r, tok, hd, kvh = qt[s, Q_PICKED], qt[s, Q_LAYER], qt[s, Q_ROW], qt[s, Q_TOKEN], qt[s, Q_HEAD], qt[s, Q_KV_HEAD]
        p, lo, cached, si = qt[s, Q_POSITION], qt[s, Q_START], qt[s, Q_CACHED], qt[s, Q_SINK]
        c = layers[lay]
        qa, oa = ptrs[lay, PTR_Q], ptrs[lay, PTR_O]
        if qa == 0:
            continue
        nd, dq = c[L_DIM], c[L_QCODE]
        ck, cv, step = c[L_K:L_K + DESCRIPTOR_COLUMNS], c[L_V:L_V + DESCRIPTOR_COLUMNS], steps[c[L_STEP]]
        f0 = FLOATS_PER_LAYER * lay
        scale, softcap = fl[f0 + F_SCALE], fl[f0 + F_SOFTCAP]
        base, slope = fl[f0 + F_TOL_BASE], fl[f0 + F_TOL_SLOPE]
        qs, os_, row = qv[:nd], ov[:nd], scratch[:nd]
        tq, hq = (qt[s, Q_LOCAL], 0) if gathered else (tok, hd)
        load_row(qa + tq * strides[S_Q] + hq * strides[S_Q + 1], strides[S_Q + 2], dq, qs)
        load_row(oa + tq * strides[S_O] + hq * strides[S_O + 1], strides[S_O + 2], dq, os_)
        has_sink = si >= 0
        sink = fl[si] if has_sink else 0.0
        e, mean = _error(ck, cv, c[L_CODE], qs, os_, step, r, lo, p, kvh, cached, 0, c[L_MAX_SLOT], scale, softcap,
                         sink, has_sink, logits, slots, out, row)
        tol = base + slope * mean
        err[k] = e
        tols[k] = tol
        shift[k] = 0
        if e > tol:
            for sh in (1, -1):
                if _error(ck, cv, c[L_CODE], qs, os_, step, r, lo, p, kvh, cached, sh, c[L_MAX_SLOT], scale, softcap,
                          sink, has_sink, logits, slots, out, row)[0] <= tol:
                    shift[k] = sh
                    break
