"""The audit's records: the queries and writes of one forward, the per-layer plans of the sampled
queries, and where each forward's results go until they are drained. Host-side planning only
(numpy); the device tensors a torch check needs are made on first use."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcanary.audit.tables import (P_CACHED, P_HEAD, P_PICKED, P_POSITION, P_ROW, P_START, P_TOKEN, PLAN_COLUMNS,
                                   plan_row)


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
    starts: np.ndarray | Sequence[int]  # [rows + 1]: where each step row's new tokens start in the batch (host)
    cached: np.ndarray | Sequence[int]  # [rows]: each row's tokens cached before this forward (host)
    slots: dict[str | None, torch.Tensor]  # each group's slot of each batch token (device), -1: none
    queries: list[Query]
    err: torch.Tensor  # float32 [S]: each query's error, -1 where it did not run
    shift: torch.Tensor  # int64 [S]: the block shift that explains it (0: none)
    tol: torch.Tensor  # float32 [S]: each query's tolerance
    writes: list[Writes] = dataclasses.field(default_factory=list)


class LayerPlan:
    """One layer's audited queries, built on the host before the forward: ``qt`` int64 ``[S,
    PLAN_COLUMNS]`` (:mod:`kvcanary.audit.tables`: per query its index in the forward's list, step
    row, batch token, head, KV head, position, window start and the row's tokens cached). The
    torch path's device tensors are made on first use: ``grid`` ``[S, W]`` the positions each
    reads (clamped to its own), ``inside`` which of them it reads, ``old`` which were cached before
    this forward."""

    def __init__(self, qt: np.ndarray, dev: torch.device) -> None:
        self.qt, self.dev = qt, dev
        self._t: dict[str, torch.Tensor] | None = None

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._t is None:
            qt = self.qt
            pos, start, cached = qt[:, P_POSITION], qt[:, P_START], qt[:, P_CACHED]
            width = int((pos - start).max()) + 1
            grid = start[:, None] + np.arange(width)[None, :]
            names = ("picked", "row", "token", "head", "grid", "inside", "old")
            arrays = [qt[:, P_PICKED], qt[:, P_ROW], qt[:, P_TOKEN], qt[:, P_HEAD], np.minimum(grid, pos[:, None]), grid <= pos[:, None],
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
        by.setdefault(key(q), []).append(plan_row(i, q.row, q.token, q.head, q.position, w, q.cached))
    return {k: LayerPlan(np.array(v, dtype=np.int64).reshape(-1, PLAN_COLUMNS), dev) for k, v in by.items()}


def slot_of(fa: ForwardAudit, group: str | None, token: int) -> int:
    """The slot a batch token of ``fa`` wrote in ``group`` (-1: none known)."""
    slots = fa.slots.get(group)
    return int(slots[token]) if slots is not None and 0 <= token < slots.shape[0] else -1


