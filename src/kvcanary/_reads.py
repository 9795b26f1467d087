"""How the torch path reads a layout's bytes: one gather per run of sources (behind
:meth:`kvcanary.layout.KvLayout.fingerprint`), and the check that no byte is described twice.

A wide source is gathered as 8-byte words of its storage; a narrow one as elements of its run's
width (uint8, int16, int32), each zero-extended to a word. Either way one ``index_select`` over a
strided view ``[bases, *run dims, ...]`` reads every slot of a chunk at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvcanary import hashing
from kvcanary.errors import LayoutError
from kvcanary.source import ByteSource, storage_bytes

MAX_OVERLAP_RUNS = 1 << 22  # byte runs the overlap check lists per storage; beyond, it is skipped
_ELEMENT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _dims(s: ByteSource) -> list[tuple[int, int]]:
    """(count, stride) of each dimension of more than one along which a source repeats its runs
    of ``row_bytes``, the largest stride first."""
    dims = ((s.num_pages, s.page_stride), (s.page_size // s.pack, s.pack_stride), (s.pack, s.token_stride),
            *s.run_dims)
    return sorted(((n, st) for n, st in dims if n > 1), key=lambda d: -d[1])


def _run_starts(s: ByteSource, outer: int) -> np.ndarray:
    """Start bytes of the source's runs whose index along its outermost dimension is below ``outer``
    (numpy: a pool's setup makes these for every source, and small torch ops cost several times more)."""
    starts = np.array([s.offset], dtype=np.int64)
    for i, (n, st) in enumerate(_dims(s)):
        starts = (starts[:, None] + np.arange(min(n, outer) if i == 0 else n, dtype=np.int64) * st).reshape(-1)
    return starts


def _geometry(s: ByteSource) -> str:
    extra = f", groups {s.groups}" if s.groups else ""
    extra += f", token_pack {s.pack}, pack_stride {s.pack_stride}" if s.packed else ""
    return (f"page_stride {s.page_stride}, token_stride {s.token_stride}, row_stride {s.row_stride}, "
            f"row_bytes {s.row_bytes}{extra}")


def check_disjoint(group: Sequence[ByteSource]) -> None:
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
    total = sum(min(c, periods) * math.prod(n for n, _ in d) // c for d, c in zip(dims, count))
    if total > MAX_OVERLAP_RUNS:
        return
    starts = [_run_starts(s, periods) for s in group]
    start = np.concatenate(starts)
    end = start + np.repeat(np.array([s.row_bytes for s in group], dtype=np.int64), [len(st) for st in starts])
    who = np.repeat(np.arange(len(group)), [len(st) for st in starts])
    order = np.argsort(start, kind="stable")
    start, end, who = start[order], end[order], who[order]
    hit = np.flatnonzero(start[1:] < np.maximum.accumulate(end)[:-1])  # a run begins before an earlier one ends
    if not hit.size:
        return
    i = int(hit[0]) + 1
    j = int(np.flatnonzero(end[:i] > start[i])[0])
    a, b, at = group[int(who[j])], group[int(who[i])], int(start[i])
    if a is b:
        raise LayoutError(
            f"source {a.name!r}: two of its slots or rows both cover byte {at} of the storage ({_geometry(a)}); "
            "expected every byte in at most one slot's row"
        )
    raise LayoutError(
        f"sources {a.name!r} (offset {a.offset}) and {b.name!r} (offset {b.offset}) both cover byte {at} of "
        "their storage: expected sources over disjoint bytes"
    )


@dataclass(frozen=True, eq=False)
class Run:
    """Consecutive sources read by one gather: the same storage and geometry, evenly spaced (a
    packed cache's per-layer K and V pages), or one source. ``view`` is ``[bases, ...]`` over the
    storage's elements (int64 words, or a narrow run's width): row ``b`` holds the elements of the
    runs of a slot whose first run starts at element ``b``. Strides are in elements."""

    view: torch.Tensor
    page_size: int
    page_stride: int
    token_stride: int
    keys: torch.Tensor  # the sources' word keys, concatenated in layout order
    pack: int = 0  # slots per pack (0: the page is one pack)
    pack_stride: int = 0
    keep: int | None = None  # words of a slot the fingerprint reads, from the front (None: all gathered)
    bits: int = 0  # a narrow run's bits: elements are zero-extended to words (0: whole words)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The words of ``slots`` (int ``[n]``), int64 ``[n, words]``."""
        base = torch.div(slots, self.page_size, rounding_mode="floor") * self.page_stride
        if self.pack:
            i = slots % self.page_size
            base += torch.div(i, self.pack, rounding_mode="floor") * self.pack_stride
            base += (i % self.pack) * self.token_stride
        else:
            base += (slots % self.page_size) * self.token_stride
        words = self.view.index_select(0, base).reshape(slots.shape[0], -1)
        if self.keep is not None:
            words = words[:, : self.keep]
        if self.bits:
            words = words.to(torch.int64) & ((1 << self.bits) - 1)  # signed elements: mask the sign extension
        return words


def _elements(s: ByteSource, width: int) -> torch.Tensor:
    flat = storage_bytes(s.tensor)
    return flat[: flat.shape[0] // width * width].view(_ELEMENT[width])


def _single(s: ByteSource, keys: torch.Tensor) -> Run:
    """The gather of one source: narrow runs one element each, wide runs their read words."""
    unit = s.row_bytes if s.narrow else 8
    bases = ((s.num_pages - 1) * s.page_stride + (s.page_size // s.pack - 1) * s.pack_stride
             + (s.pack - 1) * s.token_stride) // unit + 1
    dims = list(s.run_dims)
    keep: int | None = None
    tail: tuple[tuple[int, int], ...] = ()
    if not s.narrow:
        tail = ((min(s.read_bytes or 0, s.row_bytes) // 8, 1),)
        if not s.groups:
            dims = [(s.read_runs, s.row_stride)]  # only the rows read
    if (math.prod(n for n, _ in dims) * (tail[0][0] if tail else 1)) != s.read_words:
        keep = s.read_words  # a partial read over groups: gather them all, keep the front
    shape = (bases, *(n for n, _ in dims), *(n for n, _ in tail))
    strides = (1, *(st // unit for _, st in dims), *(st for _, st in tail))
    view = _elements(s, unit).as_strided(shape, strides, s.offset // unit)
    return Run(view, s.page_size, s.page_stride // unit, s.token_stride // unit, keys,
               pack=s.pack if s.packed else 0, pack_stride=s.pack_stride // unit, keep=keep,
               bits=8 * unit if s.narrow else 0)


def _fusable(a: ByteSource, b: ByteSource) -> bool:
    same = ("page_size", "num_pages", "page_stride", "token_stride", "row_bytes", "read_bytes")
    return (a.rows == b.rows == 1 and all(getattr(a, k) == getattr(b, k) for k in same)
            and not (a.narrow or a.packed or a.groups or b.narrow or b.packed or b.groups)
            and a.tensor.untyped_storage().data_ptr() == b.tensor.untyped_storage().data_ptr())


def fuse_runs(sources: Sequence[ByteSource]) -> list[Run]:
    runs: list[Run] = []
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
        one = _single(group[0], keys)
        if len(group) > 1:  # the sources' single rows become the parts of one gather
            w = one.view
            view = w.as_strided((w.shape[0], len(group), w.shape[2]), (1, delta // 8, 1), w.storage_offset())
            one = Run(view, one.page_size, one.page_stride, one.token_stride, keys)
        runs.append(one)
        i = j
    return runs
