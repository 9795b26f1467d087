"""A forward's step from SGLang's own metadata: the ``ForwardBatch`` the model runner is handed and
the ``req_to_token`` table its attention reads through.

SGLang's table is token-granular (``req_to_token[row, p]`` is the KV slot of position ``p``), so the
step is a ``slot_table`` step whose ``table_rows`` are the batch's ``req_pool_indices``. Row ``r``
reads positions ``[0, cached)`` and writes its new tokens at ``out_cache_loc``:

============ ========================================== ==========================================
mode         cached (read before this step)             new tokens
============ ========================================== ==========================================
extend       ``extend_prefix_lens`` (a radix-cache hit, ``extend_seq_lens`` (a prompt, a prefill
             a continued prefill chunk, a re-prefill     chunk; mixed batches are extends too)
             after a retraction)
decode       ``seq_lens - 1``                           one
============ ========================================== ==========================================

The table already holds this forward's slots when the runner is entered (the scheduler allocated
them), and the torch-native backend reads each row's whole ``[0, seq_len)``, sliding-window layers
included (they mask, they do not skip). The step's tensors are the batch's, on the pool's device.
Imports nothing of SGLang's: the tests build steps from stand-in batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.engines.block_table import written_from
from kvcanary.errors import StepError, UnsupportedError
from kvcanary.step import Step


def new_counts(fb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's cached length and new-token count (int64 ``[R]`` each) of a ``ForwardBatch``, or
    ``None`` for a forward that touches no KV (idle). A mode kvcanary does not describe (speculative
    verify, draft extend, split prefill) is refused by name."""
    mode = fb.forward_mode
    if mode.is_idle():
        return None
    if mode.is_decode():
        seq = fb.seq_lens.long()
        return seq - 1, torch.ones_like(seq)
    if mode.name in ("EXTEND", "MIXED"):
        return fb.extend_prefix_lens.long(), fb.extend_seq_lens.long()
    raise UnsupportedError(f"SGLang forward mode {mode.name}: kvcanary describes EXTEND, MIXED and DECODE forwards "
                           f"(not speculative decoding, split prefill or dLLM yet)")


def host_counts(fb: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each row's cached length and new-token count (int64 ``[R]`` each) on the host, from the
    ``ForwardBatch``'s CPU copies where it has them (no read of a device tensor): for the audit's
    planning."""
    if fb.forward_mode.is_decode():
        seq = getattr(fb, "seq_lens_cpu", None)
        seq = np.asarray(seq if seq is not None else fb.seq_lens.tolist(), dtype=np.int64)
        return seq - 1, np.ones_like(seq)
    cached = getattr(fb, "extend_prefix_lens_cpu", None)
    new = getattr(fb, "extend_seq_lens_cpu", None)
    cached = cached if cached is not None else fb.extend_prefix_lens.tolist()
    new = new if new is not None else fb.extend_seq_lens.tolist()
    return np.asarray(cached, dtype=np.int64), np.asarray(new, dtype=np.int64)


def build_step(fb: Any, req_to_token: torch.Tensor, expected: torch.Tensor | None = None,
               expected_rows: torch.Tensor | None = None) -> Step | None:
    """The step of one forward (``None``: it touches no KV).

    Parameters
    ----------
    fb : SGLang's ``ForwardBatch``: ``req_pool_indices`` ``[R]``, ``seq_lens`` ``[R]``, ``input_ids``,
        ``positions`` and ``out_cache_loc`` ``[T]``, and in an extend ``extend_prefix_lens`` and
        ``extend_seq_lens`` ``[R]``
    req_to_token : int32 ``[rows, max_context_len]`` the token-to-slot table
    expected, expected_rows : the requests' real token streams (:class:`kvcanary.engines.token_book.TokenBook`'s
        buffer, -1 where unknown) and each step row's row in it
    """
    counts = new_counts(fb)
    if counts is None:
        return None
    cached, q = counts
    n = int(fb.input_ids.shape[0])
    if int(fb.out_cache_loc.shape[0]) != n or int(fb.positions.shape[0]) != n:
        raise StepError(f"ForwardBatch: expected input_ids, positions and out_cache_loc of one length, got "
                        f"{n}, {int(fb.positions.shape[0])} and {int(fb.out_cache_loc.shape[0])}")
    offsets = torch.zeros(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    torch.cumsum(q, 0, out=offsets[1:])
    step = Step(cached_lens=cached, new_offsets=offsets, new_tokens=fb.input_ids.long(),
                new_positions=fb.positions.long(), new_slots=fb.out_cache_loc.long(), slot_table=req_to_token,
                table_rows=fb.req_pool_indices.long(), expected_tokens=expected, expected_rows=expected_rows)
    step.written_from = written_from(step)
    return step
