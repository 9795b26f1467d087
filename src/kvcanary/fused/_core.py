"""The fused CPU path's shared pieces: raw loads and stores, the hashing formulas on uint64, and
tensor descriptors (the layout as a table, and the folds over it: :mod:`kvcanary.fused.fold`).

The loops take tensors as descriptors (address, element size, strides) rather than as typed arrays,
so each op compiles once, whatever mix of int32, int64 and bool tensors an engine hands over, and
calling one costs a few microseconds. The descriptors are built from tensors the caller checked
(shapes by :meth:`kvcanary.step.Step.validate_shapes`, values by the op's own bounds checks): a
loop never reads outside the tensors it was given.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvcanary import hashing
from kvcanary.fused.cache import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")  # compiled once per machine, cached on disk


def _loader(bits: int, signed: bool, ret: types.Type):  # type: ignore[no-untyped-def]
    @intrinsic
    def load(typingctx, addr):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            v = builder.load(ptr, align=1)
            if bits < 64:
                v = builder.sext(v, ir.IntType(64)) if signed else builder.zext(v, ir.IntType(64))
            return v

        return ret(types.int64), codegen

    return load


ld_u8 = _loader(8, False, types.int64)
ld_u16 = _loader(16, False, types.int64)
ld_i32 = _loader(32, True, types.int64)
ld_u32 = _loader(32, False, types.int64)
ld_i64 = _loader(64, True, types.int64)
ld_w64 = _loader(64, False, types.uint64)  # a content word


def _pointer(bits: int, ty: types.Type):  # type: ignore[no-untyped-def]
    @intrinsic
    def pointer(typingctx, addr):  # type: ignore[no-untyped-def]
        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            return builder.inttoptr(args[0], ir.IntType(bits).as_pointer())

        return types.CPointer(ty)(types.int64), codegen

    return pointer


# an address as a typed pointer, for numba.carray: an array over raw memory, whose loops the compiler
# vectorises where loads through ld_i64 and the like it does not (int64 words; unsigned content words
# and narrow elements)
i64_pointer, u64_pointer = _pointer(64, types.int64), _pointer(64, types.uint64)
u32_pointer, u16_pointer, u8_pointer = _pointer(32, types.uint32), _pointer(16, types.uint16), _pointer(8, types.uint8)


@intrinsic
def st_i64(typingctx, addr, value):  # type: ignore[no-untyped-def]
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def st_u8(typingctx, addr, value):  # type: ignore[no-untyped-def]
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        byte = builder.trunc(args[1], ir.IntType(8))
        builder.store(byte, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def prefetch(typingctx, addr):  # type: ignore[no-untyped-def]
    """Hint the cache line at ``addr`` into the caches (a read; no fault on any address)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        # the intrinsic's name carries its pointer type: p0 (opaque pointers) or p0i8 (typed)
        name = "llvm.prefetch.p0" if str(i8p) == "ptr" else "llvm.prefetch.p0i8"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            name)
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@njit(inline="always", **JIT)
def prefetch_bytes(a, nbytes):  # type: ignore[no-untyped-def]
    """Hint the cache lines of ``nbytes`` contiguous bytes from ``a`` into the caches."""
    for b in range(0, nbytes + 63, 64):
        prefetch(min(a + b, a + nbytes - 1))


@njit(inline="always", **JIT)
def ld(addr, esz, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of an integer or bool tensor of element size ``esz`` (1: bool/uint8, 4: int32,
    8: int64), as int64."""
    a = addr + i * esz
    if esz == 8:
        return ld_i64(a)
    if esz == 4:
        return ld_i32(a)
    return ld_u8(a)


@njit(inline="always", **JIT)
def ld_word(addr, width):  # type: ignore[no-untyped-def]
    """A content word: 8 bytes, or a narrow element (1, 2 or 4 bytes) zero-extended."""
    if width == 0:
        return ld_w64(addr)
    if width == 4:
        return np.uint64(ld_u32(addr))
    if width == 2:
        return np.uint64(ld_u16(addr))
    return np.uint64(ld_u8(addr))


# ---- the hashing formulas of kvcanary.hashing, on uint64 ---------------------------------------

_C1, _C2 = np.uint64(hashing.FMIX_C1), np.uint64(hashing.FMIX_C2)
_POS_SALT, _WORD_MUL = np.uint64(hashing.POS_SALT), np.uint64(hashing.WORD_MUL)
_CONTENT_SALT, _B = np.uint64(hashing.CONTENT_SALT), np.uint64(hashing.LINK_B)
_SEED = np.uint64(hashing.LINK_SEED)
_S33, _S29 = np.uint64(33), np.uint64(29)


@njit(inline="always", **JIT)
def fmix64(x):  # type: ignore[no-untyped-def]
    x ^= x >> _S33
    x *= _C1
    x ^= x >> _S33
    x *= _C2
    return x ^ (x >> _S33)


@njit(inline="always", **JIT)
def g_term(tok, pos):  # type: ignore[no-untyped-def]
    """``g(token, position)`` from int64 token and position, as uint64."""
    return fmix64(np.uint64(tok) ^ fmix64(np.uint64(pos) + _POS_SALT))


@njit(inline="always", **JIT)
def link_next(prev, tok, pos):  # type: ignore[no-untyped-def]
    """``B * prev + g(token, position)``: int64 in, int64 out (the stamp's bits)."""
    return np.int64(np.uint64(prev) * _B + g_term(tok, pos))


@njit(inline="always", **JIT)
def wmix(x):  # type: ignore[no-untyped-def]
    x *= _WORD_MUL
    return x ^ (x >> _S29)


@njit(inline="always", **JIT)
def finish_content(acc):  # type: ignore[no-untyped-def]
    return np.int64(fmix64(acc ^ _CONTENT_SALT))


SEED = np.int64(hashing.signed(hashing.LINK_SEED))

# ---- tensors as descriptors ---------------------------------------------------------------------

_ESZ = {torch.int64: 8, torch.int32: 4, torch.bool: 1, torch.uint8: 1}


def addr(t: torch.Tensor | None) -> tuple[int, int, int]:
    """(address, element size, stride in elements) of a 1-d tensor, (0, 8, 0) for ``None``."""
    if t is None:
        return 0, 8, 0
    return t.data_ptr(), _ESZ[t.dtype], t.stride(0)


def addr2(t: torch.Tensor | None) -> tuple[int, int, int, int, int, int]:
    """(address, element size, row stride, column stride, rows, columns) of a 2-d tensor."""
    if t is None:
        return 0, 8, 0, 0, 0, 0
    return t.data_ptr(), _ESZ[t.dtype], t.stride(0), t.stride(1), t.shape[0], t.shape[1]
