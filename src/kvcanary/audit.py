"""Audit the write and the read: what per-slot stamps cannot see.

A stamp says which token and position a slot holds and fingerprints the bytes found there after
the write. Two things escape it: a cache write that lands other bytes than the model computed
(zeros, the wrong head, nothing at all: the stamp fingerprints whatever landed), and an attention
kernel that reads or weighs the right bytes wrongly (its own page arithmetic, a head order or K/V
layout that disagrees with the writer's, a dequantization scale, a mask, a softmax scale). Engine
adapters run two checks inside each protected forward:

- **write check**: for each new token of a layer, the K and V rows the model computed (the
  inputs of the engine's cache-write op) are compared bit for bit with the rows the cache holds
  at the token's slot after the write (:func:`write_mismatch`). Every new token of every layer
  with ``content_budget_bytes=None``; within the budget otherwise, rotating over the tokens.
  A mismatch is a ``WRITE_CONTENT`` violation at site ``write``.
- **read audit**: for a few sampled queries per forward (``audit_queries``: a layer, a request's
  new token and an attention head, rotating so every layer, request and head comes round), the
  attention output is recomputed in fp32 from the cache bytes at the slots the verified table
  names, with the model's own scale, causal and sliding-window mask, attention sinks and logit
  soft-capping (:func:`attend`), and compared with the engine's output for that query. An error
  above :func:`tolerance` (as a fraction of the largest |V| the query reads) is an ``ATTENTION``
  violation at site ``audit``; where reading every block one page on or back explains the
  engine's output, the record says so.

Everything here is torch ops on the pool's device; nothing reads a device value on the host
until the adapter drains the results after the forward (:meth:`Auditor.drain`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcanary.violations import Check, Site, Violation

log = logging.getLogger("kvcanary")

# The largest accepted audit error (max |engine - reference| / max |V| read) by the dtype the engine
# computes attention in, as ``base + slope * m`` where ``m = sum_i p_i |s_i|`` is the query's
# probability-weighted mean |logit| (after the scale and soft-cap). A bf16 or fp16 kernel that rounds
# its logits to that dtype (transformers' eager kernels) errs in proportion to their size, one that
# keeps them in fp32 (sdpa on a CPU, vLLM's CPU kernels) does not; so the tolerance grows with the
# logits: 5 units in the last place (u = 2**-8 for bf16, 2**-11 for fp16) times (1 + m). fp32 is
# fixed. Calibration (bench/audit_calibration.py, results in bench/results/audit_calibration_*):
# over 1.76M clean queries of randomized continuous-batching runs (7 architectures, forks, windows,
# sinks, tight memory, offload; flat attention and softmax scales sharpened 100x and 300x to
# trained-model logit sizes) the largest clean error is 2.7e-5 in fp32 (37x under 1e-3) and
# 1.12 (bf16) / 1.15 (fp16) in units of u * (1 + m) (4.4x under 5); every injected kernel fault
# class of kvcanary.faults is caught in every dtype and regime with these.
TOLERANCE = {torch.float32: (1e-3, 0.0), torch.float16: (5 * 2.0**-11, 5 * 2.0**-11),
             torch.bfloat16: (5 * 2.0**-8, 5 * 2.0**-8)}
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the compiled loops' float codes
BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tolerance(dtype: torch.dtype, mean_logit: float = 0.0) -> float:
    """The audit's default tolerance for attention computed in ``dtype`` for a query whose
    probability-weighted mean |logit| is ``mean_logit`` (see :data:`TOLERANCE`)."""
    base, slope = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    return base + slope * mean_logit


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width: equal bits compare equal (NaNs included), -0.0 differs from 0.0."""
    return t.contiguous().view(BIT_VIEW[t.element_size()])


def write_mismatch(src_k: torch.Tensor, src_v: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compare computed K/V rows ``[n, Hkv, D]`` with the cache's rows at their slots ``[n, Hkv, D]``.

    Returns ``(half, head)``, int64 ``[n]``: which half differs (0 none, 1 K, 2 V, 3 both) and the
    first KV head that differs. The computed rows are cast to the cache's dtype first, as the
    engine's write does; the comparison is bitwise.
    """
    kb = (_bits(cache_k) != _bits(src_k.to(cache_k.dtype))).flatten(2).any(-1)  # [n, Hkv]
    vb = (_bits(cache_v) != _bits(src_v.to(cache_v.dtype))).flatten(2).any(-1)
    half = kb.any(-1).long() + 2 * vb.any(-1).long()
    head = (kb | vb).long().argmax(-1)
    return half, head


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
           softcap: float | None = None, sink: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 attention of ``S`` single queries over their own keys.

    ``q`` ``[S, D]``; ``k``, ``v`` ``[S, L, D]``; ``valid`` bool ``[S, L]`` (the positions each query
    reads); ``softcap``: logits become ``cap * tanh(logit / cap)``; ``sink`` ``[S]``: a learned logit
    per query's head that joins the softmax and adds no value. Returns the outputs ``[S, D]``, the
    largest |V| each query reads ``[S]`` and its probability-weighted mean |logit| ``[S]``.
    """
    qf, kf, vf = q.float(), k.float(), v.float()
    logits = torch.einsum("sd,sld->sl", qf, kf) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~valid, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.float()[:, None]], dim=1)
    p = torch.softmax(logits, dim=1)[:, : kf.shape[1]]
    out = torch.einsum("sl,sld->sd", p, vf)
    vmax = vf.abs().amax(-1).masked_fill(~valid, 0).amax(-1)
    mean = (p * logits[:, : kf.shape[1]].abs().masked_fill(~valid, 0)).sum(-1)
    return out, vmax, mean


def error(engine_out: torch.Tensor, ref: torch.Tensor, vmax: torch.Tensor) -> torch.Tensor:
    """Each query's largest deviation from the reference as a fraction of the largest |V| it read
    (a NaN or infinite engine output counts as an error of 1e6)."""
    e = (engine_out.float() - ref).abs().amax(-1) / vmax.clamp(min=1e-30)
    return torch.nan_to_num(e, nan=1e6, posinf=1e6)


@dataclasses.dataclass(frozen=True)
class Query:
    """One audited query (host side): the layer, the step row and the token's index in the batch,
    the attention head, its position, and how many of the row's tokens were cached before this
    forward."""

    layer: int
    row: int
    token: int
    head: int
    position: int
    cached: int
    group: str | None = None


@dataclasses.dataclass
class Writes:
    """The write check of some layers in one forward: the checked tokens and what differed."""

    layers: Sequence[int]
    groups: Sequence[str | None]  # each layer's group
    tokens: Sequence[int] | np.ndarray  # the tokens' indices in the batch (host)
    half: torch.Tensor | np.ndarray  # int64 [layers, n]: 0, or which half differs (1 K, 2 V, 3 both)
    head: torch.Tensor | np.ndarray  # int64 [layers, n]: the first KV head that differs


@dataclasses.dataclass
class ForwardAudit:
    """The write checks and audited queries of one forward, until they are drained."""

    step: int
    starts: np.ndarray  # int64 [rows + 1]: where each step row's new tokens start in the batch (host)
    cached: np.ndarray  # int64 [rows]: each row's tokens cached before this forward (host)
    slots: dict[str | None, torch.Tensor]  # each group's slot of each batch token (device), -1: none
    queries: list[Query]
    err: torch.Tensor  # float32 [S]: each query's error, -1 where it did not run
    shift: torch.Tensor  # int64 [S]: the block shift that explains it (0: none)
    tol: torch.Tensor  # float32 [S]: each query's tolerance
    writes: list[Writes] = dataclasses.field(default_factory=list)


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
        self.pending: list[ForwardAudit] = []
        self.counts = {"audit_queries": 0, "write_slots_checked": 0, "write_bytes_checked": 0}
        self.errors: list[float] | None = None  # every audited query's error, where recorded (calibration)
        self.ratios: list[float] = []  # and its error over its tolerance
        self.failures = 0  # forwards whose audit failed (an internal error, counted)

    def pick(self, layers: Sequence[int], lengths: Sequence[int], heads: int) -> list[tuple[int, int, int, int]]:
        """This forward's sampled queries as ``(layer, row, token offset in the row, head)``: the
        rotation walks layers fastest, then rows, then heads, so every combination comes round.
        ``lengths``: each row's new tokens (rows without any are skipped)."""
        rows = [r for r, n in enumerate(lengths) if n > 0]
        if not rows or not layers or self.queries <= 0:
            return []
        out = []
        for _ in range(self.queries):
            c = self.turn
            self.turn += 1
            layer = layers[c % len(layers)]
            r = rows[(c // len(layers)) % len(rows)]
            head = (c // len(layers) // len(rows) + c) % heads
            out.append((layer, r, (c // len(layers)) % lengths[r], head))
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
                    slot = _slot(fa, q.group, q.token)
                    found.append(Violation(Site.AUDIT, Check.ATTENTION, fa.step, q.row, slot, q.position, q.head, -1,
                                           int(s), int(t * 1e6), int(min(e, 1e12) * 1e6), 0, 0, q.layer,
                                           group=q.group))
        return found

    def _writes(self, fa: ForwardAudit) -> list[Violation]:
        out = []
        for w in fa.writes:
            half = w.half.cpu().numpy() if isinstance(w.half, torch.Tensor) else w.half
            if not half.any():
                continue
            heads = w.head.cpu().numpy() if isinstance(w.head, torch.Tensor) else w.head
            for li, i in zip(*np.nonzero(half)):
                t, layer, group = w.tokens[i], w.layers[li], w.groups[li]
                row = int(np.searchsorted(fa.starts, t, side="right")) - 1
                out.append(Violation(Site.WRITE, Check.WRITE_CONTENT, fa.step, row, _slot(fa, group, t),
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


class LayerPlan:
    """One layer's audited queries, built on the host before the forward: ``qt`` int64 ``[S, 8]``,
    per query its index in the forward's list, step row, batch token, head, KV head (filled in by
    the adapter), position, window start and the row's tokens cached before this forward. The
    torch path's device tensors are made on first use: ``grid`` ``[S, W]`` the positions each
    reads (clamped to its own), ``inside`` which of them it reads, ``old`` which were cached before
    this forward."""

    def __init__(self, qt: np.ndarray, dev: torch.device) -> None:
        self.qt, self.dev = qt, dev
        self._t: dict[str, torch.Tensor] | None = None

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._t is None:
            qt = self.qt
            pos, start, cached = qt[:, 5], qt[:, 6], qt[:, 7]
            width = int((pos - start).max()) + 1
            grid = start[:, None] + np.arange(width)[None, :]
            names = ("picked", "row", "token", "head", "grid", "inside", "old")
            arrays = [qt[:, 0], qt[:, 1], qt[:, 2], qt[:, 3], np.minimum(grid, pos[:, None]), grid <= pos[:, None],
                      grid < cached[:, None]]
            self._t = dict(zip(names, to_device(self.dev, arrays)))
        return self._t

    picked = property(lambda self: self._tensors()["picked"])
    token = property(lambda self: self._tensors()["token"])
    head = property(lambda self: self._tensors()["head"])
    row = property(lambda self: self._tensors()["row"])
    grid = property(lambda self: self._tensors()["grid"])
    inside = property(lambda self: self._tensors()["inside"])
    old = property(lambda self: self._tensors()["old"])


def to_device(dev: torch.device, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Host arrays as tensors on ``dev``: through pinned memory and without waiting, on an accelerator."""
    out = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if dev.type == "cpu":
        return out
    return [t.pin_memory().to(dev, non_blocking=True) for t in out]


def plan_layers(queries: Sequence[Query], windows: dict[Any, int | None], dev: torch.device,
                key: Callable[[Query], Any] = lambda q: q.layer) -> dict[Any, LayerPlan]:
    """The forward's audited queries by layer (``key``: a query's layer key); ``windows``: each
    layer's sliding window (a query at ``p`` reads ``[p - window + 1, p]``), ``None`` for full
    attention."""
    by: dict[Any, list[list[int]]] = {}
    for i, q in enumerate(queries):
        w = windows.get(key(q))
        by.setdefault(key(q), []).append([i, q.row, q.token, q.head, 0, q.position,
                                          max(q.position - w + 1, 0) if w else 0, q.cached])
    return {k: LayerPlan(np.array(v, dtype=np.int64), dev) for k, v in by.items()}


def check_layer(fa: ForwardAudit, plan: LayerPlan, slots: torch.Tensor, q: torch.Tensor, engine_out: torch.Tensor,
                read: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                softcap: float | None, sink: torch.Tensor | None, tol: tuple[float, float]) -> None:
    """Audit one layer's queries of ``fa``: ``slots`` ``[S, W]`` the verified table's slots of
    ``plan.grid`` (-1: none); ``q`` and ``engine_out`` ``[S, D]`` the queries and the engine's outputs;
    ``read(slots, shift)`` the cache's K and V ``[S, W, D]`` at those slots, with the positions cached
    before this forward read ``shift`` blocks on; ``tol``: the tolerance's base and slope
    (:data:`TOLERANCE`). Fills the queries' errors and tolerances in ``fa`` (device ops only). A query
    that reads a position the cache does not hold (a prefill's own tokens past a window) is not
    audited."""
    complete = (slots >= 0).logical_or(~plan.inside).all(1)
    valid = plan.inside & (slots >= 0)
    errs, limits = [], []
    for shift in (0, 1, -1):  # as read, then every cached block one page on / back
        k, v = read(slots, shift)
        ref, vmax, mean = attend(q, k, v, valid, scale, softcap, sink)
        errs.append(error(engine_out, ref, vmax))
        limits.append(tol[0] + tol[1] * mean)
    e, limit = errs[0], limits[0]  # the tolerance of the query as read
    explained = torch.where(errs[1] <= limit, 1, torch.where(errs[2] <= limit, -1, 0))
    fa.err[plan.picked] = torch.where(complete, e, -1.0).to(fa.err.dtype)
    fa.shift[plan.picked] = torch.where(e > limit, explained, 0).to(fa.shift.dtype)
    fa.tol[plan.picked] = limit.to(fa.tol.dtype)


def _slot(fa: ForwardAudit, group: str | None, token: int) -> int:
    slots = fa.slots.get(group)
    return int(slots[token]) if slots is not None and 0 <= token < slots.shape[0] else -1


# descriptors of the compiled CPU loops (kvcanary.fused.audit): byte addresses and byte strides

def rows_desc(t: torch.Tensor, tok: int, head: int, dim: int) -> list[int]:
    """The descriptor of a row tensor whose dimensions ``tok``, ``head`` and ``dim`` index a token, a
    head and a channel."""
    es = t.element_size()
    st = t.stride()
    return [t.data_ptr(), st[tok] * es, st[head] * es, st[dim] * es]


def cache_desc(base: int, block: int, block_stride: int, token_stride: int, head_stride: int,
               dim_stride: int) -> list[int]:
    return [base, block, block_stride, token_stride, head_stride, dim_stride]
