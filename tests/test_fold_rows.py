"""A new token's fingerprint folded from the K and V rows its layer computed
(:func:`kvcanary.fused.fold.fold_row`, keys put in the rows' order by
:func:`kvcanary.engines.vllm.fold.row_keys`) equals the fold of the same bytes in the cache
(:func:`kvcanary.fused.fold.fold_source`), on vLLM's CPU layouts: ``vec`` (K column-major, one
narrow element a word; V token-major, wide words) in bf16 and fp32, and ``amx`` (K in 4-byte pairs
packed across 16 tokens, V in 2-byte elements across token pairs). The per-layer keep
(:func:`kvcanary.fused.keep.keep_layer`) takes the rows only for a token whose write check found
them equal to the cache: a token whose computed rows differ is folded from the cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcanary.fused import available

pytestmark = pytest.mark.skipif(available() is not None, reason="numba is not installed")

BLOCKS, HEADS, BLOCK, DIM = 6, 3, 32, 64


def _pool(isa: str, dtype: torch.dtype, layers: int = 2):  # type: ignore[no-untyped-def]
    from kvcanary.fused.fold import SourceTable
    from kvcanary.geometry.vllm_cpu import vllm_cpu
    from kvcanary.layout import KvLayout

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, generator=g).to(dtype) for _ in range(layers)]
    geos = [vllm_cpu(t, isa, BLOCK, HEADS, DIM, i) for i, t in enumerate(tensors)]
    sources = [s for i, geo in enumerate(geos) for s in geo.sources(f"layer{i}")]
    table = SourceTable(KvLayout(tuple(sources)))
    names = [f"l{i}" for i in range(layers)]
    group = SimpleNamespace(name="g", canary=SimpleNamespace(table=table))
    return geos, table, names, group


def _fold_both():  # type: ignore[no-untyped-def]
    from numba import njit

    from kvcanary.fused.fold import fold_row, fold_source

    @njit
    def from_cache(src, runs, keys, i, slot):  # type: ignore[no-untyped-def]
        return fold_source(src, runs, keys, i, slot)

    @njit
    def from_row(addr, width, keys, k0, n):  # type: ignore[no-untyped-def]
        return fold_row(addr, width, keys, k0, n)

    return from_cache, from_row


@pytest.mark.parametrize("isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32), ("amx", torch.bfloat16)])
def test_a_slot_folded_from_its_computed_rows_equals_its_fold_from_the_cache(isa: str, dtype: torch.dtype) -> None:
    from kvcanary.engines.vllm.fold import fold_tables

    geos, table, names, group = _pool(isa, dtype)
    spans = {n: (2 * i, 2 * i + 2) for i, n in enumerate(names)}
    ft = fold_tables([group], names, {n: group for n in names}, spans, dict(zip(names, geos)))
    assert (ft.rows[:, 0] >= 0).all()  # every source's keys in a row's order
    from_cache, from_row = _fold_both()
    slots = [0, 1, 15, 16, 17, BLOCK - 1, BLOCK, 2 * BLOCK + 7, BLOCKS * BLOCK - 1]
    for li, geo in enumerate(geos):
        for j, half in enumerate(("k", "v")):
            i = 2 * li + j
            start, width, which = ft.rows[i].tolist()
            assert which == j
            rows = geo.rows(half, torch.tensor(slots)).contiguous()  # [slots, heads, dim]: what a layer computes
            n = HEADS * DIM * geo.element_size // width
            for k, s in enumerate(slots):
                want = from_cache(table.src, table.runs, table.keys, i, s)
                assert from_row(rows[k].data_ptr(), width, ft.row_keys, start, n) == want, (half, s)
                other = rows[k].clone()
                other.view(-1)[5] += 1  # one element differs: so does the fold
                assert from_row(other.data_ptr(), width, ft.row_keys, start, n) != want


def test_a_source_of_part_of_a_row_is_not_folded_from_rows() -> None:
    from kvcanary.engines.vllm.fold import row_keys
    from kvcanary.fused.fold import A_WORDS

    geos, table, _, _ = _pool("vec", torch.bfloat16, layers=1)
    assert row_keys(table.src[0], table.runs, table.keys, geos[0], "k") is not None
    part = table.src[0].copy()
    part[A_WORDS] -= 1
    assert row_keys(part, table.runs, table.keys, geos[0], "k") is None
    assert row_keys(table.src[0], table.runs, table.keys, geos[0], "v") is None  # K's words are not V's row


@pytest.mark.parametrize("isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32), ("amx", torch.bfloat16)])
def test_the_keep_folds_a_token_from_its_rows_only_where_they_equal_the_cache(isa: str, dtype: torch.dtype) -> None:
    """keep_layer over a forward of 5 new tokens: the sums equal the cache's folds with the rows the
    cache holds, with a row that differs from the cache in one token (that token folded from the
    cache, its write check reporting K), with no rows given (every token from the cache), and with
    rows given but the write check left out (every token from the rows: a row that differs from the
    cache gives its token the rows' fingerprint, which the content verify later finds unlike the
    cache's)."""
    from kvcanary.audit.tables import LAYER_COLUMNS, L_STEP, layer_row, strides
    from kvcanary.audit.reference import DTYPES
    from kvcanary.engines.vllm.fold import Fold, fold_tables
    from kvcanary.fused._step import describe
    from kvcanary.fused.keep import KEEP_LAYER_AT, direct, keep_layer, keep_layer_at, keep_tables
    from kvcanary.step import Step

    entry = direct(keep_layer_at, KEEP_LAYER_AT)  # past the dispatcher, as inside vLLM's layers
    assert entry is not keep_layer_at and callable(entry)

    geos, table, names, group = _pool(isa, dtype, layers=1)
    geo = geos[0]
    ft = fold_tables([group], names, {names[0]: group}, {names[0]: (0, 2)}, {names[0]: geo})
    new_slots = torch.tensor([40, 41, 75, 100, 150])
    n = len(new_slots)
    step = Step(cached_lens=torch.zeros(n, dtype=torch.int64), new_offsets=torch.arange(n + 1),
                new_tokens=torch.arange(n), new_positions=torch.zeros(n, dtype=torch.int64), new_slots=new_slots,
                block_table=(new_slots // BLOCK)[:, None], block_size=BLOCK)
    steps = describe(step)[None]
    descs = geo.descriptors()
    assert descs is not None
    layers = np.array([layer_row(descs[0], descs[1], 0, DTYPES[geo.dtype], geo.element_size, HEADS, DIM,
                                 geo.num_slots - 1, DTYPES[geo.dtype])], dtype=np.int64)
    assert layers.shape == (1, LAYER_COLUMNS) and layers[0, L_STEP] == 0
    qkv = torch.zeros(n, 3 * HEADS * DIM, dtype=dtype)  # the layer's computed K and V, views of one buffer
    k = qkv[:, HEADS * DIM:2 * HEADS * DIM].view(n, HEADS, DIM)
    v = qkv[:, 2 * HEADS * DIM:].view(n, HEADS, DIM)
    k.copy_(geo.k_rows(new_slots))
    v.copy_(geo.v_rows(new_slots))
    st = np.array(strides(k, 0, 1, 2) + strides(v, 0, 1, 2) + strides(k, 0, 1, 2) + strides(k, 0, 1, 2),
                  dtype=np.int64)
    toks = np.arange(n)

    def run(write: bool, check: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = []
        # keep_layer, and keep_layer_at over the same tables, through the dispatcher and its compiled entry
        for call in ("arrays", "address", "entry"):
            fold = Fold(ft, ["g"], n)
            half = np.zeros((1, n), dtype=np.int64)
            head = np.full_like(half, -1)
            ka, va = (k.data_ptr(), v.data_ptr()) if write else (0, 0)
            if call == "arrays":
                differ = keep_layer(layers, 0, ka, va, int(check), st, steps, toks, half, head, *fold.layer(0))
            else:
                at = keep_tables(layers, st, steps, toks, half, head, *fold.layer(0))
                differ = (keep_layer_at if call == "address" else entry)(at.__array_interface__["data"][0], 0, ka,
                                                                         va, int(check))
            assert differ == np.count_nonzero(half)  # the checked tokens whose write differs, counted
            got.append((fold.acc[0].copy(), fold.cnt[0].copy(), half[0], head[0]))
        (acc, cnt, half, head), *again = got
        assert all((a == b).all() for other in again for a, b in zip(got[0], other))
        if not (write and check):  # no write check: its rows untouched
            assert (head == -1).all() and (half == 0).all()
        return acc, cnt, half

    cache_acc, cache_cnt, _ = run(False)
    assert (cache_cnt == 2).all() and (cache_acc != 0).all()
    for check in (True, False):  # the rows equal the cache: the same folds, checked or not
        acc, cnt, half = run(True, check)
        assert (acc == cache_acc).all() and (cnt == cache_cnt).all() and (half == 0).all()
    k[2, 1, 7] += 1  # token 2's computed K differs from the cache: its write check says so, its fold is the cache's
    acc, cnt, half = run(True)
    assert half.tolist() == [0, 0, 1, 0, 0]
    assert (acc == cache_acc).all() and (cnt == cache_cnt).all()
    acc, cnt, half = run(True, check=False)  # unchecked: token 2 folded from its rows, unlike the cache
    assert (acc != cache_acc).tolist() == [False, False, True, False, False] and (cnt == cache_cnt).all()
    v[4, 2, DIM - 1] += 1  # and token 4's V, in the last strip of the last head
    acc, cnt, half = run(True)
    assert half.tolist() == [0, 0, 1, 0, 2]
    assert (acc == cache_acc).all() and (cnt == cache_cnt).all()
    acc, cnt, half = run(True, check=False)
    assert (acc != cache_acc).tolist() == [False, False, True, False, True]


def test_direct_falls_back_to_what_it_is_given() -> None:
    """``direct`` gives a compiled entry for a numba dispatcher only: a function that replaced the loop
    (a fault, a test) is called as it is, and so is a dispatcher whose signature does not compile."""
    from numba import njit, types

    from kvcanary.fused.keep import direct

    def plain(*a: int) -> int:
        return 7

    assert direct(plain, (types.int64,)) is plain

    @njit
    def twice(x):  # type: ignore[no-untyped-def]
        return 2 * x

    entry = direct(twice, (types.int64,))
    assert entry is not twice and entry(21) == 42
    assert direct(twice, (types.unicode_type, types.int64)) is twice  # two arguments for one: not compiled


def test_keep_tables_refuses_a_table_of_another_dtype_shape_or_count() -> None:
    """keep_layer_at reads its tables through raw addresses: keep_tables checks each one first and names
    the one that is wrong."""
    from kvcanary.fused.keep import KEEP_TABLES, keep_tables

    good = [np.zeros((2, 3) if nd == 2 else 3, dtype=dt) for _, nd, dt in KEEP_TABLES]
    at = keep_tables(*good)
    assert at.shape == (3 * len(KEEP_TABLES),) and at[3 * 4 + 1:3 * 4 + 3].tolist() == [2, 3]
    assert at[0::3].tolist() == [t.__array_interface__["data"][0] for t in good]  # each table's own address
    assert at[1::3].tolist() == [t.shape[0] for t in good]
    assert at[2::3].tolist() == [t.shape[1] if t.ndim == 2 else 0 for t in good]
    with pytest.raises(ValueError, match="expected 14 tables"):
        keep_tables(*good[:-1])
    bad = list(good)
    bad[8] = np.zeros(3, dtype=np.int64)  # fkeys are uint64
    with pytest.raises(ValueError, match="fkeys must be a C-contiguous 1-d uint64 array, got 1-d int64"):
        keep_tables(*bad)
    bad = list(good)
    bad[4] = np.zeros((3, 2), dtype=np.int64).T  # half: not C-contiguous
    with pytest.raises(ValueError, match="half must be a C-contiguous 2-d int64"):
        keep_tables(*bad)


def _row_keys_one_by_one(src, runs, keys, geometry, half):  # type: ignore[no-untyped-def]
    """row_keys' rule written element by element (the words' offsets shared, word_offsets): the
    reference the array version must equal."""
    from kvcanary.engines.vllm.fold import probe_slots, word_offsets
    from kvcanary.fused.fold import A_KEY0, A_PS, slot_base

    esz, heads, dim = geometry.element_size, geometry.num_kv_heads, geometry.head_dim
    got = word_offsets(src, runs, geometry)
    if got is None:
        return None
    width, offs = got
    j = np.arange(len(offs))
    ps = int(src[A_PS])
    storage = geometry.tensor.untyped_storage().data_ptr()
    pos = None
    for slot in probe_slots(ps, geometry.num_slots):
        base = int(slot_base(src, slot)) - storage
        at = {geometry.element(half, slot, h, d) - base: h * dim + d for h in range(heads) for d in range(dim)}
        first = np.array([at.get(o, -1) for o in offs.tolist()], dtype=np.int64)
        for e in range(1, width // esz):
            if any(at.get(o + e * esz, -2) != p + e for o, p in zip(offs.tolist(), first.tolist())):
                return None
        if (first < 0).any() or ((first * esz) % width).any() or (pos is not None and not np.array_equal(first, pos)):
            return None
        pos = first
    word = pos * esz // width
    if not np.array_equal(np.sort(word), j):
        return None
    ordered = np.empty(len(offs), dtype=np.uint64)
    ordered[word] = keys[int(src[A_KEY0]) + j]
    return width, ordered


@pytest.mark.parametrize("isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32), ("vec16", torch.float16),
                                       ("amx", torch.bfloat16)])
def test_row_keys_equal_the_element_by_element_rule(isa: str, dtype: torch.dtype) -> None:
    """The array version of row_keys gives what the rule written element by element gives: the same
    keys in the same order for every source, and None alike for a source that is part of a row, one
    read as the other half, and one whose runs are shifted by an element."""
    from kvcanary.engines.vllm.fold import element_offsets, row_keys
    from kvcanary.fused.fold import A_RUN0, A_WORDS

    geos, table, _, _ = _pool(isa, dtype)
    found = 0
    for li, geo in enumerate(geos):
        for j, half in enumerate(("k", "v")):
            src = table.src[2 * li + j]
            cases = [(src, table.runs, half), (src, table.runs, "v" if half == "k" else "k")]
            part = src.copy()
            part[A_WORDS] -= 1
            cases.append((part, table.runs, half))
            shifted = table.runs.copy()
            shifted[int(src[A_RUN0]):] += geo.element_size
            cases.append((src, shifted, half))
            for s, r, h in cases:
                got, want = row_keys(s, r, table.keys, geo, h), _row_keys_one_by_one(s, r, table.keys, geo, h)
                assert (got is None) == (want is None), (isa, half, h)
                if got is not None:
                    found += 1
                    assert got[0] == want[0] and np.array_equal(got[1], want[1])
            for slot in (0, 17, geo.num_slots - 1):  # the arrays' places are the geometry's, element by element
                at = element_offsets(geo, half, slot, geo.num_kv_heads, geo.head_dim)
                assert at.tolist() == [geo.element(half, slot, h, d) for h in range(geo.num_kv_heads)
                                       for d in range(geo.head_dim)]
    assert found == 2 * len(geos)  # every source of the pool is keyed in a row's order


def test_element_offsets_of_a_geometry_that_takes_integers_only() -> None:
    from kvcanary.engines.vllm.fold import element_offsets

    class Ints:
        def element(self, half, slot, h, d):  # type: ignore[no-untyped-def]
            if not isinstance(h, int) or not isinstance(d, int):
                raise TypeError("integers only")
            return 1000 * slot + 100 * h + d + (7 if half == "v" else 0)

    assert element_offsets(Ints(), "v", 2, 2, 3).tolist() == [2007, 2008, 2009, 2107, 2108, 2109]
