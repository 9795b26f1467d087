"""SGLang's token-to-KV pool under the canary without SGLang: the layout the adapter describes
(each layer's K and V the two halves of one ``[2, slots, heads, dim]`` allocation, slot 0 SGLang's
padding slot), steps built from SGLang-shaped batches, on every canary backend (the compiled CPU
loops, the torch reference, and the Triton kernels a CUDA pool runs, under the interpreter here):

- stamps equal the torch reference's bit for bit, a next step verifies clean, and one flipped byte of
  a cached slot is found at its slot and position;
- the adapter's write check and read audit (:mod:`kvcanary.engines.sglang.audit`) give the same
  verdicts on the compiled loop (a CPU pool) and on the torch reference (what a CUDA pool runs):
  clean on attention computed as SGLang's torch-native backend computes it (sliding window
  included), ``WRITE_CONTENT`` where a cache write landed zeros, ``ATTENTION`` where a layer's
  output is off.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvcanary import Canary, CanaryConfig, Check
from kvcanary.engines.sglang.audit import SglangAudit
from kvcanary.engines.sglang.steps import build_step, host_counts
from kvcanary.geometry.pages import page_major
from kvcanary.layout import KvLayout

from factories import DEV, clone_step, step_to

SLOTS, H, HQ, D, LAYERS = 64, 2, 4, 16, 2
DTYPE = torch.float16


class Mode:
    def __init__(self, name):
        self.name = name

    def is_idle(self):
        return False

    def is_decode(self):
        return self.name == "DECODE"


def t(x):
    return torch.tensor(x, dtype=torch.int64)


def pool(dev="cpu"):
    """SGLang's MHA pool: per layer, K and V the halves of one zeroed allocation."""
    bufs = [torch.zeros(2, SLOTS, H, D, dtype=DTYPE, device=dev) for _ in range(LAYERS)]
    ks, vs = [b[0] for b in bufs], [b[1] for b in bufs]
    geoms = [page_major(k.unsqueeze(1), v.unsqueeze(1), i) for i, (k, v) in enumerate(zip(ks, vs))]
    return ks, vs, geoms, KvLayout(tuple(s for i, g in enumerate(geoms) for s in g.sources(f"layer{i}")), reserved=(0,))


def batches():
    """A prefill of two requests sharing 6 tokens, then a decode of both; their req_to_token rows."""
    table = torch.zeros((4, 32), dtype=torch.int32)
    a = list(range(1, 11))  # request a: slots 1..10
    b = a[:6] + list(range(20, 25))  # request b shares the first 6 (deduplicated), then its own
    table[3, :11], table[2, :12] = t(a + [11]), t(b + [25])
    ta = [100 + i for i in range(10)]
    tb = ta[:6] + [200 + i for i in range(5)]
    pre = SimpleNamespace(forward_mode=Mode("EXTEND"), batch_size=2, req_pool_indices=t([3, 2]),
                          seq_lens=t([10, 11]), extend_prefix_lens=t([0, 6]).int(), extend_seq_lens=t([10, 5]).int(),
                          input_ids=t(ta + tb[6:]), positions=t(list(range(10)) + list(range(6, 11))),
                          out_cache_loc=t(a + b[6:]))
    dec = SimpleNamespace(forward_mode=Mode("DECODE"), batch_size=2, req_pool_indices=t([3, 2]), seq_lens=t([11, 12]),
                          input_ids=t([7, 8]), positions=t([10, 11]), out_cache_loc=t([11, 25]))
    return table, pre, dec


def fill(ks, vs, fb, seed=0):
    """The batch's new tokens' K and V (``[T, H, D]`` each per layer), written where SGLang writes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, v in zip(ks, vs):
        nk, nv = (torch.randn(len(fb.out_cache_loc), H, D, generator=g).to(DTYPE) for _ in range(2))
        k[fb.out_cache_loc.to(k.device)], v[fb.out_cache_loc.to(v.device)] = nk.to(k.device), nv.to(v.device)
        out.append((nk, nv))
    return out


@pytest.mark.parametrize("backend", ["fused", "torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_the_pool_stamps_verifies_and_finds_a_flipped_byte_alike_on_every_backend(backend):
    table, pre, dec = batches()
    cfg = CanaryConfig(mode="log", backend=backend, content_budget_bytes=None, patrol_budget_bytes=0)
    dev = DEV if backend == "triton" else torch.device("cpu")
    ks, vs, _, layout = pool(dev)
    ref_ks, ref_vs, _, ref_layout = pool()
    fill(ks, vs, pre)
    fill(ref_ks, ref_vs, pre)
    ref = Canary(SLOTS, ref_layout, CanaryConfig(mode="log", backend="torch", content_budget_bytes=None,
                                                 patrol_budget_bytes=0))
    c = Canary(SLOTS, layout, cfg)
    step = build_step(pre, table)
    ref.after_forward(clone_step(step))
    c.after_forward(step_to(clone_step(step), dev))
    assert c.drain() == [] and ref.drain() == []
    assert torch.equal(c.stamps.cpu(), ref.stamps), f"{backend}: stamps differ from the torch reference's"
    written = step.new_slots
    assert bool((c.stamps.cpu()[written, 3] != 0).all())
    fill(ks, vs, dec, seed=1)
    d = build_step(dec, table)
    c.before_forward(step_to(clone_step(d), dev))
    c.after_forward(step_to(clone_step(d), dev))
    assert c.drain() == []
    # a byte of request b's cached token at position 8 (slot 22), layer 1's V
    vs[1][22].view(-1).view(torch.uint8)[5] ^= 0x10
    again = SimpleNamespace(**{**vars(dec), "seq_lens": t([12, 13]), "positions": t([11, 12]),
                               "out_cache_loc": t([12, 26])})
    table[3, 11], table[2, 12] = 12, 26
    c.before_forward(step_to(build_step(again, table), dev))
    got = [(v.slot, v.position, v.row) for v in c.drain() if v.checks & Check.CONTENT]
    assert got == [(22, 8, 1)], got


def attns(window=None):
    return [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=H, qk_head_dim=D, scaling=D ** -0.5,
                            sliding_window_size=(window - 1 if window and i == 0 else -1), logit_cap=0.0)
            for i in range(LAYERS)]


def attention(q, kc, vc, slots, positions, scale, window):
    """SGLang's torch-native attention for some queries of one request: SDPA over its slots' K and V
    (each query head reads KV head ``h // (HQ // H)``), causal, masked to the window."""
    k = kc[slots].float().repeat_interleave(HQ // H, dim=1)  # [L, HQ, D]
    v = vc[slots].float().repeat_interleave(HQ // H, dim=1)
    out = []
    for qi, p in zip(q, positions):
        logits = torch.einsum("hd,lhd->hl", qi.float(), k) * scale
        pos = torch.arange(len(slots))
        keep = (pos <= p) & ((pos > p - window) if window else True)
        logits = logits.masked_fill(~keep[None, :], float("-inf"))
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), v))
    return torch.stack(out).to(DTYPE)


def run_audit(fused, fault=None, window=None):
    """One prefill through the adapter's audit over the pool; the violations it finds."""
    table, pre, _ = batches()
    ks, vs, geoms, _ = pool()
    adapter = SimpleNamespace(config=CanaryConfig(mode="log", audit_queries=64, audit_budget=None), internal_errors=0,
                              pending=None, seconds=0.0)
    audit = SglangAudit(adapter, attns(window), geoms, "kv", fused)
    step = build_step(pre, table)
    audit.begin(step, *host_counts(pre), ["a", "b"], 0)
    new = fill(ks, vs, pre)
    g = torch.Generator().manual_seed(7)
    rows = [(0, 10, 0, table[3, :10].long()), (10, 5, 6, table[2, :11].long())]  # start, new, cached, slots
    for layer, a in enumerate(attns(window)):
        k, v = new[layer]
        if fault == "zeros" and layer == 1:
            ks[1][4], vs[1][4] = 0, 0  # the write of request a's position 3 landed zeros (and is read so)
        q = torch.randn(len(pre.out_cache_loc), HQ * D, generator=g).to(DTYPE)
        o = torch.empty(len(pre.out_cache_loc), HQ, D, dtype=DTYPE)
        win = a.sliding_window_size + 1 if a.sliding_window_size > -1 else None
        for start, n, cached, slots in rows:
            o[start:start + n] = attention(q[start:start + n].view(n, HQ, D), ks[layer], vs[layer], slots,
                                           list(range(cached, cached + n)), a.scaling, win)
        if fault == "scale" and layer == 0:
            o[10:] *= 1.5  # request b's outputs in layer 0
        audit.layer(a, q, k, v, o.view(-1, HQ * D), True)
    audit.finish()
    found = audit.drain()
    audit.end()
    assert adapter.internal_errors == 0
    return audit, found


@pytest.mark.parametrize("window", [None, 4])
def test_the_audit_is_clean_on_the_backends_attention_on_both_paths(window):
    for fused in (True, False):
        audit, found = run_audit(fused, window=window)
        assert found == [], (fused, found)
        st = audit.stats()
        assert st["write_slots_checked"] == LAYERS * 15 and st["audit_queries"] >= 8


@pytest.mark.parametrize("fault,check", [("zeros", Check.WRITE_CONTENT), ("scale", Check.ATTENTION)])
def test_the_audit_finds_a_bad_write_and_a_bad_read_alike_on_both_paths(fault, check):
    got = {}
    for fused in (True, False):
        _, found = run_audit(fused, fault)
        hits = sorted({(v.slot, v.row, v.aux) for v in found if v.checks & check})
        assert hits, (fused, found)
        assert all(not (v.checks & ~check) for v in found)
        got[fused] = hits
    if fault == "zeros":
        assert got[True] == got[False] == [(4, 0, 1)]
    else:
        assert all(row == 1 and layer == 0 for _, row, layer in got[True] + got[False])
