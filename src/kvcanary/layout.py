"""KV layouts as data: where the bytes of slot ``s`` live in an engine's own tensors.

A :class:`ByteSource` describes one byte view of one engine tensor (a layer's K, a layer's V, a
packed K|V block, an MLA latent row, a quantization-scale strip). Slot ``s`` lives in page
``s // page_size`` at in-page index ``s % page_size``; its bytes are ``rows`` contiguous runs of
``row_bytes`` each::

    addr(s, r, b) = offset + (s // page_size) * page_stride + (s % page_size) * token_stride
                    + r * row_stride + b                      for r < rows, b < row_bytes

All quantities are in bytes. ``read_bytes`` (a multiple of 16, at most the token's bytes) is how
much of the token's byte sequence the content fingerprint covers; by default all of it.
A :class:`KvLayout` is an ordered list of sources; the order fixes the fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvcanary import hashing
from kvcanary.errors import LayoutError

LOAD_WIDTH = 16  # bytes: content reads are whole 16-byte loads
MAX_SOURCES = 256  # entries in the fixed-size source table the kernels take
MAX_OVERLAP_RUNS = 1 << 22  # byte runs the overlap check lists per storage; beyond, it is skipped


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
    rows, row_bytes : a token's bytes are ``rows`` runs of ``row_bytes`` contiguous bytes
    read_bytes : bytes of each token the content fingerprint covers (``None``: all of them)
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
    _words: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for k in ("page_size", "num_pages", "rows", "row_bytes"):
            if getattr(self, k) < 1:
                raise LayoutError(f"source {self.name!r}: {k} must be >= 1, got {getattr(self, k)}")
        for k, n, what in (("offset", 1, ""), ("page_stride", self.num_pages, "pages"),
                           ("token_stride", self.page_size, "slots per page"), ("row_stride", self.rows, "rows")):
            v = getattr(self, k)
            if v < 0:
                raise LayoutError(f"source {self.name!r}: {k}: expected >= 0 bytes, got {v}")
            if v == 0 and n > 1:  # a stride is free only along a dimension of one
                raise LayoutError(f"source {self.name!r}: {k}: expected > 0 bytes with {n} {what} (they would "
                                  "share bytes), got 0")
        implicit = self.read_bytes is None
        rb = self.bytes_per_token if self.read_bytes is None else self.read_bytes
        object.__setattr__(self, "read_bytes", rb)
        if rb <= 0 or rb % LOAD_WIDTH:
            raise LayoutError(
                f"source {self.name!r}: content read size must be a positive multiple of {LOAD_WIDTH} "
                f"bytes, got {rb}" + (" (pass read_bytes explicitly)" if implicit else "")
            )
        if rb > self.bytes_per_token:
            raise LayoutError(
                f"source {self.name!r}: content read size {rb} exceeds the bytes per token "
                f"({self.bytes_per_token})"
            )
        if self.rows > 1 and rb > self.row_bytes and rb % self.row_bytes:
            raise LayoutError(
                f"source {self.name!r}: read size {rb} spans rows, so it must be a multiple of the "
                f"row size {self.row_bytes}"
            )
        for k in ("offset", "page_stride", "token_stride", "row_stride", "row_bytes"):
            v = getattr(self, k)
            if v % LOAD_WIDTH and not (k == "row_stride" and self.rows == 1):
                raise LayoutError(
                    f"source {self.name!r}: {k} = {v} bytes is not a multiple of the {LOAD_WIDTH}-byte "
                    "load width"
                )
        object.__setattr__(self, "_words", self._word_view())

    @property
    def bytes_per_token(self) -> int:
        return self.rows * self.row_bytes

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def read_rows(self) -> int:
        assert self.read_bytes is not None
        return max(1, self.read_bytes // self.row_bytes)

    @property
    def read_words(self) -> int:
        """8-byte words of one token the fingerprint reads."""
        assert self.read_bytes is not None
        return self.read_bytes // 8

    def _storage_bytes(self) -> torch.Tensor:
        """The whole storage under the engine's tensor as a flat uint8 tensor (no copy)."""
        storage = self.tensor.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=self.tensor.device)
        return flat.set_(storage, 0, (storage.nbytes(),), (1,))

    def _word_view(self) -> torch.Tensor:
        flat = self._storage_bytes()
        nbytes = flat.shape[0]
        usable = nbytes // 8 * 8
        words = flat[:usable].view(torch.int64)
        rw = min(self.read_bytes or 0, self.row_bytes) // 8
        shape = (self.num_pages, self.page_size, self.read_rows, rw)
        strides = (self.page_stride // 8, self.token_stride // 8, self.row_stride // 8, 1)
        last = self.offset + sum((n - 1) * s for n, s in zip(shape, strides)) * 8 + 8
        if self.offset < 0 or last > usable:
            raise LayoutError(
                f"source {self.name!r}: described bytes end at {last}, beyond the tensor's storage "
                f"of {nbytes} bytes"
            )
        return words.as_strided(shape, strides, self.offset // 8)

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """A writable uint8 view ``[rows, row_bytes]`` of one slot's bytes (fault injection, tests)."""
        flat = self._storage_bytes()
        page, off = divmod(slot, self.page_size)
        base = self.offset + page * self.page_stride + off * self.token_stride
        return flat.as_strided((self.rows, self.row_bytes), (self.row_stride, 1), base)

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


def _dense_strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    return all(n == 1 or s == d for n, s, d in zip(shape, strides, _dense_strides(shape)))


def _dims(s: ByteSource) -> list[tuple[int, int]]:
    """(count, stride) of each dimension of more than one along which a source repeats its runs
    of ``row_bytes``, the largest stride first."""
    dims = ((s.num_pages, s.page_stride), (s.page_size, s.token_stride), (s.rows, s.row_stride))
    return sorted(((n, st) for n, st in dims if n > 1), key=lambda d: -d[1])


def _run_starts(s: ByteSource, outer: int) -> torch.Tensor:
    """Start bytes of the source's runs whose index along its outermost dimension is below ``outer``."""
    starts = torch.tensor([s.offset])
    for i, (n, st) in enumerate(_dims(s)):
        starts = (starts[:, None] + torch.arange(min(n, outer) if i == 0 else n) * st).reshape(-1)
    return starts


def _check_disjoint(group: Sequence[ByteSource]) -> None:
    """Raise unless no byte of one storage is covered twice, by two sources of ``group`` or by two
    slots or rows of one.

    When every source repeats with the same outermost stride ``S`` (pages of one tensor), an overlap
    shifted by whole periods stays an overlap, so one at outer indices ``(0, k)`` exists, with ``k * S``
    below the group's byte spread: listing the first few periods of each source is exact. Other
    groups are listed whole, up to ``MAX_OVERLAP_RUNS`` runs.
    """
    dims = [_dims(s) for s in group]
    outer = {d[0][1] if d else 0 for d in dims}
    count = [d[0][0] if d else 1 for d in dims]
    periods = max(count)
    if len(outer) == 1 and 0 not in outer:
        inner = [s.offset + s.row_bytes + sum((n - 1) * st for n, st in d[1:]) for s, d in zip(group, dims)]
        periods = (max(inner) - min(s.offset for s in group)) // next(iter(outer)) + 2
    total = sum(min(c, periods) * s.rows * s.num_slots // c for s, c in zip(group, count))
    if total > MAX_OVERLAP_RUNS:
        return
    starts = [_run_starts(s, periods) for s in group]
    start = torch.cat(starts)
    end = torch.cat([st + s.row_bytes for st, s in zip(starts, group)])
    who = torch.cat([torch.full_like(st, i) for i, st in enumerate(starts)])
    order = torch.argsort(start, stable=True)
    start, end, who = start[order], end[order], who[order]
    hit = (start[1:] < torch.cummax(end, 0).values[:-1]).nonzero()  # a run begins before an earlier one ends
    if not hit.numel():
        return
    i = int(hit[0]) + 1
    j = int((end[:i] > start[i]).nonzero()[0])
    a, b, at = group[int(who[j])], group[int(who[i])], int(start[i])
    if a is b:
        raise LayoutError(
            f"source {a.name!r}: two of its slots or rows both cover byte {at} of the storage (page_stride "
            f"{a.page_stride}, token_stride {a.token_stride}, row_stride {a.row_stride}, row_bytes {a.row_bytes}); "
            "expected every byte in at most one slot's row"
        )
    raise LayoutError(
        f"sources {a.name!r} (offset {a.offset}) and {b.name!r} (offset {b.offset}) both cover byte {at} of "
        "their storage: expected sources over disjoint bytes"
    )


@dataclass(frozen=True, eq=False)
class KvLayout:
    """An ordered list of byte sources over one pool of KV slots (empty: metadata only)."""

    sources: tuple[ByteSource, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        if len(self.sources) > MAX_SOURCES:
            raise LayoutError(
                f"layout has {len(self.sources)} sources, more than the kernel source table holds "
                f"({MAX_SOURCES})"
            )
        devs = {s.tensor.device for s in self.sources}
        if len(devs) > 1:
            raise LayoutError(f"layout sources live on several devices: {sorted(map(str, devs))}")
        by_storage: dict[int, list[ByteSource]] = {}
        for s in self.sources:
            by_storage.setdefault(s.tensor.untyped_storage().data_ptr(), []).append(s)
        for group in by_storage.values():
            _check_disjoint(group)
        object.__setattr__(self, "_runs", _fuse_runs(self.sources))

    @property
    def content_bytes_per_slot(self) -> int:
        return sum(s.read_bytes or 0 for s in self.sources)

    def check_covers(self, num_slots: int) -> None:
        """Raise unless every source holds at least ``num_slots`` slots."""
        for s in self.sources:
            if s.num_slots < num_slots:
                raise LayoutError(
                    f"source {s.name!r} covers {s.num_slots} slots ({s.num_pages} pages x "
                    f"{s.page_size}), fewer than the pool's {num_slots}"
                )

    def fingerprint(self, slots: torch.Tensor, chunk_words: int = 1 << 15) -> torch.Tensor:
        """Content fingerprint of each slot, int64 ``[n]`` (0 for a layout with no sources)."""
        n = slots.shape[0]
        if not self.sources:
            return torch.zeros(n, dtype=torch.int64, device=slots.device)
        acc = torch.zeros(n, dtype=torch.int64, device=slots.device)
        runs: list[_Run] = getattr(self, "_runs")
        for run in runs:
            # chunks keep the temporaries [chunk, words] within a cache-friendly size
            chunk = max(1, chunk_words // run.keys.shape[0])
            for lo in range(0, n, chunk):
                words = run.gather(slots[lo : lo + chunk])
                acc[lo : lo + chunk] += hashing.fold_words(words, run.keys)
        return hashing.finish_content(acc)

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        page_size: int | None = None,
        read_bytes: int | None = None,
    ) -> "KvLayout":
        """One source per named tensor, all with the same page size and read size."""
        return cls(
            tuple(ByteSource.from_tensor(n, t, page_size=page_size, read_bytes=read_bytes) for n, t in tensors)
        )


@dataclass(frozen=True, eq=False)
class _Run:
    """Consecutive sources read by one gather: the same storage and geometry, evenly spaced (a
    packed cache's per-layer K and V pages), or one source. ``view`` is ``[bases, parts, words]``
    over the storage's int64 words: row ``b`` holds the ``parts`` runs of ``words`` words that
    start at word ``b`` (sources of the run, or rows of one source)."""

    view: torch.Tensor
    page_size: int
    page_stride: int  # words
    token_stride: int  # words
    keys: torch.Tensor  # the sources' word keys, concatenated in layout order

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        base = torch.div(slots, self.page_size, rounding_mode="floor") * self.page_stride
        base += (slots % self.page_size) * self.token_stride
        return self.view.index_select(0, base).reshape(slots.shape[0], -1)


def _fusable(a: ByteSource, b: ByteSource) -> bool:
    same = ("page_size", "num_pages", "page_stride", "token_stride", "row_bytes", "read_bytes")
    return (a.rows == b.rows == 1 and all(getattr(a, k) == getattr(b, k) for k in same)
            and a.tensor.untyped_storage().data_ptr() == b.tensor.untyped_storage().data_ptr())


def _fuse_runs(sources: Sequence[ByteSource]) -> list[_Run]:
    runs: list[_Run] = []
    i = 0
    while i < len(sources):
        j = i + 1
        if j < len(sources) and _fusable(sources[i], sources[j]):
            delta = sources[j].offset - sources[i].offset
            while (j < len(sources) and _fusable(sources[i], sources[j])
                   and sources[j].offset - sources[j - 1].offset == delta):
                j += 1
        group = sources[i:j]
        keys = torch.cat([hashing.word_keys(i + k, s.read_words, s.tensor.device) for k, s in enumerate(group)])
        w = group[0]._words  # [pages, page_size, read_rows, row_words]
        st = w.stride()
        if len(group) == 1:
            parts, part_stride = w.shape[2], st[2]
        else:
            parts, part_stride = len(group), (group[1].offset - group[0].offset) // 8
        bases = (w.shape[0] - 1) * st[0] + (w.shape[1] - 1) * st[1] + 1
        view = w.as_strided((bases, parts, w.shape[3]), (1, part_stride, 1), w.storage_offset())
        runs.append(_Run(view, group[0].page_size, st[0], st[1], keys))
        i = j
    return runs
