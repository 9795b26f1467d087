"""Stamp arithmetic: the link accumulator and the content fingerprint.

All values are 64-bit words held in ``torch.int64`` (two's complement); multiplication and
addition wrap modulo 2**64, and right shifts are logical (masked), so the same formulas give the
same bits in torch, in Triton (uint64) and in the plain-Python reference used by the tests.

Link
    ``P[i] = B * P[i-1] + g(token[i], position[i])  (mod 2**64)`` with ``P[-1] = LINK_SEED``.
    A slot's stamp stores ``P`` at its own position, so one adjacent pair of slots is enough to
    check the chain, and a whole prefill's accumulators come out of one parallel scan over the
    affine maps ``x -> a*x + b`` (``a = B`` inside a sequence, ``a = 0`` at a sequence head).

Content
    ``content = fmix64(CONTENT_SALT ^ sum_{s,j} wmix(word[s, j] ^ key(s, j)))`` over every 8-byte
    word ``j`` of every source ``s``; ``wmix`` is a bijection, so any single changed word changes
    the sum, and the sum is order-free, so it reduces in parallel. A source's words are its runs'
    bytes in order (:mod:`kvcanary.layout`): 8 to a word, a run narrower than a word zero-extended
    to one, so a changed byte of a narrow run still changes its word.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1

LINK_B = 0x9E3779B97F4A7C15  # odd: the map x -> B*x is a bijection mod 2**64
LINK_SEED = 0x5EED_C0DE_7A11_0001
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53
POS_SALT = 0x2545F4914F6CDD1D
WORD_MUL = 0xD6E8FEB86659FD93
KEY_SALT = 0x9FB21C651E98DF25
CONTENT_SALT = 0xA0761D6478BD642F


def signed(x: int) -> int:
    """Map an unsigned 64-bit value to the int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def unsigned(x: int) -> int:
    """Map an int64 to the unsigned 64-bit value with the same bits."""
    return x & MASK64


# ---------------------------------------------------------------------------------------------
# Plain-Python reference (one value at a time); the tests pin golden vectors against it.
# ---------------------------------------------------------------------------------------------


def py_fmix64(x: int) -> int:
    x &= MASK64
    x ^= x >> 33
    x = (x * FMIX_C1) & MASK64
    x ^= x >> 33
    x = (x * FMIX_C2) & MASK64
    return x ^ (x >> 33)


def py_g(token: int, position: int) -> int:
    """Per-token term of the link: mixes the token id with its position."""
    return py_fmix64((token & MASK64) ^ py_fmix64((position + POS_SALT) & MASK64))


def py_link(prev: int | None, token: int, position: int) -> int:
    """Link of a token given the link of its predecessor (``None`` at a sequence head)."""
    p = LINK_SEED if prev is None else prev & MASK64
    return (LINK_B * p + py_g(token, position)) & MASK64


def py_links(tokens: list[int], positions: list[int]) -> list[int]:
    """Serial chain over one whole sequence, starting at its head."""
    out: list[int] = []
    prev: int | None = None
    for t, p in zip(tokens, positions):
        prev = py_link(prev, t, p)
        out.append(prev)
    return out


def py_word_key(source: int, word: int) -> int:
    return py_fmix64(((source << 32) | word) ^ KEY_SALT)


def py_wmix(x: int) -> int:
    x = (x * WORD_MUL) & MASK64
    return x ^ (x >> 29)


def py_content(rows: list[bytes]) -> int:
    """Content fingerprint of one slot from the raw bytes of each source (in layout order): each
    source's bytes read as little-endian 8-byte words (the wide runs' words, back to back)."""
    return py_content_words([[int.from_bytes(row[8 * j : 8 * j + 8], "little") for j in range(len(row) // 8)]
                             for row in rows])


def py_words(runs: list[bytes]) -> list[int]:
    """The words of one source of one slot from its runs, in order: a wide run's bytes as
    little-endian 8-byte words, a narrow run (under 8 bytes) as one word, zero-extended."""
    out: list[int] = []
    for run in runs:
        out += [int.from_bytes(run[j : j + 8], "little") for j in range(0, len(run), 8)]
    return out


def py_content_words(sources: list[list[int]]) -> int:
    """Content fingerprint of one slot from the words of each source (in layout order):
    ``fmix64(CONTENT_SALT ^ sum_{s,j} wmix(word[s][j] ^ key(s, j)))``, 0 without sources."""
    if not sources:
        return 0
    acc = 0
    for s, words in enumerate(sources):
        for j, w in enumerate(words):
            acc = (acc + py_wmix((w & MASK64) ^ py_word_key(s, j))) & MASK64
    return py_fmix64(acc ^ CONTENT_SALT)


# ---------------------------------------------------------------------------------------------
# Vectorized torch versions (int64 tensors, any shape).
# ---------------------------------------------------------------------------------------------

_LSR_MASK = {k: (1 << (64 - k)) - 1 for k in (29, 33)}


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & _LSR_MASK[k]


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 64-bit finaliser on int64 tensors (bit-identical to :func:`py_fmix64`)."""
    x = x ^ _lsr(x, 33)
    x = x * signed(FMIX_C1)
    x = x ^ _lsr(x, 33)
    x = x * signed(FMIX_C2)
    return x ^ _lsr(x, 33)


_POS_TABLE: dict[torch.device, torch.Tensor] = {}
_POS_TABLE_LIMIT = 1 << 22


def pos_mix(positions: torch.Tensor) -> torch.Tensor:
    """``fmix64(position + POS_SALT)``, from a cached table for the usual range (CPU path speed)."""
    if positions.numel() and positions.device.type == "cpu":
        lo, hi = int(positions.min()), int(positions.max())
        if 0 <= lo and hi < _POS_TABLE_LIMIT:
            table = _POS_TABLE.get(positions.device)
            if table is None or table.shape[0] <= hi:
                size = max(1024, 1 << hi.bit_length())
                table = fmix64(torch.arange(size, dtype=torch.int64, device=positions.device) + signed(POS_SALT))
                _POS_TABLE[positions.device] = table
            return table[positions]
    return fmix64(positions + signed(POS_SALT))


def g_term(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``g(token, position)`` elementwise; both int64, same shape."""
    return fmix64(tokens ^ pos_mix(positions))


def link_next(prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``B * prev + g(token, position)`` elementwise (one adjacent pair of the chain)."""
    return prev * signed(LINK_B) + g_term(tokens, positions)


def affine_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Inclusive scan of the affine maps ``x -> a[i]*x + b[i]`` applied left to right.

    Returns ``y`` with ``y[i] = a[i]*y[i-1] + b[i]`` and ``y[-1] = 0``; a map with ``a = 0``
    starts a new segment. Hillis-Steele doubling: ``ceil(log2 n)`` vectorized passes.

    Parameters
    ----------
    a, b : int64 ``[n]``
    """
    a = a.clone()
    b = b.clone()
    n = a.numel()
    d = 1
    while d < n:
        # compose element i with element i-d: (a_i, b_i) o (a_{i-d}, b_{i-d})
        na = a[d:] * a[:-d]
        nb = a[d:] * b[:-d] + b[d:]
        a[d:] = na
        b[d:] = nb
        d *= 2
    return b


def word_keys(source: int, num_words: int, device: torch.device) -> torch.Tensor:
    """Per-word keys ``key(source, j)`` for ``j < num_words`` as int64 ``[num_words]``."""
    return _keys(torch.full((num_words,), source, dtype=torch.int64, device=device),
                 torch.arange(num_words, dtype=torch.int64, device=device))


def _keys(source: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """``key(source, word)`` elementwise (:func:`py_word_key`)."""
    return fmix64(((source << 32) | word) ^ signed(KEY_SALT))


def all_word_keys(counts: list[int]) -> torch.Tensor:
    """Every source's word keys in layout order, :func:`word_keys` of source ``i`` for its ``counts[i]``
    words one after another, as int64 on the CPU, in one vectorised pass (not one per source)."""
    n = torch.tensor(counts, dtype=torch.int64)
    src = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), n)
    return _keys(src, torch.arange(int(n.sum()), dtype=torch.int64) - (torch.cumsum(n, 0) - n)[src])


def wmix(x: torch.Tensor) -> torch.Tensor:
    x = x * signed(WORD_MUL)
    return x ^ _lsr(x, 29)


def fold_words(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Partial content sum of one source: ``sum_j wmix(words[..., j] ^ keys[j])``.

    Parameters
    ----------
    words : int64 ``[n, num_words]``
    keys : int64 ``[num_words]``
    """
    return wmix(words ^ keys).sum(dim=-1)


def finish_content(acc: torch.Tensor) -> torch.Tensor:
    """Finalise a content sum into the stored fingerprint."""
    return fmix64(acc ^ signed(CONTENT_SALT))
