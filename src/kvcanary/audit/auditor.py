"""The audit's state in one engine adapter: the rotation of sampled queries across layers, rows and
heads, the forwards not yet drained, the counts, and the decoding of results into violations."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from kvcanary.audit.records import ForwardAudit, slot_of
from kvcanary.audit.reference import TOLERANCE
from kvcanary.violations import Check, Site, Violation

log = logging.getLogger("kvcanary")


class Auditor:
    """The audit's state in one engine adapter: the rotation of sampled queries, the forwards not
    yet drained and the counts.

    Parameters
    ----------
    queries : audited queries per forward (``CanaryConfig.audit_queries``)
    tolerance : a fixed tolerance, or ``None`` for :func:`tolerance` of each query's dtype
    """

    def __init__(self, queries: int, tolerance: float | None) -> None:
        self.queries = queries
        self.fixed_tolerance = tolerance
        self.turn = 0  # rotation counter: one per sampled query
        self.focus_turn = 0  # and one per query of a request in a new situation
        self.pending: list[ForwardAudit] = []
        self.counts = {"audit_queries": 0, "write_slots_checked": 0, "write_bytes_checked": 0,
                       "write_slots_unchecked": 0}
        self.errors: list[float] | None = None  # every audited query's error, where recorded (calibration)
        self.ratios: list[float] = []  # and its error over its tolerance
        self.failures = 0  # forwards whose audit failed (an internal error, counted)

    def pick(self, layers: Sequence[int], lengths: Sequence[int], heads: int, count: int | None = None,
             focus: Sequence[int] = (), per_focus: int = 0) -> list[tuple[int, int, int, int]]:
        """This forward's sampled queries as ``(layer, row, token offset in the row, head)``: ``count``
        (default: ``queries``) from the rotation, then ``per_focus`` on each row of ``focus``, on its
        newest token, rotating over layers and heads. ``lengths``: each row's new tokens (rows
        without any are skipped).

        The rotation walks the layers fastest; pass ``k`` over them takes row ``k % R`` and head
        ``(k % R + k // R) % H`` (each block of ``R`` passes shifts the rows' heads by one): every
        (layer, row) pair comes round within ``R * L`` queries, every (layer, row, head) triple
        within ``R * H * L``, and every (layer, head) pair within ``H * L`` where the batch has at
        least ``H`` rows (else ``(H - R + 1) * R * L``)."""
        rows = [r for r, n in enumerate(lengths) if n > 0]
        if not rows or not layers or self.queries <= 0:
            return []
        out = []
        for _ in range(self.queries if count is None else count):
            c = self.turn
            self.turn += 1
            k = c // len(layers)
            i = k % len(rows)
            r = rows[i]
            out.append((layers[c % len(layers)], r, k % lengths[r], (i + k // len(rows)) % heads))
        for r in focus:
            if lengths[r] <= 0:
                continue
            for _ in range(per_focus):
                c = self.focus_turn
                self.focus_turn += 1
                out.append((layers[c % len(layers)], r, lengths[r] - 1, (c // len(layers) + c) % heads))
        return out

    def begin(self, fa: ForwardAudit) -> ForwardAudit:
        self.pending.append(fa)
        self.counts["audit_queries"] += len(fa.queries)
        return fa

    def tolerance_for(self, dtype: torch.dtype) -> tuple[float, float]:
        """The tolerance's base and slope (:data:`TOLERANCE`) for attention computed in ``dtype``."""
        if self.fixed_tolerance is not None:
            return float(self.fixed_tolerance), 0.0
        return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])

    def drain(self) -> list[Violation]:
        """Decode every pending forward's results (reads them on the host): the violations found."""
        found: list[Violation] = []
        pending, self.pending = self.pending, []
        for fa in pending:
            found += self._writes(fa)
            if not fa.queries:
                continue
            err, shift, tol = fa.err.tolist(), fa.shift.tolist(), fa.tol.tolist()
            if self.errors is not None:
                self.errors += [e for e in err if e >= 0]
                self.ratios += [e / t for e, t in zip(err, tol) if e >= 0 and t > 0]
            for q, e, s, t in zip(fa.queries, err, shift, tol):
                if e > t:
                    slot = slot_of(fa, q.group, q.token)
                    found.append(Violation(Site.AUDIT, Check.ATTENTION, fa.step, q.row, slot, q.position, q.head, -1,
                                           int(s), int(t * 1e6), int(min(e, 1e12) * 1e6), 0, 0, q.layer,
                                           group=q.group))
        return found

    def _writes(self, fa: ForwardAudit) -> list[Violation]:
        out = []
        for w in fa.writes:
            half = w.half.cpu().numpy() if isinstance(w.half, torch.Tensor) else w.half
            if not np.count_nonzero(half):  # (a third of ndarray.any's time, every forward)
                continue
            heads = w.head.cpu().numpy() if isinstance(w.head, torch.Tensor) else w.head
            for li, i in zip(*np.nonzero(half)):
                t, layer, group = w.tokens[i], w.layers[li], w.groups[li]
                row = int(np.searchsorted(fa.starts, t, side="right")) - 1
                out.append(Violation(Site.WRITE, Check.WRITE_CONTENT, fa.step, row, slot_of(fa, group, t),
                                     int(fa.cached[row] + t - fa.starts[row]), int(heads[li, i]), int(half[li, i]), -1,
                                     0, 0, 0, 0, layer,
                                     group=group))
        return out

    def stats(self) -> dict[str, int]:
        return dict(self.counts)

    def failed(self, adapter: Any, e: Exception) -> None:
        """The audit's own failure inside a forward of ``adapter``'s engine (the forward's audit is
        dropped by the caller; no stamp depends on it): counted and logged outside ``raise`` mode,
        raised in it (and kept for the caller's thread)."""
        if adapter.config.mode == "raise":
            adapter.pending = e
            raise e
        self.failures += 1
        adapter.internal_errors += 1
        log.error("kvcanary internal error in the attention audit (counted, not raised)",
                  exc_info=e if self.failures <= 3 else None)


