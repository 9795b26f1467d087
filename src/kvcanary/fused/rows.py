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
from kvcanary.fused._core import JIT, u16_pointer, u32_pointer
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


def _value_of(bits: int, fp16: bool):  # type: ignore[no-untyped-def]
    """An intrinsic giving a float's bits (a ``uint16`` or ``uint32``) as a float64: bfloat16 (16 bits
    put on top of a float32's), float16 or float32. An operation on a value, which the compiler puts
    in vectors where a loop loads the bits through an array (loads through raw addresses stay single)."""
    @intrinsic
    def value(typingctx, raw):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            if fp16:
                f = builder.bitcast(args[0], ir.HalfType())
            elif bits == 16:
                wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
                f = builder.bitcast(wide, ir.FloatType())
            else:
                f = builder.bitcast(args[0], ir.FloatType())
            return builder.fpext(f, ir.DoubleType())

        return types.float64(types.uint16 if bits == 16 else types.uint32), codegen

    return value


bf16_value, f16_value, f32_value = _value_of(16, False), _value_of(16, True), _value_of(32, False)


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
