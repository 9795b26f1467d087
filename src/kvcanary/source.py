"""A byte source: where the bytes of slot ``s`` live in one view of an engine's own tensor.

A :class:`ByteSource` describes one byte view of one engine tensor (a layer's K, a layer's V, a
packed K|V block, an MLA latent row, a quantization-scale strip). Slot ``s`` lives in page
``s // P`` (``P = page_size``) at in-page index ``i = s % P``; inside a page, slots come in packs
of ``T = token_pack`` (``T`` divides ``P``; by default ``T = P``, one pack). A slot's bytes are runs
of ``row_bytes`` contiguous bytes: ``rows`` runs ``row_stride`` apart, repeated over the
``groups`` ``(count_k, stride_k)``, outermost first::

    addr(s, g, r, b) = offset + (s // P) * page_stride + (i // T) * pack_stride + (i % T) * token_stride
                       + sum_k g_k * stride_k + r * row_stride + b
                       for g_k < count_k, r < rows, b < row_bytes

All quantities are in bytes. A run is *wide* (``row_bytes`` a multiple of 16, every stride
16-byte aligned) or *narrow* (``row_bytes`` 1, 2 or 4, every stride a multiple of it): vLLM's CPU
backend stores one token's K as single elements ``block_size`` elements apart, or as 4-byte pairs
packed across 16 tokens.

The content fingerprint reads a slot as a sequence of 8-byte words, its runs in the order
``(g_1, ..., g_k, r)``: a wide run gives its ``row_bytes / 8`` little-endian words, a narrow run
one word, its bytes zero-extended. Word ``j`` of source ``n`` is keyed ``key(n, j)``
(:mod:`kvcanary.hashing`), so any single changed byte changes the fingerprint. ``read_bytes`` (at
most the token's bytes; a multiple of 16, or of a narrow run's width) is how much of that byte
sequence the fingerprint covers; by default all of it. A :class:`~kvcanary.layout.KvLayout` is an
ordered list of sources; the order fixes the fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvcanary.errors import LayoutError

LOAD_WIDTH = 16  # bytes: wide content reads are whole 16-byte loads
NARROW_WIDTHS = (1, 2, 4)  # bytes: a run this narrow is read as one element, zero-extended to a word


@dataclass(frozen=True, eq=False)
class ByteSource:
    """One byte view of one engine tensor. Use :meth:`from_tensor` unless the geometry is unusual.

    Parameters
    ----------
    name : label used in reports (``"layer3.k"``)
    tensor : the engine's tensor; only its storage is read, never copied
    page_size : slots per page (1 for a flat ``[num_slots, ...]`` tensor)
    num_pages : pages the tensor holds
    page_stride, token_stride, row_stride, offset : bytes
    rows, row_bytes : a token's bytes are (per group) ``rows`` runs of ``row_bytes`` contiguous bytes
    read_bytes : bytes of each token the content fingerprint covers (``None``: all of them)
    groups : ``(count, stride)`` of each further repetition of the rows, outermost first (bytes)
    token_pack, pack_stride : slots per pack inside a page and the bytes between packs
        (``None``: the page is one pack)
    """

    name: str
    tensor: torch.Tensor
    page_size: int
    num_pages: int
    page_stride: int
    token_stride: int
    rows: int
    row_stride: int
    row_bytes: int
    offset: int
    read_bytes: int | None = None
    groups: tuple[tuple[int, int], ...] = ()
    token_pack: int | None = None
    pack_stride: int = 0

    def __post_init__(self) -> None:
        _check_tensor(self.name, self.tensor)
        groups = tuple((int(n), int(st)) for n, st in self.groups)
        for n, st in groups:
            if n < 1:
                raise LayoutError(f"source {self.name!r}: group count must be >= 1, got {n} in groups {groups}")
        object.__setattr__(self, "groups", tuple((n, st) for n, st in groups if n > 1))  # a count of 1 is free
        object.__setattr__(self, "token_pack", self.page_size if self.token_pack is None else self.token_pack)
        for k in ("page_size", "num_pages", "rows", "row_bytes", "token_pack"):
            if getattr(self, k) < 1:
                raise LayoutError(f"source {self.name!r}: {k} must be >= 1, got {getattr(self, k)}")
        if self.page_size % self.pack:
            raise LayoutError(f"source {self.name!r}: token_pack {self.pack} must divide page_size {self.page_size}")
        for k, v, n, what in self._strides():
            if v < 0:
                raise LayoutError(f"source {self.name!r}: {k}: expected >= 0 bytes, got {v}")
            if v == 0 and n > 1:  # a stride is free only along a dimension of one
                raise LayoutError(f"source {self.name!r}: {k}: expected > 0 bytes with {n} {what} (they would "
                                  "share bytes), got 0")
        if self.narrow:
            self._check_narrow()
        else:
            self._check_wide()
        last = (self.offset + self.row_bytes + (self.num_pages - 1) * self.page_stride
                + (self.page_size // self.pack - 1) * self.pack_stride + (self.pack - 1) * self.token_stride
                + sum((n - 1) * st for n, st in self.run_dims))
        nbytes = self.tensor.untyped_storage().nbytes()
        if last > nbytes:
            raise LayoutError(
                f"source {self.name!r}: described bytes end at {last}, beyond the tensor's storage "
                f"of {nbytes} bytes"
            )

    def _strides(self) -> list[tuple[str, int, int, str]]:
        """(name, bytes, count along it, what is counted) of every stride, offset first."""
        out = [("offset", self.offset, 1, ""), ("page_stride", self.page_stride, self.num_pages, "pages"),
               ("pack_stride", self.pack_stride, self.page_size // self.pack, "packs per page"),
               ("token_stride", self.token_stride, self.pack, "slots per pack" if self.packed else "slots per page")]
        out += [(f"groups[{i}] stride", st, n, "groups") for i, (n, st) in enumerate(self.groups)]
        return out + [("row_stride", self.row_stride, self.rows, "rows")]

    def _check_narrow(self) -> None:
        w = self.row_bytes
        rb = self.bytes_per_token if self.read_bytes is None else self.read_bytes
        object.__setattr__(self, "read_bytes", rb)
        if rb <= 0 or rb % w:
            raise LayoutError(f"source {self.name!r}: content read size must be a positive multiple of the "
                              f"{w}-byte run width, got {rb}")
        if rb > self.bytes_per_token:
            raise LayoutError(f"source {self.name!r}: content read size {rb} exceeds the bytes per token "
                              f"({self.bytes_per_token})")
        for k, v, n, _ in self._strides():
            if v % w and (n > 1 or k == "offset"):
                raise LayoutError(f"source {self.name!r}: {k} = {v} bytes is not a multiple of the {w}-byte run "
                                  f"width (a narrow run is read as one {w}-byte element)")

    def _check_wide(self) -> None:
        implicit = self.read_bytes is None
        rb = self.bytes_per_token if self.read_bytes is None else self.read_bytes
        object.__setattr__(self, "read_bytes", rb)
        hint = "" if self.row_bytes % LOAD_WIDTH == 0 else f"; a run is 1, 2 or 4 bytes, or a multiple of {LOAD_WIDTH}"
        if rb <= 0 or rb % LOAD_WIDTH:
            raise LayoutError(
                f"source {self.name!r}: content read size must be a positive multiple of {LOAD_WIDTH} "
                f"bytes, got {rb}" + (" (pass read_bytes explicitly)" if implicit else "") + hint
            )
        if rb > self.bytes_per_token:
            raise LayoutError(
                f"source {self.name!r}: content read size {rb} exceeds the bytes per token "
                f"({self.bytes_per_token})"
            )
        if self.runs_per_token > 1 and rb > self.row_bytes and rb % self.row_bytes:
            raise LayoutError(
                f"source {self.name!r}: read size {rb} spans rows, so it must be a multiple of the "
                f"row size {self.row_bytes}"
            )
        for k, v, n, _ in [("row_bytes", self.row_bytes, 1, "")] + self._strides():
            if v % LOAD_WIDTH and (n > 1 or k in ("offset", "page_stride", "token_stride", "row_bytes")):
                raise LayoutError(
                    f"source {self.name!r}: {k} = {v} bytes is not a multiple of the {LOAD_WIDTH}-byte "
                    "load width" + (hint if k == "row_bytes" else "")
                )

    @property
    def narrow(self) -> bool:
        """Runs of 1, 2 or 4 bytes, each read as one zero-extended word."""
        return self.row_bytes in NARROW_WIDTHS

    @property
    def pack(self) -> int:
        """Slots per pack (``token_pack``, resolved)."""
        assert self.token_pack is not None
        return self.token_pack

    @property
    def packed(self) -> bool:
        return self.pack != self.page_size

    @property
    def run_dims(self) -> tuple[tuple[int, int], ...]:
        """``(count, stride)`` of every repetition of a token's runs, outermost first (the rows last)."""
        return self.groups + ((self.rows, self.row_stride),)

    @property
    def runs_per_token(self) -> int:
        return math.prod(n for n, _ in self.run_dims)

    @property
    def bytes_per_token(self) -> int:
        return self.runs_per_token * self.row_bytes

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def read_runs(self) -> int:
        """Runs of one token the fingerprint reads (a wide partial read reads part of the first)."""
        assert self.read_bytes is not None
        return self.read_bytes // self.row_bytes if self.narrow else max(1, self.read_bytes // self.row_bytes)

    read_rows = read_runs  # the name from before groups: runs and rows agree without them

    @property
    def read_words(self) -> int:
        """8-byte words of one token the fingerprint reads (a narrow run is one word)."""
        assert self.read_bytes is not None
        return self.read_runs if self.narrow else self.read_bytes // 8

    def run_offsets(self) -> torch.Tensor:
        """Byte offset of each of a token's runs from its first, in word order, int64 ``[runs_per_token]``."""
        offs = torch.zeros(1, dtype=torch.int64)
        for n, st in self.run_dims:
            offs = (offs[:, None] + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
        return offs

    def slot_offset(self, slot: int) -> int:
        """Byte address of slot ``slot``'s first run in the storage."""
        page, i = divmod(slot, self.page_size)
        return (self.offset + page * self.page_stride + (i // self.pack) * self.pack_stride
                + (i % self.pack) * self.token_stride)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """A writable uint8 view ``[*group counts, rows, row_bytes]`` of one slot's bytes (fault
        injection, tests): ``[rows, row_bytes]`` for a source without groups."""
        shape = tuple(n for n, _ in self.run_dims) + (self.row_bytes,)
        strides = tuple(st for _, st in self.run_dims) + (1,)
        return storage_bytes(self.tensor).as_strided(shape, strides, self.slot_offset(slot))

    @classmethod
    def from_tensor(
        cls,
        name: str,
        tensor: torch.Tensor,
        *,
        page_size: int | None = None,
        read_bytes: int | None = None,
    ) -> "ByteSource":
        """Describe a tensor view ``[num_slots, *inner]`` or ``[num_pages, page_size, *inner]``.

        Pass ``page_size`` for the paged form. The inner dimensions must be contiguous, except
        that the first of them may have any stride (it becomes ``rows``): a head-major layout is
        passed as a permuted view ``[num_pages, page_size, num_heads, head_dim]``.
        """
        _check_tensor(name, tensor)
        lead = 1 if page_size is None else 2
        if tensor.dim() < lead + 1:
            raise LayoutError(
                f"source {name!r}: expected at least {lead + 1} dims "
                f"({'[num_slots, ...]' if lead == 1 else '[num_pages, page_size, ...]'}), got shape "
                f"{tuple(tensor.shape)}"
            )
        if page_size is not None and tensor.shape[1] != page_size:
            raise LayoutError(f"source {name!r}: dim 1 is {tensor.shape[1]}, expected page_size {page_size}")
        es = tensor.element_size()
        inner, istr = list(tensor.shape[lead:]), list(tensor.stride()[lead:])
        rows, row_stride = 1, 0
        if not _contiguous(inner, istr):
            if len(inner) > 1 and _contiguous(inner[1:], istr[1:]):
                rows, row_stride = inner[0], istr[0] * es
                inner, istr = inner[1:], istr[1:]
            else:
                bad = next(i for i in range(len(inner)) if not _contiguous(inner[i:], istr[i:]))
                raise LayoutError(
                    f"source {name!r}: inner dimension {lead + bad} (size {inner[bad]}, stride "
                    f"{istr[bad]}) is not contiguous; expected strides {_dense_strides(inner)} for the "
                    "inner dims"
                )
        row_bytes = math.prod(inner) * es
        return cls(
            name=name,
            tensor=tensor,
            page_size=1 if page_size is None else page_size,
            num_pages=tensor.shape[0],
            page_stride=tensor.stride(0) * es,
            token_stride=0 if page_size is None else tensor.stride(1) * es,
            rows=rows,
            row_stride=row_stride if rows > 1 else row_bytes,
            row_bytes=row_bytes,
            offset=int(tensor.storage_offset()) * es,
            read_bytes=read_bytes,
        )


def _check_tensor(name: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        hint = " (torch.from_numpy wraps a numpy array without a copy)" if type(tensor).__module__ == "numpy" else ""
        raise LayoutError(f"source {name!r}: expected a torch.Tensor (the engine's KV memory), got "
                          f"{type(tensor).__name__}{hint}")


def _dense_strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    return all(n == 1 or s == d for n, s, d in zip(shape, strides, _dense_strides(shape)))



def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat, writable uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))
