"""vLLM (CPU build): the new tokens' content fingerprints folded inside each layer's forward.

A stamp's content fingerprint is a sum over the slot's words of every layer's K and V
(:func:`kvcanary.fused.fold.fold_source`), so each layer's part can be added as that layer writes,
while its bytes are still in the CPU's caches. Folded after the forward instead, each token's K in
vLLM's column-major CPU layout (``vec``, ``vec16``: one element per cache line) is read back from
memory: about 1 ms a forward for 16 tokens of a 30-layer model, the largest part of the canary's
time there. The per-layer keep (:func:`kvcanary.fused.keep.keep_layer`) folds its layer's sources
into :class:`Fold`; the groups' canaries stamp with the sums that cover all of their sources
(:meth:`kvcanary.canary.Canary.after_forward`'s ``folded``) and fold any other token themselves.

Where the layer's write check has just found a token's cache rows equal to the K and V the layer
computed, bit for bit, the keep folds those computed rows instead (contiguous, where a column-major
K's elements are one cache line each): the same words under the same keys, the keys put in the
rows' order once per set of live groups (:func:`row_keys`).

The compiled loops' module is imported when the first tables are made, never at import: numba
loaded before vLLM's engine starts breaks the start of vLLM 0.32's CPU build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

INVALID = -(1 << 40)  # a count no sum of sources reaches: the forward's folds are not used


@dataclass(frozen=True)
class FoldTables:
    """The live groups' source tables as one (``src`` rows re-based onto the joined ``runs`` and
    ``keys``), each covered layer's sources in it (``spans[i]``: from, to; equal: none), and each
    group's count of sources (``sources[name]``: a token folded over all of them is stamped so)."""

    src: np.ndarray
    runs: np.ndarray
    keys: np.ndarray
    spans: np.ndarray
    sources: dict[str, int]
    rows: np.ndarray  # per source: its first key in ``row_keys``, its words' width, 0 (K) or 1 (V); -1: none
    row_keys: np.ndarray
    _whole: dict[tuple[str, ...], list[int]] = field(default_factory=dict, compare=False, repr=False)

    def whole(self, groups: list[str]) -> list[int]:
        """Each of ``groups``' count of sources (-1: a group without a source table, never whole), made
        once per list of groups."""
        key = tuple(groups)
        got = self._whole.get(key)
        if got is None:
            got = self._whole[key] = [self.sources.get(n, -1) for n in groups]
        return got


def fold_tables(live: list[Any], layers: list[str], group_of: dict[str, Any],
                spans: dict[str, tuple[int, int]], geometry: dict[str, Any] | None = None) -> FoldTables:
    """The fold's tables for a forward over the ``live`` groups (their canaries on the fused path)
    and the covered ``layers`` in the layer table's order (``spans``: each layer's sources in its
    group's layout, its K's then its V's; ``geometry``: each layer's, where its tokens may be folded
    from their computed rows)."""
    from kvcanary.fused.fold import A_CHUNK0, A_KEY0, A_RUN0, A_SPAN0, NUM_SRC_FIELDS, SourceTable

    srcs, runs, keys = [], [], []
    first: dict[str, int] = {}
    n_src = n_run = n_key = 0
    for g in live:
        t = getattr(g.canary, "table", None)
        if not isinstance(t, SourceTable):
            continue
        s = t.src.copy()
        s[:, [A_RUN0, A_CHUNK0, A_SPAN0]] += n_run
        s[:, A_KEY0] += n_key
        first[g.name] = n_src
        srcs.append(s)
        runs.append(t.runs)
        keys.append(t.keys)
        n_src, n_run, n_key = n_src + len(s), n_run + len(t.runs), n_key + len(t.keys)
    out = np.zeros((len(layers), 2), dtype=np.int64)
    for i, n in enumerate(layers):
        g = group_of[n]
        span, base = spans.get(n), first.get(g.name)
        if span is not None and base is not None:
            if not 0 <= span[0] <= span[1] <= g.canary.table.count:
                raise ValueError(f"layer {n}: sources {span[0]} to {span[1]} are outside group {g.name}'s "
                                 f"{g.canary.table.count} sources")
            out[i] = (base + span[0], base + span[1])
    count = {g.name: g.canary.table.count for g in live if g.name in first}
    src = np.concatenate(srcs) if srcs else np.zeros((0, NUM_SRC_FIELDS), dtype=np.int64)
    run = np.concatenate(runs) if runs else np.zeros(1, dtype=np.int64)
    key = np.concatenate(keys) if keys else np.zeros(1, dtype=np.uint64)
    rows = np.full((len(src), 3), -1, dtype=np.int64)
    ordered: list[np.ndarray] = []
    n_row = 0
    for i, n in enumerate(layers):
        geo = (geometry or {}).get(n)
        if geo is None or out[i, 1] - out[i, 0] != 2:
            continue
        for j, half in enumerate(("k", "v")):
            got = row_keys(src[out[i, 0] + j], run, key, geo, half)
            if got is not None:
                rows[out[i, 0] + j] = (n_row, got[0], j)
                ordered.append(got[1])
                n_row += len(got[1])
    return FoldTables(src, run, key, out, count, rows,
                      np.concatenate(ordered + [np.zeros(1, dtype=np.uint64)]))


def row_keys(src: np.ndarray, runs: np.ndarray, keys: np.ndarray, geometry: Any,
             half: str) -> tuple[int, np.ndarray] | None:
    """One source's word keys in the order of a token's computed row of its layer's ``half`` (``"k"``
    or ``"v"``: ``[num_kv_heads, head_dim]`` elements, contiguous), and its words' width in bytes; or
    ``None`` where its words are not that row's bytes in another order (some of them only, or a
    word whose elements are not neighbours in the row). ``src``: the source's row of the source
    table, whose runs and keys are in ``runs`` and ``keys``; ``geometry``: the layer's, which says
    where each element of a slot lies (checked on a few slots; the elements' places are computed as
    arrays, since a layer's K and V hold thousands of elements and a model dozens of layers)."""
    from kvcanary.fused.fold import A_KEY0, A_PS, slot_base

    esz, heads, dim = geometry.element_size, geometry.num_kv_heads, geometry.head_dim
    got = word_offsets(src, runs, geometry)
    if got is None:
        return None
    width, offs = got
    j = np.arange(len(offs))
    ps = int(src[A_PS])
    n = heads * dim
    storage = geometry.tensor.untyped_storage().data_ptr()
    pos = None
    for slot in probe_slots(ps, geometry.num_slots):
        # each row element's byte (row place h * dim + d), from the slot's first byte
        at = element_offsets(geometry, half, slot, heads, dim) - (int(slot_base(src, slot)) - storage)
        order = np.argsort(at, kind="stable")
        placed = at[order]
        if n > 1 and not (placed[1:] != placed[:-1]).all():
            return None  # two elements in one place: not a row's bytes
        i = np.minimum(np.searchsorted(placed, offs), n - 1)
        first = np.where(placed[i] == offs, order[i], -1)  # the row place of each word's first element
        if (first < 0).any():
            return None
        for e in range(1, width // esz):  # a word's elements follow each other in the row
            nxt = first + e
            if (nxt >= n).any() or (at[np.minimum(nxt, n - 1)] != offs + e * esz).any():
                return None
        if ((first * esz) % width).any() or (pos is not None and not np.array_equal(first, pos)):
            return None
        pos = first
    assert pos is not None
    word = pos * esz // width
    if not np.array_equal(np.sort(word), j):
        return None
    ordered = np.empty(len(offs), dtype=np.uint64)
    ordered[word] = keys[int(src[A_KEY0]) + j]
    return width, ordered


def probe_slots(page_slots: int, num_slots: int) -> list[int]:
    """The slots :func:`row_keys` checks a source's element places on: the pool's first two and last,
    and those either side of the first page boundary (``page_slots``: slots a page)."""
    return sorted(s for s in {0, 1, page_slots - 1, page_slots + 1, num_slots - 1} if 0 <= s < num_slots)


def word_offsets(src: np.ndarray, runs: np.ndarray, geometry: Any) -> tuple[int, np.ndarray] | None:
    """A source's words' width in bytes and each word's first byte from its slot's first (``src``
    and ``runs`` as :func:`row_keys`'); ``None`` where its words cannot be a whole row of the
    layer's K or V (another width than the elements', or another number of bytes)."""
    from kvcanary.fused.fold import A_RUN0, A_RUNW, A_WIDTH, A_WORDS

    esz = geometry.element_size
    width, words = int(src[A_WIDTH]) or 8, int(src[A_WORDS])
    if width % esz or words * width != geometry.num_kv_heads * geometry.head_dim * esz:
        return None
    j = np.arange(words)
    r0 = int(src[A_RUN0])
    offs = runs[r0 + j] if src[A_WIDTH] else runs[r0 + j // int(src[A_RUNW])] + 8 * (j % int(src[A_RUNW]))
    return width, np.asarray(offs, dtype=np.int64)


def element_offsets(geometry: Any, half: str, slot: int, heads: int, dim: int) -> np.ndarray:
    """The byte offset (:meth:`~kvcanary.geometry.base.KvGeometry.element`) of every element of
    ``slot``'s ``half``, in a row's order (``h * dim + d``): one call on arrays where the geometry's
    arithmetic takes them, else element by element."""
    h, d = np.divmod(np.arange(heads * dim, dtype=np.int64), dim)
    try:
        got = np.asarray(geometry.element(half, slot, h, d), dtype=np.int64)
        if got.shape == h.shape:
            return got
    except Exception:  # noqa: BLE001 - a geometry whose element() takes integers only
        pass
    return np.array([geometry.element(half, slot, a, b) for a, b in zip(h.tolist(), d.tolist())], dtype=np.int64)


class Fold:
    """One forward's folded fingerprints: ``acc[g, t]`` and ``cnt[g, t]`` for new token ``t`` of
    live group ``g`` (the layer table's ``L_STEP``). A layer seen twice in one forward (its bytes
    may have changed after its first fold) voids them all."""

    def __init__(self, tables: FoldTables, groups: list[str], tokens: int) -> None:
        self.tables, self.groups = tables, groups
        self.acc = np.zeros((len(groups), tokens), dtype=np.uint64)
        self.cnt = np.zeros((len(groups), tokens), dtype=np.int64)
        self.args = (tables.src, tables.runs, tables.keys, tables.spans, tables.rows, tables.row_keys, self.acc,
                     self.cnt)
        self._whole = tables.whole(groups)
        self._seen: set[int] = set()
        self.voided = False  # a layer was seen twice: no sums this forward

    def reset(self) -> None:
        """The sums zeroed for another forward of the same groups and tokens (never after :meth:`void`)."""
        assert not self.voided
        self.acc.fill(0)
        self.cnt.fill(0)
        self._seen.clear()

    def layer(self, index: int) -> tuple[np.ndarray, ...]:
        """The keep's fold arguments for layer row ``index`` (none once a layer was seen twice)."""
        if index in self._seen:
            self.void()
        self._seen.add(index)
        return self.args

    def void(self) -> None:
        """This forward's folds are not used (a layer seen twice): no sums, and none taken from here."""
        self.voided = True
        self.cnt[:] = INVALID
        self.args = (*self.args[:6], self.acc[:, :0], self.cnt[:, :0])

    def results(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each live group's sums and counts, for its canary's stamp."""
        return {n: (self.acc[i], self.cnt[i]) for i, n in enumerate(self.groups)}

    def whole(self) -> int:
        """The new tokens folded over all of their group's sources (stamped with the fold). Counted in
        Python: it runs first after the forward, where numpy's first ufunc pays to bring its code
        back into the core's caches (a compare and count of a decode batch took 52-53 µs there, this
        12; ``bench/vllm_stages.py --fine``)."""
        return sum(row.count(w) for row, w in zip(self.cnt.tolist(), self._whole))
