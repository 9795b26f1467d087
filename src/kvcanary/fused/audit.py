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
  (:func:`kvcanary.fused.rows.slot_at`): at plain strides (transformers' token rows, vLLM's ``vec`` and ``vec16``
  layouts) a tile is the block and a strip the head; vLLM's ``amx`` layout interleaves 16-token
  tiles of K and 16-dim strips of V.

Floats are read as fp32 (code 0), bf16 (1) or fp16 (2) (:mod:`kvcanary.fused.rows`) and computed in float64; the write check
compares raw bits (2 or 4 bytes an element). Both equal the torch reference
(:func:`kvcanary.audit.reference.attend`, :func:`kvcanary.audit.reference.write_mismatch`) within float rounding.

vLLM's per-layer calls, which hand this module's one call after the forward what it needs of each
layer, are :mod:`kvcanary.fused.keep`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray

from kvcanary.audit.tables import (D_BLOCK, D_DIM_STRIDE, D_HEAD_STRIDE, D_STRIP, D_STRIP_STRIDE, DESCRIPTOR_COLUMNS,
                                   F_SCALE, F_SOFTCAP, F_TOL_BASE, F_TOL_SLOPE, FLOATS_PER_LAYER, L_CODE, L_DIM, L_ESIZE,
                                   L_HEADS, L_K, L_MAX_SLOT, L_QCODE, L_STEP, L_V, LAYER_COLUMNS, PTR_K, PTR_O, PTR_Q,
                                   PTR_V, Q_CACHED, Q_HEAD, Q_KV_HEAD, Q_LAYER, Q_LOCAL, Q_PICKED, Q_POSITION, Q_ROW,
                                   Q_SINK, Q_START, Q_TOKEN, S_K, S_O, S_Q, S_V)
from kvcanary.fused._core import JIT, i64_pointer, ld_i64, ld_u8, ld_u16, ld_u32, prefetch_bytes
from kvcanary.fused._step import NS, lookup, rd
from kvcanary.fused.cache import njit
from kvcanary.fused.rows import dot, load_row, load_strips, slot_at


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
def _words_differ(a, b, n):  # type: ignore[no-untyped-def]
    """Whether ``n`` 8-byte words at ``a`` and at ``b`` differ in any bit: their XORs ORed together, a
    loop the compiler vectorises (arrays over the words; an early exit, or loads through raw
    addresses, keep it from doing so)."""
    x, y = carray(i64_pointer(a), n), carray(i64_pointer(b), n)
    acc = 0
    for w in range(n):
        acc |= x[w] ^ y[w]
    return acc != 0


@njit(inline="always", **JIT)
def _differs(a, sa, b, cd, esz, nd):  # type: ignore[no-untyped-def]
    """Whether ``nd`` elements of ``esz`` bytes at ``a`` (stride ``sa``) and a cache row at ``b``
    (descriptor ``cd``'s strips) differ in any bit; 8 bytes at a time where both rows are contiguous,
    4 where each strip is."""
    sb, strip = cd[D_DIM_STRIDE], cd[D_STRIP]
    if sa == esz and sb == esz and strip == nd and (nd * esz) % 8 == 0:
        return _words_differ(a, b, nd * esz // 8)
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
def _error(ck, cv, dt, qv, ov, step, r, lo, p, kvh, cached, shift, limit, scale, softcap, sink, has_sink,
           logits, slots, out, row, vm):  # type: ignore[no-untyped-def]
    """One query's error against attention over positions ``[lo, p]`` of row ``r`` (the cached ones
    read ``shift`` blocks on), -1 where a position has no slot in the pool, and its
    probability-weighted mean |logit|. ``row``, ``vm``: scratch of the head size."""
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
            prefetch_bytes(slot_at(ck, s) + kvh * ck[D_HEAD_STRIDE], nd * esz)
        if hint_v:
            prefetch_bytes(slot_at(cv, s) + kvh * cv[D_HEAD_STRIDE], nd * esz)
    mx = -math.inf
    for j in range(n):
        s = slots[j]
        load_strips(slot_at(ck, s) + kvh * ck[D_HEAD_STRIDE], ck, dt, row)
        x = dot(qv, row, nd) * scale
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
        vm[d] = 0.0
    for j in range(n):
        s = slots[j]
        load_strips(slot_at(cv, s) + kvh * cv[D_HEAD_STRIDE], cv, dt, row)
        w = logits[j] / den
        for d in range(nd):  # every dimension on its own (one running maximum waits for the last)
            out[d] += w * row[d]
            vm[d] = max(vm[d], abs(row[d]))
    vmax = 0.0
    for d in range(nd):
        vmax = max(vmax, vm[d])
    err = 0.0
    for d in range(nd):
        e = abs(ov[d] - out[d])
        if not e <= 1e300:  # NaN or infinite
            return 1e6, weighted / den
        err = max(err, e)
    return err / max(vmax, 1e-30), weighted / den


@njit(inline="always", **JIT)
def _whole_rows(cd, strides, col, esz, nd, row):  # type: ignore[no-untyped-def]
    """Whether a token's computed row (``strides[col:col + 3]``) and its cache row (descriptor ``cd``)
    each hold its heads one after another, every element contiguous."""
    return (strides[col + 2] == esz and strides[col + 1] == row and cd[D_DIM_STRIDE] == esz and cd[D_STRIP] == nd
            and cd[D_HEAD_STRIDE] == row)


@njit(inline="always", **JIT)
def check_write(c, ka, va, strides, step, t):  # type: ignore[no-untyped-def]
    """Batch token ``t``'s write check in one layer (layer row ``c``, its computed K and V at ``ka`` and
    ``va``): whether its K (bit 1) and V (bit 2) rows differ from the cache's at its slot, and the
    first KV head that differs (0: none; a token without a slot: ``(0, 0)``)."""
    s = rd(step, NS, t)
    if s < 0:
        return 0, 0
    esz, nh, nd = c[L_ESIZE], c[L_HEADS], c[L_DIM]
    ck, cv = c[L_K:L_K + DESCRIPTOR_COLUMNS], c[L_V:L_V + DESCRIPTOR_COLUMNS]
    kb, vb = slot_at(ck, s), slot_at(cv, s)
    row = nd * esz
    if (row * nh) % 8 == 0 and _whole_rows(ck, strides, S_K, esz, nd, row) and _whole_rows(cv, strides, S_V, esz, nd,
                                                                                          row):
        # each side's heads one after another (transformers' token rows): the whole token at once, and
        # head by head only where it differs (rare)
        if not _words_differ(ka + t * strides[S_K], kb, row * nh // 8) \
                and not _words_differ(va + t * strides[S_V], vb, row * nh // 8):
            return 0, 0
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
    whole = _whole_rows(ck, strides, S_K, esz, nd, n) and _whole_rows(cv, strides, S_V, esz, nd, n)
    for i in range(toks.shape[0]):
        t = toks[i]
        s = rd(step, NS, t)
        if s < 0:
            continue
        kb, vb = slot_at(ck, s), slot_at(cv, s)
        if whole:  # each side's heads one after another: a token's row at once
            prefetch_bytes(kb, n * nh)
            prefetch_bytes(vb, n * nh)
            prefetch_bytes(ka + t * strides[S_K], n * nh)
            prefetch_bytes(va + t * strides[S_V], n * nh)
            continue
        for h in range(nh):
            prefetch_bytes(kb + h * ck[D_HEAD_STRIDE], n)
            prefetch_bytes(vb + h * cv[D_HEAD_STRIDE], n)
            prefetch_bytes(ka + t * strides[S_K] + h * strides[S_K + 1], n)
            prefetch_bytes(va + t * strides[S_V] + h * strides[S_V + 1], n)


@njit(inline="always", **JIT)
def _check_writes(c, ka, va, strides, steps, toks, half, head):  # type: ignore[no-untyped-def]
    """One layer's write check (layer row ``c``, its computed K and V at ``ka`` and ``va``):
    :func:`check_forward`'s ``half`` and ``head`` rows of that layer."""
    step = steps[c[L_STEP]]
    for i in range(toks.shape[0]):
        half[i], head[i] = check_write(c, ka, va, strides, step, toks[i])


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
    from the cache's rows at its slot, ``head[l, i]`` the first KV head that differs (both zeroed
    first, so they may be reused from one forward to the next). Returns how many entries of ``half``
    are not 0.

    ``qt``: the query table (``[S, QUERY_COLUMNS]``); ``fl``: the float table (each layer's scale,
    soft-cap, tolerance base and slope, then the sinks' logits); ``gathered``: the queries and
    outputs hold the sampled rows only (a query's ``Q_LOCAL`` row). Fills ``err`` with each query's
    error (:func:`kvcanary.audit.reference.error`; -1: a position without a slot), ``tols`` with its
    tolerance, and ``shift`` with +1 or -1 where reading every cached block one page on or back
    gives the engine's output (tried above the tolerance only)."""
    half[:, :] = 0
    head[:, :] = 0
    ahead = 2  # layers whose rows are hinted before the one compared
    for lay in range(-ahead, layers.shape[0]):
        nxt = lay + ahead
        if nxt < layers.shape[0] and ptrs[nxt, PTR_K] != 0:
            c = layers[nxt]
            _prefetch_writes(c, ptrs[nxt, PTR_K], ptrs[nxt, PTR_V], strides, steps[c[L_STEP]], toks)
        if lay >= 0 and ptrs[lay, PTR_K] != 0:
            _check_writes(layers[lay], ptrs[lay, PTR_K], ptrs[lay, PTR_V], strides, steps, toks, half[lay], head[lay])
    differ = 0
    for lay in range(half.shape[0]):
        for i in range(half.shape[1]):
            if half[lay, i] != 0:
                differ += 1
    if qt.shape[0] == 0:
        return differ
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
    vmax = np.empty(nd_max, dtype=np.float64)
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
        qs, os_, row, vm = qv[:nd], ov[:nd], scratch[:nd], vmax[:nd]
        tq, hq = (qt[s, Q_LOCAL], 0) if gathered else (tok, hd)
        load_row(qa + tq * strides[S_Q] + hq * strides[S_Q + 1], strides[S_Q + 2], dq, qs)
        load_row(oa + tq * strides[S_O] + hq * strides[S_O + 1], strides[S_O + 2], dq, os_)
        has_sink = si >= 0
        sink = fl[si] if has_sink else 0.0
        e, mean = _error(ck, cv, c[L_CODE], qs, os_, step, r, lo, p, kvh, cached, 0, c[L_MAX_SLOT], scale, softcap,
                         sink, has_sink, logits, slots, out, row, vm)
        tol = base + slope * mean
        err[k] = e
        tols[k] = tol
        shift[k] = 0
        if e > tol:
            for sh in (1, -1):
                if _error(ck, cv, c[L_CODE], qs, os_, step, r, lo, p, kvh, cached, sh, c[L_MAX_SLOT], scale, softcap,
                          sink, has_sink, logits, slots, out, row, vm)[0] <= tol:
                    shift[k] = sh
                    break
    return differ
