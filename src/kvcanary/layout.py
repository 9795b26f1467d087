"""A KV layout: the ordered byte sources (:class:`~kvcanary.source.ByteSource`) of one pool of KV
slots, which fix its content fingerprint, and the pool's guard slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvcanary import hashing
from kvcanary._reads import Run, check_disjoint, fuse_runs
from kvcanary.errors import LayoutError
from kvcanary.source import ByteSource

MAX_SOURCES = 256  # entries in the fixed-size source table the kernels take


def _slot_ids(name: str, ids: object) -> tuple[int, ...]:
    """``ids`` (an iterable of integers) as sorted unique slot ids; a clear error otherwise."""
    ok = not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__")
    items = list(ids) if ok else []  # type: ignore[call-overload]
    if not ok or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise LayoutError(f"{name}: expected slot ids (a sequence of integers), got {type(ids).__name__} {ids!r}")
    return tuple(sorted(set(items)))


_SOURCE_HINT = (" (describe each tensor with ByteSource.from_tensor(name, tensor, page_size=...), or build the "
                "layout with KvLayout.from_tensors([(name, tensor), ...], page_size=...))")


@dataclass(frozen=True, eq=False)
class KvLayout:
    """An ordered list of byte sources over one pool of KV slots (empty: metadata only), and the
    pool's guard slots.

    ``reserved`` are slots the engine never writes (a null block, the page padding tokens read
    from): their bytes are fingerprinted when the canary is made and after every forward, so any
    write into them, an engine's warm-up runs' included, is found. ``guards`` are live slots where a stray padding write
    would land (a padding slot id that is a real slot); the pool's first slot (a zeroed index) and
    last slot (a ``-1`` that wraps) are always guarded. A guarded slot that holds a stamp is
    re-verified on every forward. Slot ids are checked against the pool by the canary.
    """

    sources: tuple[ByteSource, ...] = ()
    reserved: tuple[int, ...] = ()
    guards: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.sources, (torch.Tensor, str, bytes)) or not hasattr(self.sources, "__iter__"):
            raise LayoutError(f"sources: expected a tuple of ByteSource, got {type(self.sources).__name__}"
                              f"{_SOURCE_HINT}")
        object.__setattr__(self, "sources", tuple(self.sources))
        for i, src in enumerate(self.sources):
            if not isinstance(src, ByteSource):
                raise LayoutError(f"sources[{i}]: expected a ByteSource, got {type(src).__name__}{_SOURCE_HINT}")
        for name in ("reserved", "guards"):
            object.__setattr__(self, name, _slot_ids(name, getattr(self, name)))
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
            check_disjoint(group)

    def gathers(self) -> list[Run]:
        """The torch path's reads of the sources (:func:`kvcanary._reads.fuse_runs`), made at the first
        :meth:`fingerprint`: the fused path reads the bytes in compiled loops and never needs them (a
        30-layer model's 60 sources took milliseconds of each new pool's setup)."""
        runs = self.__dict__.get("_runs")
        if runs is None:
            runs = fuse_runs(self.sources)
            object.__setattr__(self, "_runs", runs)
        return runs  # type: ignore[no-any-return]

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
        for run in self.gathers():
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
