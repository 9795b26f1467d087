"""One layer's K and V in an engine's cache, described once: the interface every geometry gives.

A geometry is the one place that knows where the bytes of slot ``s`` of one layer live. The rest of
kvcanary asks it, and does no arithmetic on a cache's strides of its own:

- :meth:`KvGeometry.sources`: the layer's K and V as byte sources (:class:`~kvcanary.source.ByteSource`,
  what the content fingerprint reads);
- :meth:`KvGeometry.k_rows` and :meth:`KvGeometry.v_rows`: typed rows ``[*slots.shape, Hkv, D]``
  (the read audit's and the write check's torch reference);
- :meth:`KvGeometry.descriptors`: the compiled loops' cache descriptors, where the geometry is strided;
- :meth:`KvGeometry.element`: the byte offset of one element in the storage (the fault injectors).

Slots are the canary's: ``slot = block * block_size + offset``, ``block`` one of ``num_blocks``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import numpy as np
import torch

from kvcanary.errors import LayoutError
from kvcanary.source import LOAD_WIDTH, NARROW_WIDTHS, ByteSource, storage_bytes

HALVES = ("k", "v")

Runs = tuple[tuple[tuple[int, int], ...], int, int, int]  # groups, rows, row_stride, row_bytes


def block_slots(blocks: Iterable[int], block_size: int) -> torch.Tensor:
    """Every slot of ``blocks`` in order, int64 ``[len(blocks) * block_size]`` on the CPU (numpy: a free
    of a few blocks costs microseconds, not torch's tens)."""
    b = np.asarray(list(blocks), dtype=np.int64).reshape(-1, 1)
    return torch.from_numpy((b * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1))


class KvGeometry(ABC):
    """Where one layer's K and V of every slot live in the storage of ``tensor``.

    Attributes
    ----------
    tensor : the engine's tensor whose storage holds the layer (only its storage is read)
    num_blocks, block_size : the blocks of the slot space and the slots of each
    num_kv_heads, head_dim : a token's K (and V) is ``[num_kv_heads, head_dim]`` elements
    """

    tensor: torch.Tensor
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def element_size(self) -> int:
        return self.tensor.element_size()

    @property
    def token_bytes(self) -> int:
        """A token's K and V bytes in this layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.element_size

    @abstractmethod
    def sources(self, name: str) -> tuple[ByteSource, ByteSource]:
        """The layer's K and V as byte sources named ``{name}.k`` and ``{name}.v``."""

    @abstractmethod
    def k_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """K of ``slots`` (int, any shape, in the pool): ``[*slots.shape, Hkv, D]``, or with ``heads``
        (shaped as ``slots``) each slot's row of its head, ``[*slots.shape, D]``; in the cache's
        dtype, a copy."""

    @abstractmethod
    def v_rows(self, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """V of ``slots``, as :meth:`k_rows`."""

    def descriptors(self) -> tuple[list[int], list[int]] | None:
        """The compiled loops' descriptors of K and V, ``[address, block_size, block stride, token
        stride, head stride, dim stride, tile, tile stride, strip, strip stride]`` (bytes;
        :mod:`kvcanary.fused.audit`): token ``t`` of a block starts ``(t // tile) * tile stride + (t %
        tile) * token stride`` into it, dim ``d`` of a head ``(d // strip) * strip stride + (d % strip)
        * dim stride`` into the head's row (a layout at plain strides: ``tile = block_size``, ``strip =
        head_dim``, both their strides 0); ``None`` where no such descriptor places the layer's
        elements (the torch reference reads it)."""
        return None

    @abstractmethod
    def element(self, half: str, slot: int, head: int, dim: int) -> int:
        """The byte offset, from the storage's first byte, of element ``(head, dim)`` of ``slot``'s
        K (``half="k"``) or V (``"v"``)."""

    def set_rows(self, half: str, slots: torch.Tensor, value: float) -> None:
        """Write ``value`` into every element of ``slots``' K or V (fault injection, tests)."""
        raise LayoutError(f"{type(self).__name__}: writing rows is not supported")

    def storage_bytes(self) -> torch.Tensor:
        """The whole storage as a flat, writable uint8 tensor (no copy)."""
        return storage_bytes(self.tensor)

    def rows(self, half: str, slots: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`k_rows` or :meth:`v_rows` by ``half``."""
        return self.k_rows(slots, heads) if _half(half) == "k" else self.v_rows(slots, heads)


def _half(half: str) -> str:
    if half not in HALVES:
        raise LayoutError(f"half: expected 'k' or 'v', got {half!r}")
    return half


def runs(dims: list[tuple[int, int]], nbytes: int, align: int) -> Runs:
    """A token's runs: ``nbytes`` contiguous bytes at every point of ``dims`` (``(count, stride)``,
    outermost first), each stretch one run where a run can be that wide, else split into narrow
    runs of the widest width dividing it and ``align`` (the stretch's alignment)."""
    if nbytes % LOAD_WIDTH and nbytes not in NARROW_WIDTHS:
        w = max(x for x in NARROW_WIDTHS if nbytes % x == 0 and align % x == 0)
        dims, nbytes = dims + [(nbytes // w, w)], w
    dims = [d for d in dims if d[0] > 1] or [(1, nbytes)]
    return tuple(dims[:-1]), dims[-1][0], dims[-1][1], nbytes


def source(name: str, t: torch.Tensor, block_size: int, num_blocks: int, block_stride: int, token_stride: int,
           offset: int, token_runs: Runs, token_pack: int | None = None, pack_stride: int = 0) -> ByteSource:
    """One half of one layer as a byte source (strides and offset in bytes)."""
    groups, rows, row_stride, row_bytes = token_runs
    return ByteSource(name=name, tensor=t, page_size=block_size, num_pages=num_blocks, page_stride=block_stride,
                      token_stride=token_stride, rows=rows, row_stride=row_stride, row_bytes=row_bytes,
                      offset=offset, groups=groups, token_pack=token_pack, pack_stride=pack_stride)
