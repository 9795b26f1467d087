"""A cache row's or a query row's floats for the compiled read audit (:mod:`kvcanary.fused.audit`):
where an element lives (:func:`slot_at`, the cache descriptor's formula), the loads of fp32, bf16
and fp16 as float64 (a contiguous row through an array, which the compiler puts in vectors; any
other stride element by element), and the dot product of two rows.

Float codes: 0 fp32, 1 bf16, 2 fp16.
"""

from __future__ import annotations

from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from kvcanary.audit.tables import (D_BLOCK, D_BLOCK_STRIDE, D_DIM_STRIDE, D_STRIP, D_STRIP_STRIDE, D_TILE,
                                   D_TILE_STRIDE, D_TOKEN_STRIDE)
from kvcanary.fused._core import JIT, ld_u16, ld_u32, u16_pointer, u32_pointer
from kvcanary.fused.cache import njit


def _value_of(bits: int, fp16: bool):  # type: ignore[no-untyped-def]
    """An intrinsic giving a float's bits (any integer, its low ``bits`` taken) as a float64: bfloat16
    (16 bits put on top of a float32's), float16 or float32. An operation on a value, which the
    compiler puts in vectors where a loop loads the bits through an array (loads through raw
    addresses stay single)."""
    @intrinsic
    def value(typingctx, raw):  # type: ignore[no-untyped-def]
        if not isinstance(raw, types.Integer):
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            v = args[0]
            if v.type.width > bits:
                v = builder.trunc(v, ir.IntType(bits))
            elif v.type.width < bits:
                v = builder.zext(v, ir.IntType(bits))
            if fp16:
                f = builder.bitcast(v, ir.HalfType())
            elif bits == 16:
                f = builder.bitcast(builder.shl(builder.zext(v, ir.IntType(32)), ir.Constant(ir.IntType(32), 16)),
                                    ir.FloatType())
            else:
                f = builder.bitcast(v, ir.FloatType())
            return builder.fpext(f, ir.DoubleType())

        return types.float64(raw), codegen

    return value


bf16_value, f16_value, f32_value = _value_of(16, False), _value_of(16, True), _value_of(32, False)


@njit(inline="always", **JIT)
def ld_f32(addr):  # type: ignore[no-untyped-def]
    return f32_value(ld_u32(addr))


@njit(inline="always", **JIT)
def ld_f16(addr):  # type: ignore[no-untyped-def]
    return f16_value(ld_u16(addr))


@njit(inline="always", **JIT)
def ld_bf16(addr):  # type: ignore[no-untyped-def]
    return bf16_value(ld_u16(addr))


@njit(inline="always", **JIT)
def load_row(addr, stride, dt, buf):  # type: ignore[no-untyped-def]
    """``buf.shape[0]`` floats of code ``dt`` from ``addr`` (stride ``stride`` bytes) into ``buf``."""
    n = buf.shape[0]
    if stride == (4 if dt == 0 else 2):  # a contiguous row (the common one): through an array, in vectors
        if dt == 0:
            words = carray(u32_pointer(addr), n)
            for d in range(n):
                buf[d] = f32_value(words[d])
        else:
            bits = carray(u16_pointer(addr), n)
            if dt == 1:
                for d in range(n):
                    buf[d] = bf16_value(bits[d])
            else:
                for d in range(n):
                    buf[d] = f16_value(bits[d])
    elif dt == 0:
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
    b = s // bs
    t = s - b * bs
    if tile == bs:  # a tile is the block (plain strides): no division more (one is dozens of cycles)
        return cd[0] + b * cd[D_BLOCK_STRIDE] + t * cd[D_TOKEN_STRIDE]
    return cd[0] + b * cd[D_BLOCK_STRIDE] + (t // tile) * cd[D_TILE_STRIDE] + (t % tile) * cd[D_TOKEN_STRIDE]


@njit(inline="always", **JIT)
def load_strips(addr, cd, dt, buf):  # type: ignore[no-untyped-def]
    """A cache row of ``buf.shape[0]`` floats of code ``dt`` (one head of one slot, from ``addr``) into
    ``buf``, strip by strip (descriptor ``cd``)."""
    strip = cd[D_STRIP]
    for i in range(buf.shape[0] // strip):
        load_row(addr + i * cd[D_STRIP_STRIDE], cd[D_DIM_STRIDE], dt, buf[i * strip:(i + 1) * strip])


@njit(fastmath={"reassoc", "contract"}, **JIT)
def dot(a, b, n):  # type: ignore[no-untyped-def]
    """The dot product of ``n`` floats of ``a`` and ``b``, its sum in any order (the compiler's
    vectors): one running sum waits for its last addition each element, four cycles or so."""
    x = 0.0
    for d in range(n):
        x += a[d] * b[d]
    return x
