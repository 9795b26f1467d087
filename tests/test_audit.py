"""The write check and the read audit (kvcanary.audit): the reference attention, the bitwise write
comparison, each kernel fault class found with the audit and missed without it, clean runs across
architectures and dtypes, the default budget's rotation, the audit's own failures, healing modes,
and no host sync in the audit's device work."""

import logging
import random

import numpy as np
import pytest
import torch

from kvcanary import CanaryConfig, Check, KvCorruptionError
from kvcanary.audit import auditor, reference
from kvcanary.audit.records import ForwardAudit, Query, plan_layers
from kvcanary.audit.reference import attend, check_layer, write_mismatch
from kvcanary.engines import audit as engine_audit
from kvcanary.engines.transformers import audit as transformers_audit
from kvcanary.engines.transformers.models import cb_configs, tiny_arch
from kvcanary.engines.transformers import protect, tiny_model
from kvcanary.faults import runner
from kvcanary.faults.catalog import BY_NAME, CATALOG, Outcome
from kvcanary.faults.transformers_cb import CbFault
from kvcanary.step import Step
from kvcanary.violations import Site

from kvcanary.faults.host_sync import no_host_sync
from test_transformers import prompts, tokens


def _direct(q, k, v, valid, scale, softcap, sink):
    """Attention of each query written out in float64, one position at a time."""
    out = []
    for s in range(q.shape[0]):
        logits = []
        for j in range(k.shape[1]):
            if valid[s, j]:
                x = float((q[s].double() * k[s, j].double()).sum()) * scale
                logits.append((softcap * np.tanh(x / softcap) if softcap else x, j))
        m = max([x for x, _ in logits] + ([float(sink[s])] if sink is not None else []))
        den = sum(np.exp(x - m) for x, _ in logits) + (np.exp(float(sink[s]) - m) if sink is not None else 0.0)
        out.append(sum(np.exp(x - m) / den * v[s, j].double() for x, j in logits))
    return torch.stack(out)


@pytest.mark.parametrize("softcap,sinks", [(None, False), (5.0, False), (None, True), (3.0, True)])
def test_the_reference_is_attention_with_window_sinks_and_softcap(softcap, sinks):
    g = torch.Generator().manual_seed(3)
    s, length, d = 4, 11, 8
    q, k, v = (torch.randn(s, *shape, generator=g) for shape in ((d,), (length, d), (length, d)))
    valid = torch.zeros(s, length, dtype=torch.bool)
    for i, (lo, hi) in enumerate([(0, 11), (3, 9), (5, 6), (0, 1)]):  # windows of several widths
        valid[i, lo:hi] = True
    sink = torch.randn(s, generator=g) if sinks else None
    out, vmax, mean = attend(q, k, v, valid, 0.35, softcap, sink)
    assert torch.allclose(out.double(), _direct(q, k, v, valid, 0.35, softcap, sink), atol=1e-5)
    assert torch.allclose(vmax, (v.abs().amax(-1) * valid).amax(-1))
    logits = torch.einsum("sd,sld->sl", q, k) * 0.35
    logits = softcap * torch.tanh(logits / softcap) if softcap else logits
    full = torch.cat([logits.masked_fill(~valid, -torch.inf), sink[:, None] if sinks else logits[:, :0]], 1)
    p = torch.softmax(full, 1)[:, :length]
    assert torch.allclose(mean, (p * logits.abs() * valid).sum(1), atol=1e-5)  # the tolerance's logit size


def test_the_write_comparison_is_bitwise():
    src_k = torch.randn(5, 3, 4)
    src_v = torch.randn(5, 3, 4)
    src_k[1, 0, 0] = float("nan")  # a NaN written as a NaN is a faithful write
    half, head = write_mismatch(src_k, src_v, src_k.clone(), src_v.clone())
    assert half.tolist() == [0] * 5
    cache_k, cache_v = src_k.clone(), src_v.clone()
    # one ulp of change in K, head 1 (an added 1e-7 is lost to rounding where |x| > ~1: the test flaked)
    cache_k[2, 1, 3] = torch.nextafter(cache_k[2, 1, 3], torch.tensor(float("inf")))
    cache_v[4, 2] = 0  # V's head 2 lands zeros
    cache_k[4, 0, 0] = -cache_k[4, 0, 0]
    half, head = write_mismatch(src_k, src_v, cache_k, cache_v)
    assert half.tolist() == [0, 0, 1, 0, 3] and head[2] == 1 and head[4] == 0
    # the cache's dtype is what the write casts to: a bf16 cache of fp32 rows compares after the cast
    half, _ = write_mismatch(src_k, src_v, src_k.to(torch.bfloat16), src_v.to(torch.bfloat16))
    assert half.tolist() == [0] * 5


AUDIT_CLASSES = [f for f in CATALOG if f.audit]


def test_every_audit_class_is_a_detection_with_a_transformers_injector():
    # the kernel classes are the audit's and the position shift, which the stamp check finds
    assert {f.name for f in AUDIT_CLASSES} | {"position_shift"} == set(runner.KERNEL_FAULTS)
    assert all(f.outcome == Outcome.DETECT for f in CATALOG)  # the documented misses became detections
    for name in ("attention_read_bug", "layout_disagreement", "quant_scale_mixup"):
        assert BY_NAME[name].audit


@pytest.mark.parametrize("name", [f.name for f in AUDIT_CLASSES])
def test_each_kernel_fault_is_found_with_the_audit_and_missed_without(name):
    r = runner.run_transformers(BY_NAME[name], seed=0)
    assert r.detected and r.missed_without_audit and r.ok, r.to_dict()
    assert r.detail["output_changed_without_audit"], "the fault must change the generated tokens: a real miss"
    # in the forward it strikes; a fault confined to one (layer, head) within the rotation's bound
    assert r.forwards_to_detect == 1 or (name == "head_zeroed_one_layer"
                                         and r.forwards_to_detect <= BY_NAME[name].max_forwards)
    if name == "attention_read_bug":  # the evidence names the page shift
        assert "1 block(s) on explains it" in r.first


def test_positions_shifted_for_one_request_are_found_in_the_forward_they_strike():
    """The positions the model is given (the batch's position ids, which its rotary embedding reads)
    against the stamped ones, at the default configuration."""
    r = runner.run_transformers(BY_NAME["position_shift"], seed=0)
    assert r.ok and r.forwards_to_detect == 1 and "WRITE_POSITION" in r.checks_fired, r.to_dict()
    assert r.detail["request"] in r.first


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "mistral", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_clean_runs_never_cry_wolf_across_architectures_and_dtypes(arch, dtype):
    model = tiny_arch(arch, seed=1).to(dtype)
    ps = prompts(10, seed=2)
    gen, cb = cb_configs(max_new_tokens=12)
    with torch.inference_mode():
        base = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
        with protect(model, CanaryConfig(mode="raise", content_budget_bytes=None, audit_queries=64, audit_every=1,
                                         audit_budget=None)) as g:
            g.audit.auditor.errors = []
            out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
    st = g.stats()
    assert st["violations"] == 0 and st["internal_errors"] == 0 and not g.violations
    assert st["audit_queries"] > 100 and st["write_slots_checked"] > 100
    assert tokens(out) == tokens(base)
    errs = g.audit.auditor.errors
    ratios = g.audit.auditor.ratios  # each query's error over its tolerance
    assert len(errs) > 100 and len(ratios) == len(errs) and max(ratios) < 0.25  # a margin, not a near miss


def test_the_default_budget_finds_a_one_request_kernel_bug_as_its_rotation_comes_round():
    """Four audited queries every fourth forward: a bug in one request's reads of one layer is found
    within the forwards it takes the rotation to reach that (layer, request) pair."""
    model = tiny_model(seed=0, layers=2)
    ps = prompts(8, seed=3)
    gen, cb = cb_configs(max_new_tokens=40)
    fault = CbFault("read_next_page", at=3)
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        with torch.inference_mode(), protect(model, CanaryConfig(mode="log")) as g:
            g.hooks.append(fault)
            model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    assert fault.injected_at is not None
    hits = [v for v in g.violations if v.checks & Check.ATTENTION]
    assert hits and all(v.step >= fault.injected_at for v in g.violations)
    assert hits[0].request == fault.detail["request"] and hits[0].aux == fault.detail["layer"]
    # 2 layers x 8 requests at 4 queries an audited forward: every pair within 4 audited forwards, 16 forwards
    assert hits[0].step - fault.injected_at <= 16 + 4


@pytest.mark.parametrize("target", ["attend", "write_mismatch", "plan_layers", "drain", "check_forward"])
def test_an_audit_failure_never_reaches_the_engine_in_log_mode(monkeypatch, target):
    model = tiny_model(seed=0, layers=2)
    ps = prompts(8, seed=4)
    gen, cb = cb_configs(max_new_tokens=8)
    with torch.inference_mode():
        base = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)

    def boom(*a, **k):
        raise RuntimeError("injected failure inside the audit")

    from kvcanary.fused import audit as fused_audit

    owner = {"attend": reference, "write_mismatch": engine_audit, "plan_layers": transformers_audit,
             "drain": auditor.Auditor, "check_forward": fused_audit}[target]
    monkeypatch.setattr(owner, target, boom)
    backend = "fused" if owner is fused_audit else "torch"  # each function is reached on its own path
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        with torch.inference_mode(), protect(model, CanaryConfig(mode="log", audit_queries=8, audit_every=1, backend=backend)) as g:
            out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    assert tokens(out) == tokens(base)
    st = g.stats()
    assert st["internal_errors"] >= 1 and st["violations"] == 0 and not g.violations


def test_an_audit_failure_in_raise_mode_reaches_the_callers_thread(monkeypatch):
    model = tiny_model(seed=0, layers=2)

    def boom(*a, **k):
        raise RuntimeError("injected failure inside the audit")

    monkeypatch.setattr(reference, "attend", boom)
    gen, cb = cb_configs(max_new_tokens=4)
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        with pytest.raises(RuntimeError, match="inside the audit"):
            with torch.inference_mode(), protect(model, CanaryConfig(mode="raise", backend="torch")):
                model.generate_batch(prompts(4, seed=5), generation_config=gen, continuous_batching_config=cb)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)


@pytest.mark.parametrize("mode", ["quarantine", "repair"])
def test_healing_modes_fail_the_requests_a_persistent_kernel_bug_hurts(mode):
    """A kernel bug is not fixed by recomputing: in repair mode each hurt request is recomputed up to
    the limit, then fails with the evidence; the engine keeps serving and no other request fails."""
    model = tiny_model(seed=0, layers=2)
    ps = prompts(8, seed=6)
    gen, cb = cb_configs(max_new_tokens=10)
    fault = CbFault("read_next_page", at=3)
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        cfg = CanaryConfig(mode=mode, audit_queries=64, audit_every=1, audit_budget=None)
        with torch.inference_mode(), protect(model, cfg) as g:
            g.hooks.append(fault)
            out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    victim = fault.detail["request"]
    failed = {rid for rid, o in out.items() if o.error}
    assert failed == {victim}, failed
    assert isinstance(g.quarantine.failed[victim], KvCorruptionError)
    if mode == "repair":
        assert g.quarantine.repairs[victim] == g.config.repair_limit
    assert all(len(o.generated_tokens) == 10 for rid, o in out.items() if rid != victim)


def test_the_audits_device_work_never_syncs_the_host():
    """The write comparison and one layer's audit, given their host-built plan, are device ops only."""
    rng = random.Random(7)
    slots_n, hkv, d, hq = 64, 2, 8, 4
    k_cache, v_cache = torch.randn(slots_n, hkv, d), torch.randn(slots_n, hkv, d)
    table = torch.full((3, 40), -1, dtype=torch.int64)
    table[0, :20] = torch.arange(20)
    table[1, :30] = torch.arange(30, 60)
    step = Step(slot_table=table, cached_lens=torch.tensor([19, 29]), new_offsets=torch.tensor([0, 1, 2]),
                new_tokens=torch.tensor([5, 6]), new_positions=torch.tensor([19, 29]), new_slots=torch.tensor([19, 59]))
    queries = [Query(0, r, r, rng.randrange(hq), p, p, None) for r, p in ((0, 19), (1, 29))]
    fa = ForwardAudit(0, np.array([0, 1, 2]), np.array([19, 29]), {None: step.new_slots}, queries,
                      torch.full((2,), -1.0), torch.zeros(2, dtype=torch.int64), torch.zeros(2))
    plan = plan_layers(queries, {}, torch.device("cpu"))[0]
    plan.grid  # the plan's device tensors are made on the host, before the forward
    query = torch.randn(1, hq, 2, d)
    out = torch.randn(1, 2, hq, d)
    with no_host_sync():
        half, _ = write_mismatch(k_cache[:2], v_cache[:2], k_cache[:2], v_cache[:2])
        shape = plan.grid.shape
        slots = step.lookup(plan.row[:, None].expand(shape).reshape(-1), plan.grid.reshape(-1)).view(shape)
        kvh = (plan.head // 2)[:, None].expand(shape)

        def read(s, shift):
            p = torch.where(plan.old, s + shift * 8, s).clamp(0, slots_n - 1)
            return k_cache[p, kvh], v_cache[p, kvh]

        check_layer(fa, plan, slots, query[0, plan.head, plan.token], out[0, plan.token, plan.head], read,
                    0.3, None, None, (1e-3, 0.0))
    assert half.tolist() == [0, 0]
    found = auditor.Auditor(2, None)
    found.pending.append(fa)
    vs = found.drain()  # random engine outputs: both queries are far off
    assert [v.site for v in vs] == [Site.AUDIT, Site.AUDIT] and [v.position for v in vs] == [19, 29]


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_compiled_audit_equals_the_torch_reference(arch, dtype):
    """The same forwards audited by the compiled loops and by the torch reference: the same queries,
    the same errors within float rounding, the same write checks; both with and without a fault."""
    model = tiny_arch(arch, seed=3).to(dtype)
    ps = prompts(10, seed=8)
    gen, cb = cb_configs(max_new_tokens=8)
    runs = {}
    for backend in ("fused", "torch"):
        fault = CbFault("heads_reversed" if arch != "mistral" else "window_one_short", at=4)
        logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
        try:
            with torch.inference_mode(), protect(model, CanaryConfig(mode="log", content_budget_bytes=None,
                                                                     audit_queries=16, audit_every=1, backend=backend,
                                                                     audit_budget=None)) as g:
                g.audit.auditor.errors = []
                g.hooks.append(fault)
                model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
        finally:
            logging.getLogger("kvcanary").setLevel(logging.WARNING)
        runs[backend] = g
    f, t = runs["fused"], runs["torch"]
    assert f.audit.fused and not t.audit.fused
    ef, et = np.array(f.audit.auditor.errors), np.array(t.audit.auditor.errors)
    assert ef.shape == et.shape and len(ef) > 50
    assert np.allclose(ef, et, rtol=1e-3, atol=reference.tolerance(dtype) / 100)
    assert np.allclose(f.audit.auditor.ratios, t.audit.auditor.ratios, rtol=1e-2, atol=1e-2)
    key = lambda v: (v.site, v.step, v.row, v.position, v.aux, v.expected_token)  # noqa: E731
    assert sorted(map(key, f.violations)) == sorted(map(key, t.violations))
    assert f.violations or dtype == torch.bfloat16  # bf16's tolerance may hide this tiny model's fault
    assert f.stats()["write_slots_checked"] == t.stats()["write_slots_checked"] > 0


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_metadata_only_checks_audit_every_forward_without_an_internal_error(backend):
    """content="none" leaves the canary without a content layout; the write check's token budget
    comes from the engine's own cache rows, so the audit runs on every forward as with content."""
    model = tiny_model(seed=0, layers=2)
    ps = prompts(8, seed=4)
    gen, cb = cb_configs(max_new_tokens=8)
    cfg = CanaryConfig(mode="raise", content="none", audit_every=1, backend=backend)
    with torch.inference_mode(), protect(model, cfg) as g:
        model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
    st = g.stats()
    assert st["internal_errors"] == 0 and st["violations"] == 0
    assert st["content_bytes_verified"] == 0 and st["slots_verified"] > 0
    assert st["write_slots_checked"] > 0 and st["audit_queries"] > 0
