"""Faults injected into a running vLLM CPU engine's worker, just before the canary's check of a
forward (each fires once, at the ``at``-th forward or the first later one where its target exists).

- ``flip_k`` / ``flip_v``: one bit of one K (or V) element of a prefix block several requests read
  (a bit flip, a stray write into live KV);
- ``redirect``: one block-table entry of a request points at another request's block (a table
  entry off by a block, a wrong block id handed out);
- ``reuse``: a block several requests still read is handed to another request, which writes its
  own KV into it (a block freed while still referenced and reused);
- ``zero``: a live block's bytes are zeroed (zeroing a block that is still in use);
- ``flip_first_read``: one bit of a cached block flips just before a new request's first read of it
  through the prefix cache (cold KV corrupted while no request read it);
- ``write_null_block``: a stray write (a padding token's, a dummy run's) lands in the null block,
  block 0, which tables pad with and nothing may write;
- ``keep_rejected_drafts``: after speculative decoding rejected drafts, the engine keeps their KV
  as part of the sequence instead of rolling back (the next forward reads them as context);
- ``rollback_one_short``: after a rejection the engine rolls back one slot too few (the next forward
  reads the first rejected draft's KV as context);
- ``redirect_stuck``: as ``redirect``, but the entry stays wrong in every later forward of that
  request (a corrupted table, which recomputing the request's KV does not fix);
- ``flip_cold``: one bit of a cached block that no request of the forward holds flips (cold prefix
  cache, found by the patrol scrub before a later prefix hit would serve it).

Attention-kernel and cache-write faults, which the write check and the read audit
(:mod:`kvcanary.engines.vllm.audit`) exist for; each wraps the first layer's attention (through the
patch's tap, :mod:`kvcanary.engines.vllm.patch`) or its cache write from the forward it is injected
in on, as a kernel bug does, leaving the tables and stamps right:

- ``kernel_read_next_page``: the kernel reads one request's cached blocks one page too far;
- ``kernel_write_zeros``: the cache write of the layer (``do_kv_cache_update``) lands zeros;
- ``kernel_scale_of_one``: the kernel applies a softmax scale of 1 instead of the model's.

``position_shift`` gives one request's tokens positions one too far in the model forward of one
forward (:mod:`kvcanary.engines.vllm.positions` checks what the model is given).

The two speculative-decoding faults need a forward after a rejection (ngram drafting on a
repetitive prompt); the others a forward whose rows share cached blocks.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

@dataclass
class VllmFault:
    name: str
    at: int = 3
    seed: int = 0
    forwards: int = 0
    injected_at: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def install(name: str, at: int = 3, seed: int = 0) -> VllmFault:
    """Wrap the connector's ``bind_connector_metadata`` so that ``name`` is injected once (a
    persistent fault, :data:`PERSISTENT`, is applied again in every later forward)."""
    from vllm.forward_context import get_forward_context

    from kvcanary.engines.vllm.entry import KvCanaryConnector

    fault = VllmFault(name, at, seed)
    orig = KvCanaryConnector.bind_connector_metadata

    def bind(self: Any, meta: Any) -> None:
        md = get_forward_context().attn_metadata
        md = self.metadata(md, self.primary) if md else None
        if md is not None and fault.injected_at is None and fault.forwards >= fault.at and self.kv_caches:
            if INJECTORS[name](self, md, meta, random.Random(seed), fault.detail):
                fault.injected_at = fault.forwards
                fault.detail["step"] = self.canary.step_id if self.canary is not None else None
        elif md is not None and fault.injected_at is not None and name in PERSISTENT:
            PERSISTENT[name](md, meta, fault.detail)
        fault.forwards += 1
        orig(self, meta)

    KvCanaryConnector.bind_connector_metadata = bind  # type: ignore[method-assign,assignment]
    return fault


@contextmanager
def injected(name: str, at: int = 3, seed: int = 0) -> Iterator[VllmFault]:
    """:func:`install` for the length of a ``with`` block, so that one engine can run several faults
    one after another: the connector's ``bind_connector_metadata`` is restored when the block ends."""
    from kvcanary.engines.vllm.entry import KvCanaryConnector

    orig = KvCanaryConnector.bind_connector_metadata
    try:
        yield install(name, at, seed)
    finally:
        KvCanaryConnector.bind_connector_metadata = orig  # type: ignore[method-assign]


def _rows(md: Any, meta: Any, bs: int) -> list[tuple[str | None, int, list[int]]]:
    """(request id, cached tokens, blocks holding them) for each row of the forward."""
    qsl, seq = md.query_start_loc.tolist(), md.seq_lens.tolist()
    slots = md.slot_mapping.tolist()
    by_slot = {r.first_slot: r.req_id for r in meta.reqs}
    out = []
    for r in range(len(qsl) - 1):
        cached = seq[r] - (qsl[r + 1] - qsl[r])
        out.append((by_slot.get(slots[qsl[r]]), cached, md.block_table[r, : cached // bs].tolist()))
    return out


def _shared(md: Any, meta: Any, rng: random.Random, bs: int) -> tuple[int, list[str]] | None:
    """A fully cached block at least two rows read, and the requests that read it."""
    seen: dict[int, list[str]] = {}
    for rid, _, blocks in _rows(md, meta, bs):
        for b in set(blocks):
            seen.setdefault(b, []).append(rid or "?")
    shared = sorted(b for b, rs in seen.items() if len(rs) >= 2 and b != 0)
    if not shared:
        return None
    b = rng.choice(shared)
    return b, seen[b]


def _element(conn: Any, layer: str, block: int, head: int, t: int, d: int, half: str) -> tuple[torch.Tensor, int]:
    """The bytes of one layer's storage and the byte offset of one K or V element in them."""
    geom = conn.geometry[layer]
    return geom.storage_bytes(), geom.element(half, block * geom.block_size + t, head, d)


def _flip(half: str) -> Any:
    def inject(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
        picked = _shared(md, meta, rng, conn.block_size)
        if picked is None:
            return False
        block, readers = picked
        layer = rng.choice(conn.fault_layers())
        kv = conn.kv_caches[layer]
        head, t, d = rng.randrange(kv.shape[1]), rng.randrange(kv.shape[2]), rng.randrange(kv.shape[3] // 2)
        flat, off = _element(conn, layer, block, head, t, d, half)
        byte = off + rng.randrange(kv.element_size())
        flat[byte] ^= 1 << rng.randrange(8)
        detail.update(block=block, slot=block * kv.shape[2] + t, layer=layer, half=half, readers=readers)
        return True

    return inject


def redirect(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    rows = _rows(md, meta, conn.block_size)
    for r, (rid, cached, blocks) in enumerate(rows):
        others = sorted({b for j, (_, _, bl) in enumerate(rows) if j != r for b in bl} - set(blocks) - {0})
        if not blocks or not others or rid is None:
            continue
        i = rng.randrange(len(blocks))
        md.block_table[r, i] = rng.choice(others)
        detail.update(request=rid, block_index=i, was=blocks[i], now=int(md.block_table[r, i]))
        return True
    return False


def reuse(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    bs = conn.block_size
    picked = _shared(md, meta, rng, conn.block_size)
    if picked is None:
        return False
    block, readers = picked
    qsl, seq = md.query_start_loc.tolist(), md.seq_lens.tolist()
    for r in range(len(qsl) - 1):
        n = qsl[r + 1] - qsl[r]
        cached = seq[r] - n
        if cached % bs or int(md.block_table[r, cached // bs]) == block:  # a writer that starts a fresh block
            continue
        i, k = cached // bs, min(n, bs)
        md.block_table[r, i] = block  # the allocator hands it the still-shared block
        md.slot_mapping[qsl[r] : qsl[r] + k] = block * bs + torch.arange(k)
        detail.update(block=block, readers=readers, writer_row=r)
        return True
    return False


def zero(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    picked = _shared(md, meta, rng, conn.block_size)
    if picked is None:
        return False
    block, readers = picked
    for kv in conn.kv_caches.values():
        kv[block].zero_()
    detail.update(block=block, readers=readers)
    return True


def flip_first_read(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    bs = conn.block_size
    stamped = conn.canary.stamps[:, 1] >= 0
    for rid, cached, blocks in _rows(md, meta, bs):
        if rid is None or rid in conn.seen or cached < bs:
            continue  # not a request's first forward with cached KV
        old = [b for b in blocks if b != 0 and bool(stamped[b * bs : (b + 1) * bs].all())]  # written before now
        if not old:
            continue
        detail.update(request=rid, **_flip_k_bit(conn, rng.choice(old), rng))
        return True
    return False


def _flip_k_bit(conn: Any, block: int, rng: random.Random) -> dict[str, Any]:
    """Flip one bit of one K element of ``block`` (a random layer of the primary group, head, token,
    dimension); returns where."""
    bs = conn.block_size
    layer = rng.choice(conn.fault_layers())
    kv = conn.kv_caches[layer]
    t = rng.randrange(bs)
    flat, off = _element(conn, layer, block, rng.randrange(kv.shape[1]), t, rng.randrange(kv.shape[3] // 2), "k")
    flat[off] ^= 1 << rng.randrange(8)
    return {"block": block, "slot": block * bs + t, "layer": layer}


def write_null_block(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    layer = rng.choice(conn.fault_layers())
    kv = conn.kv_caches[layer]
    t = rng.randrange(conn.block_size)
    flat, off = _element(conn, layer, 0, rng.randrange(kv.shape[1]), t, rng.randrange(kv.shape[3] // 2), "v")
    flat[off] ^= 0x40
    detail.update(block=0, slot=t, layer=layer)
    return True


def _kept_drafts(keep_all: bool) -> Any:
    def inject(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
        qsl = md.query_start_loc.tolist()
        by_slot = {r.first_slot: r for r in meta.reqs}
        for row in range(len(qsl) - 1):
            r = by_slot.get(int(md.slot_mapping[qsl[row]]))
            if r is None or r.rollback <= r.computed:
                continue
            kept = r.rollback - r.computed if keep_all else 1
            md.seq_lens[row] += kept  # the forward reads the rejected drafts' positions as context
            detail.update(request=r.req_id, kept=kept, computed=r.computed, rejected=r.rollback - r.computed)
            return True
        return False

    return inject


def _redirect_again(md: Any, meta: Any, detail: dict) -> None:
    """Keep the redirected entry wrong in each later forward of the request (while it reads it)."""
    bs = int(detail.get("block_size", 0))
    for row, (rid, cached, _) in enumerate(_rows(md, meta, bs) if bs else []):
        if rid == detail["request"] and detail["block_index"] < cached // bs:
            md.block_table[row, detail["block_index"]] = detail["now"]


def redirect_stuck(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    detail["block_size"] = conn.block_size
    return redirect(conn, md, meta, rng, detail)


def flip_cold(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    bs = conn.block_size
    held = {b for _, _, blocks in _rows(md, meta, bs) for b in blocks} | set(md.block_table.flatten().tolist())
    stamped = conn.canary.stamps[:, 1] >= 0
    cold = [b for b in range(1, conn.canary.num_slots // bs) if b not in held and bool(stamped[b * bs : (b + 1) * bs].all())]
    if not cold:
        return False
    detail.update(_flip_k_bit(conn, rng.choice(cold), rng))
    return True


def _kernel_layer(conn: Any) -> str | None:
    """The first layer of the first covered KV cache group (audited or not); installs the tap point."""
    from kvcanary.engines.vllm import patch

    patch.install()
    layers = [n for g in conn.groups for n in g.plan.layers if n in conn.kv_caches]
    return layers[0] if layers else None


def _tap(fn: Any) -> None:
    from kvcanary.engines.vllm import patch

    patch.TAPS["forward"] = fn


_UPDATE: dict[str, Any] = {}  # vLLM's own cache write, once wrapped


def _tap_update(fn: Any) -> None:
    """Wrap every layer's cache write (``CPUAttentionBackendImpl.do_kv_cache_update``, which runs
    before the layer's attention) as ``fn(original, impl, layer, key, value, kv_cache, slot_mapping)``."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = _UPDATE.setdefault("update", CPUAttentionBackendImpl.do_kv_cache_update)

    def update(impl: Any, lay: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> Any:
        return fn(original, impl, lay, key, value, kv_cache, slot_mapping)

    CPUAttentionBackendImpl.do_kv_cache_update = update


def kernel_read_next_page(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    import dataclasses

    bs = conn.block_size
    layer = _kernel_layer(conn)
    victim = next((rid for rid, cached, _ in _rows(md, meta, bs) if rid and cached >= bs), None)
    if layer is None or victim is None:
        return False

    def tap(original: Any, impl: Any, lay: Any, q: Any, k: Any, v: Any, kv: Any, m: Any, out: Any, *a: Any, **kw: Any) -> Any:
        rids = conn.rows.rids if conn.rows is not None else []
        if lay.layer_name == layer and victim in rids:
            row = rids.index(victim)
            cached = int(m.seq_lens[row]) - int(m.query_start_loc[row + 1] - m.query_start_loc[row])
            full = cached // bs  # the blocks wholly cached before this forward
            if full:
                bt = m.block_table.clone()
                bt[row, :full] += 1
                m = dataclasses.replace(m, block_table=bt)
        return original(impl, lay, q, k, v, kv, m, out, *a, **kw)

    _tap(tap)
    detail.update(request=victim, layer=layer)
    return True


def kernel_write_zeros(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    from kvcanary.geometry.strided import StridedKv

    layer = _kernel_layer(conn)
    if layer is None or not isinstance(conn.geometry.get(layer), StridedKv):  # vec and vec16 layouts
        return False
    geom = conn.geometry[layer]

    def tap(original: Any, impl: Any, lay: Any, key: Any, value: Any, kv: Any, slot_mapping: Any) -> Any:
        original(impl, lay, key, value, kv, slot_mapping)
        if lay.layer_name == layer:  # the write lands zeros where it wrote
            slots = slot_mapping.long()
            slots = slots[slots >= 0]
            geom.set_rows("k", slots, 0)
            geom.set_rows("v", slots, 0)

    _tap_update(tap)
    detail.update(layer=layer)
    return True


def kernel_scale_of_one(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    layer = _kernel_layer(conn)
    if layer is None:
        return False

    def tap(original: Any, impl: Any, lay: Any, q: Any, k: Any, v: Any, kv: Any, m: Any, out: Any, *a: Any, **kw: Any) -> Any:
        if lay.layer_name != layer:
            return original(impl, lay, q, k, v, kv, m, out, *a, **kw)
        scale, impl.scale = impl.scale, 1.0
        try:
            return original(impl, lay, q, k, v, kv, m, out, *a, **kw)
        finally:
            impl.scale = scale

    _tap(tap)
    detail.update(layer=layer, scale=1.0)
    return True


def position_shift(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    """In this forward, one request's tokens reach the model with positions one too far (a draft's
    positions off by one): the model forward's ``positions`` are shifted for that request's rows."""
    from kvcanary.engines.vllm import positions as vllm_positions

    victim = next((rid for rid, _, _ in _rows(md, meta, conn.block_size) if rid), None)
    if victim is None or not conn.groups:
        return False
    struck: list[int] = []

    def tap(original: Any, runner: Any, *a: Any, **kw: Any) -> Any:
        pos, rows, step = kw.get("positions"), conn.rows, conn.groups[0].step
        if not struck and pos is not None and pos.dim() == 1 and rows is not None and step is not None \
                and victim in rows.rids:
            row = rows.rids.index(victim)
            q0, q1 = int(step.new_offsets[row]), int(step.new_offsets[row + 1])
            pos = pos.clone()
            pos[q0:q1] += 1
            kw = {**kw, "positions": pos}
            struck.append(row)
        return original(runner, *a, **kw)

    vllm_positions.TAPS["forward"] = tap
    detail.update(request=victim, shift=1)
    return True


def canary_fails(conn: Any, md: Any, meta: Any, rng: random.Random, detail: dict) -> bool:
    """Not a corruption: from this forward on, the canary's own per-layer checks and position check
    raise (a bug of kvcanary's), to show that ``log`` mode keeps it from the engine and that it
    turns into no report."""
    from kvcanary.engines.vllm.entry import KvCanaryConnector
    from kvcanary.fused import audit as fused_audit
    from kvcanary.fused import keep as fused_keep

    def boom(*a: Any, **kw: Any) -> None:
        raise RuntimeError("a failure inside the canary (injected)")

    # the compiled loops of the write check and read audit, inside and after each layer's forward
    fused_keep.keep_layer = boom
    fused_keep.keep_layer_at = boom
    fused_keep.keep_queries = boom
    fused_audit.check_forward = boom
    KvCanaryConnector.model_positions.__wrapped__ = boom  # type: ignore[attr-defined]
    detail.update(failing=["write check and read audit", "position check"])
    return True


PERSISTENT = {"redirect_stuck": _redirect_again}  # faults applied again in every later forward
INJECTORS = {"flip_k": _flip("k"), "flip_v": _flip("v"), "redirect": redirect, "reuse": reuse, "zero": zero,
             "flip_first_read": flip_first_read, "write_null_block": write_null_block,
             "keep_rejected_drafts": _kept_drafts(True), "rollback_one_short": _kept_drafts(False),
             "redirect_stuck": redirect_stuck, "flip_cold": flip_cold,
             "kernel_read_next_page": kernel_read_next_page, "kernel_write_zeros": kernel_write_zeros,
             "kernel_scale_of_one": kernel_scale_of_one, "position_shift": position_shift,
             "canary_fails": canary_fails}
