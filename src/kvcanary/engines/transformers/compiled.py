"""transformers continuous batching on a CPU pool with the fused backend: a forward's steps filled by
compiled loops into buffers kept from one forward to the next.

Equal, field for field, to :func:`kvcanary.engines.transformers.steps.build_steps`' torch
construction on the positions the checks use (``tests/test_transformers.py`` compares them on live
runs). The buffers, and the :class:`~kvcanary.step.Step` objects over them, are made again only when
the forward's shape changes (its requests, new tokens, or a table width past the rounded capacity):
in a run of decode forwards the canary's checked shapes and compiled descriptors carry over, and a
forward's host work is the requests' lengths, the token book's new tokens and two compiled calls.
The steps read the token book's record in place (``expected_rows``): nothing is copied per read
position.
A step returned here is refilled by the next forward's build; use it within its forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcanary.engines.token_book import TokenBook
from kvcanary.fused.index_steps import fill_common, fill_group
from kvcanary.step import Step

_EMPTY1, _EMPTY2 = np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
WIDTH_QUANTUM = 128  # table widths are rounded up to this, so a decode run keeps one shape for 128 forwards


class _Shape:
    """The buffers and steps of one forward shape."""

    def __init__(self, names: list[str], r: int, total: int, width: int, tokens: bool, narrow: bool) -> None:
        e64 = lambda *shape: torch.empty(shape, dtype=torch.int64)  # noqa: E731
        self.past, self.cu, self.tokens, self.positions = e64(r), e64(r + 1), e64(total), e64(total)
        self.erows = e64(r if tokens else 0)
        self.exp_new = e64(total if tokens else 0)
        # int32 slot tables where every slot number fits (half the bytes the build writes and the verify reads)
        tab = lambda: torch.empty((r + 1, width + 1), dtype=torch.int32 if narrow else torch.int64)  # noqa: E731
        self.groups = {name: (tab(), e64(r), e64(total)) for name in names}
        self.steps = {
            name: Step(slot_table=table, cached_lens=self.past, read_starts=starts, new_offsets=self.cu,
                       new_tokens=self.tokens, new_positions=self.positions, new_slots=wslot,
                       expected_rows=self.erows if tokens else None,
                       expected_new_tokens=self.exp_new if tokens else None)
            for name, (table, starts, wslot) in self.groups.items()
        }
        # numpy views for the compiled calls
        self.np = {k: getattr(self, k).numpy() for k in ("past", "cu", "tokens", "positions", "erows", "exp_new")}
        self.q = np.empty(r, dtype=np.int64)  # each request's new tokens (host only)
        self.np_groups = {name: tuple(x.numpy() for x in bufs) for name, bufs in self.groups.items()}
        self.book: torch.Tensor | None = None  # the token book's record the steps read (set by the first build)


class StepBuilder:
    """Builds each forward's steps for one protection's layer groups (see the module's doc)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._shape: _Shape | None = None

    def build(self, groups: dict[str, Any], book: TokenBook | None, batch: dict, reqs: list) -> dict[str, Step]:
        # the requests' lengths as Python ints first: right after an engine's forward each numpy or
        # torch call costs tens of microseconds (cold caches), a builtin on a short list a few
        q_list = [fs.query_length for fs in reqs]
        states = [fs.state for fs in reqs]
        upto_list = [st.position_offset for st in states]
        r = len(reqs)
        total = sum(q_list)
        width = max(1, max(upto_list))
        cap = -(-width // WIDTH_QUANTUM) * WIDTH_QUANTUM
        key = (id(groups), tuple(groups), r, total, cap, book is not None)
        if key != self._key or self._shape is None:
            narrow = all(g.canary.num_slots < 2**31 for g in groups.values())
            self._shape, self._key = _Shape(list(groups), r, total, cap, book is not None, narrow), key
        sh = self._shape
        n = sh.np
        q, past = sh.q, n["past"]
        q[:] = q_list
        past[:] = [u - n for u, n in zip(upto_list, q_list)]  # a builtin's loop: an in-place numpy op is dearer here
        if book is not None:
            rows = np.array(book.update(states, upto_list), dtype=np.int64)
            buf = book.buf.numpy()
            if sh.book is not book.buf:  # the book's record grew: the steps read the new one in place
                sh.book = book.buf
                for step in sh.steps.values():
                    step.expected_tokens = book.buf
        else:
            rows, buf = _EMPTY1, _EMPTY2
        fill_common(q, past, buf, rows, batch["cu_seq_lens_q"].numpy(), batch["input_ids"].numpy()[0],
                    batch["position_ids"].numpy()[0], n["cu"], n["tokens"], n["positions"], n["erows"], n["exp_new"])
        cu_k_all = batch["cu_seq_lens_k"]
        for name, g in groups.items():
            cu_k = cu_k_all[name] if isinstance(cu_k_all, dict) else cu_k_all
            table, starts, wslot = sh.np_groups[name]
            fill_group(batch["read_index"][g.index].numpy(), cu_k.numpy(), q, past,
                       batch["write_index"][g.index].numpy(), g.pages.block_stride, g.block_size, g.trash, table, starts,
                       wslot)
        return sh.steps
