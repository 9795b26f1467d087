"""Steps from paged-attention metadata, as compiled loops: vLLM's query start offsets, sequence
lengths and slot mapping (numpy views of the metadata's CPU tensors), into the new-token fields of
:func:`kvcanary.engines.vllm.compiled.step_of` (equal to
:func:`kvcanary.engines.block_table.step_from_block_table`)."""

from __future__ import annotations

import numpy as np

from kvcanary.fused._core import JIT
from kvcanary.fused.cache import njit


@njit(**JIT)
def fill_tokens(qsl, seq, book, book_rows, out):  # type: ignore[no-untyped-def]
    """``out[t]``: the id of new token ``t`` (row ``r``'s position ``seq[r] - q[r] + j``) in row
    ``book_rows[r]`` of the token book, -1 past the book's width."""
    width = book.shape[1]
    for row in range(qsl.shape[0] - 1):
        c = np.int64(seq[row]) - (qsl[row + 1] - qsl[row])
        b = book_rows[row]
        for t in range(qsl[row], qsl[row + 1]):
            pos = c + (t - qsl[row])
            out[t] = book[b, pos] if 0 <= pos < width else -1


@njit(**JIT)
def fill_new(qsl, seq, slot_mapping, valid, cached, new_positions, new_slots):  # type: ignore[no-untyped-def]
    """Each row's cached length and each new token's position and slot (-1 in a padding row), as
    :func:`kvcanary.engines.block_table.step_from_block_table`."""
    r = cached.shape[0]
    for row in range(r):
        q = qsl[row + 1] - qsl[row]
        c = np.int64(seq[row]) - q
        cached[row] = c
        for t in range(qsl[row], qsl[row + 1]):
            new_positions[t] = c + (t - qsl[row])
            new_slots[t] = slot_mapping[t] if valid[row] else -1
