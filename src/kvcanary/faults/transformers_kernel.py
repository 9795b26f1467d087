"""Attention-kernel and cache-write faults, injected into a running transformers continuous-batching
engine: the classes per-slot stamps cannot see, which the write check and the read audit
(:mod:`kvcanary.audit`) exist for.

Each injector installs a tap around one layer's cache update or attention (see
:class:`kvcanary.engines.transformers.audit.CbAudit`); from the forward it is installed in, the
tap misbehaves on every forward, as a kernel bug does. The block tables, the stamps and every
byte the canary fingerprints stay right: only what the kernel writes or computes is wrong.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def _layer(prot: Any, sliding: bool = False) -> tuple[Any, int] | None:
    """A layer group (full attention, or a window group with ``sliding``) and its first layer."""
    for g in prot.groups.values():
        if g.allocator.__class__.__name__.startswith("Sliding") == sliding:
            return g, int(g.allocator.layer_indices[0])
    return None


def _row_of(prot: Any, rid: str) -> int | None:
    rids = prot.rows.get(prot.forwards, [])
    return rids.index(rid) if rid in rids else None


def _victim(prot: Any, runner: Any, g: Any, need: int, next_page: bool = False) -> str | None:
    """A request of this forward with at least ``need`` cached tokens in group ``g`` (and, with
    ``next_page``, whose every block has a next page inside the pool)."""
    from kvcanary.engines.transformers.hooks import host_io

    last = g.block_of(g.canary.num_slots - 1)
    for fs in host_io(runner.inputs_and_outputs).requests_in_batch:
        rid = str(fs.state.request_id)
        if fs.state.position_offset - fs.query_length >= need and (
                not next_page or max(g.allocator.block_table.get(rid, [last]), default=last) < last):
            return rid
    return None


def _cached_columns(kwargs: dict, row: int) -> tuple[int, int, int, int]:
    """Row ``row``'s key columns ``[k0, k0 + cached)`` of cached reads and query rows ``[q0, q1)``."""
    cu_k, cu_q = kwargs["cu_seq_lens_k"], kwargs["cu_seq_lens_q"]
    k0, k1 = int(cu_k[row]), int(cu_k[row + 1])
    q0, q1 = int(cu_q[row]), int(cu_q[row + 1])
    return k0, (k1 - k0) - (q1 - q0), q0, q1


def read_next_page(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The kernel computes one request's page addresses one page too far: each of its cached
    blocks is read from the next page of the pool (the table and the stamps are right)."""
    picked = _layer(prot)
    if picked is None or not batch["read_index"][picked[0].index].numel():
        return False
    g, layer = picked
    # a request none of whose blocks is the pool's last, else any (a prefix shared by every request can
    # sit in the last block: its page one on is clamped to the pool's last slot, as the audit reads it)
    rid = _victim(prot, runner, g, g.block_size, next_page=True) or _victim(prot, runner, g, g.block_size)
    if rid is None:
        return False
    geom = g.pages.layer(layer)

    def tap(original: Any, cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict) -> Any:
        k, v = original(cache, key, value, layer_idx, kwargs)
        row = _row_of(prot, rid)
        read = kwargs["read_index"][g.index] if "read_index" in kwargs else None
        if layer_idx != layer or row is None or read is None or not read.numel():
            return k, v
        k0, cached, _, _ = _cached_columns(kwargs, row)
        if cached > 0:
            wrong = (g.compact(read[k0 : k0 + cached]) + g.block_size).clamp(max=geom.num_slots - 1)  # a page on
            k, v = k.clone(), v.clone()
            k[0, :, k0 : k0 + cached] = geom.k_rows(wrong).transpose(0, 1)
            v[0, :, k0 : k0 + cached] = geom.v_rows(wrong).transpose(0, 1)
        return k, v

    prot.audit.taps["update"] = tap
    detail.update(request=rid, layer=layer)
    return True


def ignore_prefix(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The kernel attends to one request's new tokens only, as if nothing were cached."""
    picked = _layer(prot)
    if picked is None:
        return False
    g, layer = picked
    rid = _victim(prot, runner, g, 1)
    if rid is None:
        return False

    def tap(original: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, *a: Any, **kw: Any) -> Any:
        row = _row_of(prot, rid)
        if int(module.layer_idx) == layer and row is not None and mask is not None:
            k0, cached, q0, q1 = _cached_columns(kw, row)
            if cached > 0:
                mask = mask.clone()
                mask[..., q0:q1, k0 : k0 + cached] = torch.finfo(mask.dtype).min
        return original(module, query, key, value, mask, *a, **kw)

    prot.audit.taps["attention"] = tap
    detail.update(request=rid, layer=layer)
    return True


def _reader_tap(prot: Any, layer: int, change: Any) -> None:
    def tap(original: Any, cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict) -> Any:
        k, v = original(cache, key, value, layer_idx, kwargs)
        return change(k, v) if layer_idx == layer else (k, v)

    prot.audit.taps["update"] = tap


def heads_reversed(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Writer and reader disagree on the head order: the reader takes the KV heads reversed."""
    picked = _layer(prot)
    if picked is None:
        return False
    _reader_tap(prot, picked[1], lambda k, v: (k.flip(1), v.flip(1)))
    detail.update(layer=picked[1])
    return True


def v_rescaled(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """V is read back with another scale than it was written with (a dequantization scale reset,
    shared or missing): the reader's V is 1.5 times the written one."""
    picked = _layer(prot)
    if picked is None:
        return False
    _reader_tap(prot, picked[1], lambda k, v: (k, v * 1.5))
    detail.update(layer=picked[1], scale=1.5)
    return True


def write_zeros(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The cache write of one layer lands zeros instead of the computed K and V."""
    picked = _layer(prot)
    if picked is None:
        return False
    g, layer = picked
    geom = g.pages.layer(layer)

    def tap(original: Any, cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict) -> Any:
        out = original(cache, key, value, layer_idx, kwargs)
        if layer_idx == layer and "write_index" in kwargs:
            write = kwargs["write_index"][g.index].long()
            slots = g.compact(write[write != g.trash])
            geom.set_rows("k", slots, 0)
            geom.set_rows("v", slots, 0)
        return out

    prot.audit.taps["update"] = tap
    detail.update(layer=layer)
    return True


def window_one_short(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The sliding-window mask is off by one: each query's oldest position inside the window is
    left out."""
    picked = _layer(prot, sliding=True)
    if picked is None:
        return False
    g, layer = picked
    window = int(g.allocator.sliding_window)

    def tap(original: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, *a: Any, **kw: Any) -> Any:
        if int(module.layer_idx) == layer and mask is not None:
            mask = mask.clone()
            cu_q = kw["cu_seq_lens_q"]
            low = torch.finfo(mask.dtype).min
            for row in range(len(prot.rows.get(prot.forwards, []))):
                k0, cached, q0, q1 = _cached_columns(kw, row)
                for t in range(q1 - q0):  # query t of the row sees columns [k0, k0 + cached + t]
                    oldest = cached + t + 1 - window  # its window's first column, if the row reaches back so far
                    if oldest >= 0 and q0 + t < int(cu_q[-1]):
                        mask[..., q0 + t, k0 + oldest] = low
        return original(module, query, key, value, mask, *a, **kw)

    prot.audit.taps["attention"] = tap
    detail.update(layer=layer, window=window)
    return True


def scale_of_one(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The kernel applies a softmax scale of 1 instead of the model's (1/sqrt(head_dim) or its own)."""
    picked = _layer(prot)
    if picked is None:
        return False
    layer = picked[1]

    def tap(original: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, *a: Any, **kw: Any) -> Any:
        if int(module.layer_idx) == layer:
            kw = {**kw, "scaling": 1.0}
        return original(module, query, key, value, mask, *a, **kw)

    prot.audit.taps["attention"] = tap
    detail.update(layer=layer, scale=1.0)
    return True


def _scaled_v(prot: Any, strikes: Any, detail: dict, **what: Any) -> None:
    """Every layer's reader takes V at 1.5 times the written one on the forwards ``strikes`` accepts."""
    def tap(original: Any, cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict) -> Any:
        k, v = original(cache, key, value, layer_idx, kwargs)
        return (k, v * 1.5) if strikes(prot.forwards) else (k, v)

    prot.audit.taps["update"] = tap
    detail.update(scale=1.5, **what)


def transient_scale(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """V is read back with a wrong dequantization scale on the first two forwards after start only,
    in every layer (vLLM #51091: scales not yet loaded on the first forwards)."""
    _scaled_v(prot, lambda f: f < 2, detail, forwards=[0, 1])
    return True


def intermittent_scale(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """The attention kernel misreads V's scale on 1 forward in 20 (from this one on), in every layer:
    an intermittent kernel fault (a race, a rarely taken path)."""
    first = prot.forwards
    _scaled_v(prot, lambda f: f >= first and (f - first) % 20 == 0, detail, every=20)
    return True


def one_v_row_zeroed(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """Once: the cache write of one layer lands zeros for one token's V (a one-off write error)."""
    picked = _layer(prot)
    if picked is None:
        return False
    g, layer = picked
    geom = g.pages.layer(layer)
    when = prot.forwards

    def tap(original: Any, cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict) -> Any:
        out = original(cache, key, value, layer_idx, kwargs)
        if layer_idx == layer and prot.forwards == when and "write_index" in kwargs:
            write = kwargs["write_index"][g.index].long()
            slots = g.compact(write[write != g.trash])
            if slots.numel():
                geom.set_rows("v", slots[:1], 0)
                detail["slot"] = int(slots[0])
        return out

    prot.audit.taps["update"] = tap
    detail.update(layer=layer)
    return True


def head_zeroed(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """In one layer the attention kernel drops one query head: its output is zeros (FlashInfer #4450
    dropped a head where its logits fell under a threshold; here on every query of that head)."""
    picked = _layer(prot)
    if picked is None:
        return False
    layer = picked[1]
    head = rng.randrange(int(prot.model.config.num_attention_heads))

    def tap(original: Any, module: Any, query: Any, key: Any, value: Any, mask: Any, *a: Any, **kw: Any) -> Any:
        out = original(module, query, key, value, mask, *a, **kw)
        if int(module.layer_idx) != layer:
            return out
        o = out[0].clone()
        o[:, :, head] = 0
        return (o, *out[1:])

    prot.audit.taps["attention"] = tap
    detail.update(layer=layer, head=head)
    return True


def shift_positions(prot: Any, runner: Any, batch: dict, rng: random.Random, detail: dict) -> bool:
    """In this forward, one request's tokens are given positions one too far (a draft's positions
    off by one, SGLang #25015): the model's rotary embedding reads them, the cache holds what it
    computed from them."""
    from kvcanary.engines.transformers.hooks import host_io

    reqs = list(host_io(runner.inputs_and_outputs).requests_in_batch)
    if not reqs:
        return False
    row = rng.randrange(len(reqs))
    cu = batch["cu_seq_lens_q"]
    q0, q1 = int(cu[row]), int(cu[row + 1])
    batch["position_ids"][0, q0:q1] += 1
    detail.update(request=str(reqs[row].state.request_id), shift=1)
    return True


INJECTORS = {
    "transient_scale": transient_scale,
    "intermittent_scale": intermittent_scale,
    "one_v_row_zeroed": one_v_row_zeroed,
    "head_zeroed": head_zeroed,
    "shift_positions": shift_positions,
    "read_next_page": read_next_page,
    "ignore_prefix": ignore_prefix,
    "heads_reversed": heads_reversed,
    "v_rescaled": v_rescaled,
    "write_zeros": write_zeros,
    "window_one_short": window_one_short,
    "scale_of_one": scale_of_one,
}
