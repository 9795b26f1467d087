"""Golden vectors and torch == plain Python for the link and content formulas."""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary import hashing as h

GOLDEN_FMIX = {0: 0x0, 1: 0xB456BCFC34C2CB2C, 0xDEADBEEF: 0xD24BD59F862A1DAC}  # murmur3 fmix64


def test_golden_fmix64():
    for x, want in GOLDEN_FMIX.items():
        assert h.py_fmix64(x) == want
        assert h.unsigned(int(h.fmix64(torch.tensor([h.signed(x)]))[0])) == want


def test_golden_links():
    assert h.py_g(0, 0) == 0xF4AA7626012E7756
    assert h.py_g(128000, 32767) == 0x6287A14971F5DE2E
    assert h.py_links([1, 2, 3], [0, 1, 2]) == [0xF0F9198C2F728C73, 0xFD6125A707E26414, 0x96DA50B8337EC894]


def test_golden_content():
    assert h.py_content([bytes(range(16)), bytes(range(16, 48))]) == 0x1AE670AC91151497
    assert h.py_content([bytes(16)]) == 0xC4D50662E831399A
    assert h.py_content([]) == 0


u64 = st.integers(min_value=0, max_value=h.MASK64)


@settings(deadline=None)  # correctness only: a loaded 2-core machine must not fail it
@given(st.lists(st.tuples(u64, u64), min_size=1, max_size=20))
def test_torch_matches_python_g_and_link(pairs):
    toks = torch.tensor([h.signed(t) for t, _ in pairs])
    poss = torch.tensor([h.signed(p) for _, p in pairs])
    prev = torch.tensor([h.signed(t ^ 0x1234) for t, _ in pairs])
    got = h.link_next(prev, toks, poss).tolist()
    want = [h.signed(h.py_link(t ^ 0x1234, t, p)) for t, p in pairs]
    assert got == want


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=12), st.integers(0, 2**32))
def test_affine_scan_segmented_equals_serial_chains(lengths, seed):
    rng = random.Random(seed)
    a, b, want = [], [], []
    for n in lengths:
        toks = [rng.randrange(1 << 17) for _ in range(n)]
        start = rng.randrange(50)
        prev = None if start == 0 else rng.getrandbits(64)
        poss = list(range(start, start + n))
        p = prev
        for i, (t, q) in enumerate(zip(toks, poss)):
            g = h.py_g(t, q)
            if i == 0:
                a.append(0)
                b.append(h.signed(h.LINK_B * (h.LINK_SEED if prev is None else prev) + g))
            else:
                a.append(h.signed(h.LINK_B))
                b.append(h.signed(g))
            p = h.py_link(p, t, q)
            want.append(h.signed(p))
    got = h.affine_scan(torch.tensor(a), torch.tensor(b)).tolist()
    assert got == want


@settings(deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=6), st.integers(1, 4))
def test_fold_matches_python_content(chunks, nsrc):
    rows = [b"".join(chunks) for _ in range(nsrc)]
    rows = [bytes((x + i) % 256 for x in r) for i, r in enumerate(rows)]
    acc = torch.zeros(1, dtype=torch.int64)
    for i, r in enumerate(rows):
        words = torch.frombuffer(bytearray(r), dtype=torch.int64).view(1, -1)
        acc += h.fold_words(words, h.word_keys(i, words.shape[1], torch.device("cpu")))
    assert h.unsigned(int(h.finish_content(acc)[0])) == h.py_content(rows)


def test_content_sees_every_single_bit():
    row = bytearray(random.Random(1).randbytes(64))
    base = h.py_content([bytes(row)])
    for bit in range(64 * 8):
        flipped = bytearray(row)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert h.py_content([bytes(flipped)]) != base, bit


def test_content_sees_swapped_words():
    row = random.Random(2).randbytes(32)
    swapped = row[8:16] + row[:8] + row[16:]
    assert h.py_content([row]) != h.py_content([swapped])


def test_golden_narrow_content():
    """A narrow run is one word, its bytes zero-extended (little-endian): pinned."""
    runs = [b"\x01\x02", b"\x03\x04\x05\x06", b"\x07"]
    assert h.py_words(runs) == [0x0201, 0x06050403, 0x07]
    assert h.py_content_words([h.py_words(runs)]) == 0xAC1C4A8664108AFA
    assert h.py_content_words([]) == 0


@settings(deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=4), st.integers(1, 3))
def test_words_of_wide_runs_are_the_content_words(chunks, nsrc):
    """Wide runs give the words :func:`py_content` reads: the fingerprint of every wide layout stays."""
    rows = [bytes((x + i) % 256 for x in b"".join(chunks)) for i in range(nsrc)]
    assert h.py_content_words([h.py_words([r[j : j + 16] for j in range(0, len(r), 16)]) for r in rows]) == \
        h.py_content(rows)


@settings(deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=4), min_size=1, max_size=12))
def test_torch_fold_of_zero_extended_runs_matches_python(runs):
    words = torch.tensor([[h.signed(w) for w in h.py_words(runs)]])
    acc = h.fold_words(words, h.word_keys(0, words.shape[1], torch.device("cpu")))
    assert h.unsigned(int(h.finish_content(acc)[0])) == h.py_content_words([h.py_words(runs)])


def test_narrow_content_sees_every_single_bit():
    runs = [bytes([1, 2]), bytes([3, 4]), bytes([5])]
    base = h.py_content_words([h.py_words(runs)])
    for r in range(len(runs)):
        for bit in range(8 * len(runs[r])):
            flipped = list(runs)
            b = bytearray(flipped[r])
            b[bit // 8] ^= 1 << (bit % 8)
            flipped[r] = bytes(b)
            assert h.py_content_words([h.py_words(flipped)]) != base, (r, bit)


def test_every_sources_word_keys_in_one_pass_equal_the_reference():
    counts = [3, 0, 5, 48, 1]
    want = [h.signed(h.py_word_key(i, j)) for i, n in enumerate(counts) for j in range(n)]
    assert h.all_word_keys(counts).tolist() == want
    assert h.all_word_keys([]).numel() == 0
