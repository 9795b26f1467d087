"""The write check and the read audit (:mod:`kvcanary.audit`) as compiled CPU loops: one call per
layer for each, on tensors passed as byte descriptors, so a protected forward pays a few
microseconds per layer instead of a few dozen torch ops.

Descriptors (int64 arrays, byte addresses and byte strides):

- a row tensor (computed K or V, queries, attention outputs): ``(address, token stride, head
  stride, dim stride)``;
- a cache: ``(address, block size, block stride, token-in-block stride, head stride, dim stride)``;
  the element (slot ``s``, head ``h``, dim ``d``) lives at ``address + (s // block) * block stride
  + (s % block) * token stride + h * head stride + d * dim stride`` (transformers' token rows,
  vLLM's ``vec`` and ``vec16`` layouts).

Floats are read as fp32 (code 0), bf16 (1) or fp16 (2) and computed in float64; the write check
compares raw bits (2 or 4 bytes an element). Both equal the torch reference
(:func:`kvcanary.audit.attend`, :func:`kvcanary.audit.write_mismatch`) within float rounding.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvcanary import audit
from kvcanary.fused._core import JIT, ld_i64, ld_u8, ld_u16, ld_u32
from kvcanary.fused._step import NS, lookup, rd
from kvcanary.fused.cache import njit

DTYPES = audit.DTYPES


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
def ldbits(addr, esz):  # type: ignore[no-untyped-def]
    if esz == 2:
        return ld_u16(addr)
    if esz == 4:
        return ld_u32(addr)
    if esz == 8:
        return ld_i64(addr)
    return ld_u8(addr)


@njit(inline="always", **JIT)
def _differs(a, sa, b, sb, esz, nd):  # type: ignore[no-untyped-def]
    """Whether ``nd`` elements of ``esz`` bytes at ``a`` (stride ``sa``) and ``b`` (stride ``sb``) differ
    in any bit; 8 bytes at a time where both runs are contiguous."""
    if sa == esz and sb == esz and (nd * esz) % 8 == 0:
        for w in range(nd * esz // 8):
            if ld_i64(a + 8 * w) != ld_i64(b + 8 * w):
                return True
        return False
    for d in range(nd):
        if ldbits(a + d * sa, esz) != ldbits(b + d * sb, esz):
            return True
    return False


@njit(inline="always", **JIT)
def _error(ck, cv, dt, qv, ov, step, r, lo, p, kvh, cached, shift, limit, scale, softcap, sink, has_sink,
           logits, slots, out, row):  # type: ignore[no-untyped-def]
    """One query's error against attention over positions ``[lo, p]`` of row ``r`` (the cached ones
    read ``shift`` blocks on), -1 where a position has no slot in the pool, and its
    probability-weighted mean |logit|. ``row``: scratch of the head size."""
    bs = ck[1]
    n = p - lo + 1
    nd = qv.shape[0]
    mx = -math.inf
    for j in range(n):
        s = lookup(step, r, lo + j)
        if s < 0 or s > limit:  # no slot (or none in the pool: the canary's verify reports that)
            return -1.0, 0.0
        if shift != 0 and lo + j < cached:
            s = min(max(s + shift * bs, 0), limit)
        slots[j] = s
        load_row(ck[0] + (s // bs) * ck[2] + (s % bs) * ck[3] + kvh * ck[4], ck[5], dt, row)
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
        load_row(cv[0] + (s // bs) * cv[2] + (s % bs) * cv[3] + kvh * cv[4], cv[5], dt, row)
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


def step_desc(step: torch.Tensor) -> np.ndarray:
    """A step's descriptor (:func:`kvcanary.fused._step.describe`), for :func:`audit_queries`'s ``steps``."""
    from kvcanary.fused._step import describe

    return describe(step)  # type: ignore[arg-type]


@njit(**JIT)
def check_forward(layers, ptrs, strides, steps, toks, qt, fl, half, head, err, shift, tols,
                  gathered):  # type: ignore[no-untyped-def]
    """Every layer's write check and audited queries of one forward in one call.

    ``layers[l]``: layer ``l``'s cache K and V (cache descriptors, 6 each), then the index of its
    step in ``steps`` (its table and new slots), the cache's float code, the element size, the KV
    heads, the head size, the largest slot, the queries' float code. ``ptrs[l]``: the addresses of
    its computed K and V (0: no write check) and of its queries and outputs (0: no audit) this
    forward; ``strides``: their token, head and channel strides in bytes (K, V, queries, outputs).
    ``toks``: the batch tokens whose writes are checked: ``half[l, i]`` says whether token
    ``toks[i]``'s computed K (bit 1) and V (bit 2) rows differ from the cache's rows at its slot,
    ``head[l, i]`` the first KV head that differs.

    ``qt[s]``: audited query ``s``'s index in the forward's list, layer ``l``, step row, batch
    token, head, KV head, position, window start, the row's tokens cached before this forward, its
    sink logit's index in ``fl`` (-1: none) and its index among its layer's queries (the row of
    the queries and outputs where they are the sampled rows only, ``gathered``). ``fl[4 * l : 4 * l
    + 4]``: layer ``l``'s scale, soft-cap (0: none), and tolerance base and slope
    (:data:`kvcanary.audit.TOLERANCE`). Fills ``err`` with each query's error
    (:func:`kvcanary.audit.error`; -1: a position without a slot), ``tols`` with its tolerance,
    and ``shift`` with +1 or -1 where reading every cached block one page on or back gives the
    engine's output (tried above the tolerance only)."""
    for lay in range(layers.shape[0]):
        c = layers[lay]
        ka, va = ptrs[lay, 0], ptrs[lay, 1]
        if ka == 0:
            continue
        step = steps[c[12]]
        esz, nh, nd, bs = c[14], c[15], c[16], c[1]
        for i in range(toks.shape[0]):
            t = toks[i]
            s = rd(step, NS, t)
            half[lay, i] = 0
            head[lay, i] = 0
            if s < 0:
                continue
            kb = c[0] + (s // bs) * c[2] + (s % bs) * c[3]
            vb = c[6] + (s // c[7]) * c[8] + (s % c[7]) * c[9]
            hf = 0
            first = -1
            for h in range(nh):
                if _differs(ka + t * strides[0] + h * strides[1], strides[2], kb + h * c[4], c[5], esz, nd):
                    hf |= 1
                    first = h if first < 0 else first
                if _differs(va + t * strides[3] + h * strides[4], strides[5], vb + h * c[10], c[11], esz, nd):
                    hf |= 2
                    first = h if first < 0 else first
            half[lay, i] = hf
            head[lay, i] = first if first >= 0 else 0
    if qt.shape[0] == 0:
        return
    width = 1
    nd_max = 1
    for s in range(qt.shape[0]):
        width = max(width, qt[s, 6] - qt[s, 7] + 1)
        nd_max = max(nd_max, layers[qt[s, 1], 16])
    logits = np.empty(width, dtype=np.float64)
    slots = np.empty(width, dtype=np.int64)
    out = np.empty(nd_max, dtype=np.float64)
    qv = np.empty(nd_max, dtype=np.float64)
    ov = np.empty(nd_max, dtype=np.float64)
    scratch = np.empty(nd_max, dtype=np.float64)
    for s in range(qt.shape[0]):
        k, lay, r, tok, hd, kvh, p, lo, cached, si = (qt[s, 0], qt[s, 1], qt[s, 2], qt[s, 3], qt[s, 4], qt[s, 5],
                                                      qt[s, 6], qt[s, 7], qt[s, 8], qt[s, 9])
        c = layers[lay]
        qa, oa = ptrs[lay, 2], ptrs[lay, 3]
        if qa == 0:
            continue
        nd, dq = c[16], c[18]
        ck, cv, step = c[0:6], c[6:12], steps[c[12]]
        scale, softcap, base, slope = fl[4 * lay], fl[4 * lay + 1], fl[4 * lay + 2], fl[4 * lay + 3]
        qs, os_, row = qv[:nd], ov[:nd], scratch[:nd]
        tq, hq = (qt[s, 10], 0) if gathered else (tok, hd)
        load_row(qa + tq * strides[6] + hq * strides[7], strides[8], dq, qs)
        load_row(oa + tq * strides[9] + hq * strides[10], strides[11], dq, os_)
        has_sink = si >= 0
        sink = fl[si] if has_sink else 0.0
        e, mean = _error(ck, cv, c[13], qs, os_, step, r, lo, p, kvh, cached, 0, c[17], scale, softcap, sink,
                         has_sink, logits, slots, out, row)
        tol = base + slope * mean
        err[k] = e
        tols[k] = tol
        shift[k] = 0
        if e > tol:
            for sh in (1, -1):
                if _error(ck, cv, c[13], qs, os_, step, r, lo, p, kvh, cached, sh, c[17], scale, softcap, sink,
                          has_sink, logits, slots, out, row)[0] <= tol:
                    shift[k] = sh
                    break
