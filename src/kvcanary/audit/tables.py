"""The audit's tables, their columns named, built here and nowhere else: each layer's plan of
sampled queries (the host's), and the compiled loop's tables (:func:`kvcanary.fused.audit.check_forward`).

Every table is an int64 (or float64) numpy array; a column is read by its name below, in Python
and in the compiled loop alike (numba inlines these module constants).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

# a layer's plan (:class:`kvcanary.audit.records.LayerPlan`), one row per audited query: its index in
# the forward's list, step row, batch token, head, KV head, position, window start, and the row's
# tokens cached before this forward
P_PICKED, P_ROW, P_TOKEN, P_HEAD, P_KV_HEAD, P_POSITION, P_START, P_CACHED = range(8)
PLAN_COLUMNS = 8

# the compiled loop's queries: as a plan's, with the query's layer (its row of the layer table), its
# sink logit's index in the floats (-1: none) and its index among its layer's queries (the row of
# that layer's query and output tensors where they hold the sampled rows only)
Q_PICKED, Q_LAYER, Q_ROW, Q_TOKEN, Q_HEAD, Q_KV_HEAD, Q_POSITION, Q_START, Q_CACHED, Q_SINK, Q_LOCAL = range(11)
QUERY_COLUMNS = 11

# the compiled loop's layers: the cache's K and V descriptors (address, block size, block stride,
# token stride, head stride, dim stride, tile, tile stride, strip, strip stride:
# :meth:`kvcanary.geometry.base.KvGeometry.descriptors`), the row of its step in the step table, the
# cache's float code, its element size, KV heads, head size, largest slot, and the float code of the
# layer's queries and outputs
D_ADDR, D_BLOCK, D_BLOCK_STRIDE, D_TOKEN_STRIDE, D_HEAD_STRIDE, D_DIM_STRIDE, D_TILE, D_TILE_STRIDE, D_STRIP, \
    D_STRIP_STRIDE = range(10)
DESCRIPTOR_COLUMNS = 10
L_K, L_V = 0, DESCRIPTOR_COLUMNS  # descriptors: L_K + D_*, L_V + D_*
L_STEP, L_CODE, L_ESIZE, L_HEADS, L_DIM, L_MAX_SLOT, L_QCODE = range(2 * DESCRIPTOR_COLUMNS, 2 * DESCRIPTOR_COLUMNS + 7)
LAYER_COLUMNS = 2 * DESCRIPTOR_COLUMNS + 7

# each layer's floats, FLOATS_PER_LAYER apart (the sinks' logits follow them)
F_SCALE, F_SOFTCAP, F_TOL_BASE, F_TOL_SLOPE = range(4)
FLOATS_PER_LAYER = 4

# the layers' tensor addresses (0: not checked this call) and the tensors' byte strides
PTR_K, PTR_V, PTR_Q, PTR_O = range(4)
S_K, S_V, S_Q, S_O = 0, 3, 6, 9  # each: token, head and dim strides
STRIDE_COLUMNS = 12


def plan_row(picked: int, row: int, token: int, head: int, position: int, window: int | None,
             cached: int) -> list[int]:
    """One query's row of a layer plan (its KV head filled in by the engine's adapter)."""
    return [picked, row, token, head, 0, position, max(position - window + 1, 0) if window else 0, cached]


def layer_row(k: Sequence[int], v: Sequence[int], step: int, code: int, esize: int, heads: int, dim: int,
              max_slot: int, query_code: int) -> list[int]:
    """One layer's row of the layer table (``k``, ``v``: descriptors of :data:`DESCRIPTOR_COLUMNS`)."""
    for half, d in (("K", k), ("V", v)):
        if len(d) != DESCRIPTOR_COLUMNS or d[D_BLOCK] < 1 or d[D_TILE] < 1 or d[D_STRIP] < 1 or dim % d[D_STRIP]:
            raise ValueError(f"layer_row: expected a {half} descriptor of {DESCRIPTOR_COLUMNS} columns with a block, "
                             f"tile and strip of at least 1 and a strip dividing the head size {dim}, got {list(d)}")
    return [*k, *v, step, code, esize, heads, dim, max_slot, query_code]


def query_table(queries: Sequence[Any], layer_of: Callable[[Any], int], group_size: Callable[[Any], int],
                window_of: Callable[[Any], int | None], sink_of: Callable[[Any], float | None],
                first_sink: int, picked: Sequence[int] | None = None) -> tuple[np.ndarray, list[float]]:
    """The compiled loop's query table of ``queries`` (:class:`kvcanary.audit.records.Query`) and
    their sinks' logits, to be placed in the floats from index ``first_sink`` on. ``layer_of``: a
    query's row of the layer table; ``group_size``: its layer's query heads per KV head;
    ``window_of``: its layer's sliding window (``None``: full attention); ``sink_of``: its head's
    sink logit (``None``: none); ``picked``: each query's index in the forward's list (default:
    its index in ``queries``)."""
    rows: list[list[int]] = []
    sinks: list[float] = []
    local: dict[int, int] = {}
    for i, q in enumerate(queries):
        li = layer_of(q)
        local[li] = local.get(li, -1) + 1
        sink = sink_of(q)
        si = -1
        if sink is not None:
            si = first_sink + len(sinks)
            sinks.append(sink)
        k = i if picked is None else picked[i]
        p = plan_row(k, q.row, q.token, q.head, q.position, window_of(q), q.cached)
        rows.append([k, li, q.row, q.token, q.head, q.head // group_size(q), q.position, p[P_START], q.cached, si,
                     local[li]])
    return np.array(rows, dtype=np.int64).reshape(-1, QUERY_COLUMNS), sinks


def floats(per_layer: Sequence[tuple[float, float, float, float]], sinks: Sequence[float] = ()) -> np.ndarray:
    """The float table: each layer's scale, soft-cap (0: none) and tolerance base and slope, then
    the sinks' logits."""
    out = np.empty(FLOATS_PER_LAYER * len(per_layer) + len(sinks), dtype=np.float64)
    out[: FLOATS_PER_LAYER * len(per_layer)] = np.asarray(per_layer, dtype=np.float64).reshape(-1)
    out[FLOATS_PER_LAYER * len(per_layer):] = sinks
    return out


def strides(t: Any, tok: int, head: int, dim: int) -> list[int]:
    """A tensor's byte strides along its token, head and dim axes."""
    es = t.element_size()
    st = t.stride()
    return [st[tok] * es, st[head] * es, st[dim] * es]
