"""How many queries each forward's read audit recomputes: what the canary's share of the run leaves
after its other checks, with more where something is new.

On a forward in a known situation the count follows the time budget (``CanaryConfig.audit_budget``,
the share of the run's wall time the whole canary may take): after each forward the canary's
measured seconds since the last one (the first forward: since the canary started, a new pool's setup
too; every check, the write check and the audit's queries among
them) are set against the wall time since then and kept as a balance (what the canary spent over or
under its share, saved up to one forward's share, owed up to ten), and the next forward audits as
many queries as its share and the balance pay for, after the canary's other work of the last
forward, at the measured seconds per query (at most doubling per forward, never above
``CanaryConfig.audit_queries``). The full counts of new situations are paid back by smaller counts
after them, so over a run the canary keeps to its share wherever its other checks fit in it. Where
they do not, or where they leave less than one query's time, a known-situation forward audits no
query, and one forward in each run of :data:`AUDIT_ROUNDS` such forwards audits one, at a place in
the run drawn anew for each run (the audit's cadence; the forwards without are counted as
``audit_forwards_without_queries``): audited forwards are at most ``2 * AUDIT_ROUNDS - 1`` apart,
and a brief fault that strikes periodically lands on one, whatever its period (a fixed cadence
would never meet a fault whose strikes keep to the forwards between its audits). A faulty kernel path taken for the first
time is where a brief fault lives, so a forward in a new situation audits the full ``audit_queries``:

- the first :data:`WARM` audited forwards after start;
- a forward whose situation key changed: the cache's dtype or pool (a new geometry), and the batch's
  shape class (decode-only or with prefill, and the number of rows to the next power of two, the
  classes attention kernels dispatch on).

Requests in a new situation of their own get :data:`FOCUS` queries of their own on their newest token,
on top of the count (rotating over layers and heads): a request's first forward that reads a prefix
it did not write (a prefix-cache hit), and its first decode.

The write check follows the same budget over layers: every layer's writes are checked where the
query count is the full ``audit_queries`` (a new situation, the warm-up, no time budget, or a budget
with room for it); else the share of the layers that the count is of the full count, rotating over
them, and never fewer than every layer once in :data:`WRITE_ROUNDS` forwards
(:meth:`QueryBudget.write_layers`); a forward without queries checks that fewest share. A layer whose
writes are not checked in a forward still gets its new tokens' content fingerprints, from the K and
V the layer computed (where the engine adapter folds them inside the layer), so a wrong write there
is found by the content verify and the patrol. An adapter that does not fold inside the layers
(transformers) checks every layer's writes on every forward, queries or none.

Coverage bound: with ``n`` queries a forward over ``L`` audited layers, ``R`` rows with new
tokens and ``H`` heads, the rotation (:meth:`kvcanary.audit.auditor.Auditor.pick`) audits every
(layer, row) pair of a steady batch within ``ceil(L * R / n)`` audited forwards, every (layer, row,
head) triple within ``ceil(L * R * H / n)``, and every (layer, head) pair within ``ceil(L * H / n)``
where the batch has at least ``H`` rows; at the cadence's least (one query in each run of
:data:`AUDIT_ROUNDS` forwards) each audited forward stands for ``AUDIT_ROUNDS`` forwards, and a fault
that changes every query of the forwards it strikes is found on each strike with a chance of one in
``AUDIT_ROUNDS``.
"""

from __future__ import annotations

import random
from typing import Hashable

WARM = 8  # audited forwards after start that audit the full count
FOCUS = 4  # queries of a request's own in its first decode and its first forward after a prefix hit
WRITE_ROUNDS = 8  # in a known situation, each layer's writes are checked at least once in this many forwards
AUDIT_ROUNDS = 8  # in a known situation, one query is audited in each run of this many forwards without
GROWTH = 2.0  # the most the count grows from one forward to the next
_SMOOTH = 0.25  # the weight of the newest forward in the measured seconds per query


class QueryBudget:
    """The count of audited queries per forward.

    Parameters
    ----------
    queries : the most a forward audits, and what a forward in a new situation audits
    share : the share of the run's wall time the canary may take, its audit included (``None``: always
        ``queries``)
    """

    def __init__(self, queries: int, share: float | None) -> None:
        self.queries, self.share = queries, share
        self.audited = 0  # forwards planned so far
        self.count = queries if share is None else min(1, queries)  # the next known-situation forward's count
        self.per_query: float | None = None  # the audit's measured seconds per query (smoothed)
        self.balance = 0.0  # seconds the canary spent under (+) or over (-) its share so far, bounded
        self.situation: Hashable = None
        self.new = 0  # forwards audited at the full count because their situation was new
        self.fresh = True  # the last planned forward audits the full count (warm-up or a new situation)
        self.write_turn = 0  # the rotation over layers of the write check (write_layers)
        self.idle = 0  # the place in the current run of forwards the budget leaves without a query
        self._draw = random.Random(0)  # the place in each run that audits one query (seeded: runs repeat)
        self.slot = self._draw.randrange(AUDIT_ROUNDS)
        self.without = 0  # forwards planned without a query (the budget left none)

    def plan(self, situation: Hashable) -> int:
        """This forward's count: the full count where ``situation`` differs from the last forward's or
        within the first :data:`WARM` forwards, else the count the time budget allows (0: none; one at
        the drawn place of each run of :data:`AUDIT_ROUNDS` forwards it leaves without)."""
        fresh = self.audited < WARM or situation != self.situation
        self.situation = situation
        self.audited += 1
        self.fresh = fresh
        n = self.queries if fresh or self.share is None else self.count
        self.new += int(fresh and self.share is not None)
        if n > 0 or self.queries <= 0:  # (no read audit at all: no cadence either)
            # a run of forwards without queries starts afresh after a forward with them
            if self.idle:
                self.idle, self.slot = 0, self._draw.randrange(AUDIT_ROUNDS)
            return n
        if self.idle == self.slot:
            n = 1
        else:
            self.without += 1
        self.idle += 1
        if self.idle == AUDIT_ROUNDS:
            self.idle, self.slot = 0, self._draw.randrange(AUDIT_ROUNDS)
        return n

    def write_layers(self, layers: int) -> tuple[int, int]:
        """The forward just planned (:meth:`plan`): its write-checked layers as ``(first, count)`` over
        ``layers`` positions, the positions ``first`` to ``first + count - 1`` modulo ``layers``: all of
        them where the forward audits the full count, else ``layers`` times the count's share of the
        full count, at least ``ceil(layers / WRITE_ROUNDS)``, rotating from the last forward's."""
        if layers <= 0:
            return 0, 0
        if self.share is None or self.fresh or self.count >= self.queries:
            return 0, layers
        n = min(layers, max(-(-layers // WRITE_ROUNDS), -(-layers * self.count // self.queries)))
        first = self.write_turn % layers
        self.write_turn = first + n
        return first, n

    def observe(self, queries: int, audit_s: float, forward_s: float, canary_s: float | None = None) -> None:
        """After a forward that audited ``queries`` in ``audit_s`` seconds of the audit's own, over
        ``forward_s`` seconds of wall time in which the canary took ``canary_s`` seconds in all (the
        audit's among them; ``None``: the audit's only): the next known-situation forward's count,
        0 where the share and the balance do not pay for one query after the canary's other work
        (a forward without queries: all of its seconds are the other work)."""
        if self.share is None or forward_s <= 0 or audit_s < 0:
            return
        spent = audit_s if canary_s is None else max(canary_s, audit_s)
        if queries > 0:
            per = audit_s / queries
            self.per_query = per if self.per_query is None else (1 - _SMOOTH) * self.per_query + _SMOOTH * per
        allowed = self.share * forward_s
        self.balance = min(max(self.balance + allowed - spent, -10 * allowed), allowed)
        if self.per_query is None:
            return
        other = spent - audit_s if queries > 0 else spent
        fits = (allowed + self.balance - other) / max(self.per_query, 1e-9)
        self.count = int(max(0, min(self.queries, fits, GROWTH * max(self.count, 1))))

    def stats(self) -> dict[str, int]:
        return {"audit_queries_per_forward": self.count, "audit_forwards_new_situation": self.new,
                "audit_forwards_without_queries": self.without}


def shape_class(rows: int, prefill: bool) -> tuple[bool, int]:
    """A batch's shape class: whether it holds prefill tokens, and its rows to the next power of two."""
    return prefill, 1 << max(0, rows - 1).bit_length()
