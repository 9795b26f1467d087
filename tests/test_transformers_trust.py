"""transformers continuous batching: the canary never cries wolf and never harms the engine.

Hybrid models with forks, a warm engine, the canary's own failures (each internal function made to
raise, once and always), raise mode reaching the caller, quarantine, and misuse of protect().
"""

import logging
import random

import pytest
import torch
import transformers

from kvcanary import CanaryConfig, Check, ConfigError, KvCorruptionError, UnsupportedError
from kvcanary import canary as canary_mod
from kvcanary import checks
from kvcanary.engines import token_book
from kvcanary.engines import transformers as cb
from kvcanary.engines.transformers import hooks as cb_hooks
from kvcanary.engines.transformers import cb_configs, protect, tiny_model
from kvcanary.faults.transformers_cb import CbFault
from kvcanary.engines.transformers.compiled import StepBuilder
from kvcanary.fused import scrub as fused_scrub
from kvcanary.fused.forward import ForwardArgs
from kvcanary.violations import ViolationRing

from test_transformers import _cpu_offload_shim, prompts


@pytest.fixture(scope="module")
def llama():
    return tiny_model(seed=0, layers=2)


@pytest.fixture(scope="module")
def hybrid():
    torch.manual_seed(1)
    m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, use_sliding_window=True, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2))
    m.config._attn_implementation = "sdpa"
    return m.eval()


def run(model, ps, config=None, forks=1, sample=False, persistent=False, guard=None, **cbkw):
    gen, cbc = cb_configs(**cbkw)
    gen.num_return_sequences, gen.do_sample = forks, sample
    with torch.inference_mode():
        if config is None and guard is None:
            return model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc,
                                        persistent_manager=persistent), None
        with (guard or protect(model, config)) as g:
            out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc,
                                       persistent_manager=persistent)
    return out, g


def tokens(out):
    return {k: v.generated_tokens for k, v in out.items()}


def errors(out):
    return {k: v.error for k, v in out.items() if v.error is not None}


STRICT = CanaryConfig(mode="raise", content_budget_bytes=None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hybrid_model_with_forks_verifies_clean(hybrid, seed):
    # the sliding group reuses sectors a full-attention group freed; a fork copies a partial last
    # block: freed blocks must be released, so the copy carries no stale stamps
    rng = random.Random(seed)
    ps = [[rng.randrange(1000) for _ in range(rng.randint(10, 40))] for _ in range(12)]
    out, g = run(hybrid, ps, STRICT, forks=3, sample=True, max_new_tokens=24, num_blocks=16)  # seed 2 failed
    st = g.stats()
    assert st["violations"] == 0 and st["internal_errors"] == 0 and not errors(out)
    assert st["slots_scrubbed"] > 0  # fork copies were verified on landing


def test_warm_persistent_manager_reports_nothing_it_never_saw_written(llama):
    ps = prompts(12, seed=7)
    try:
        run(llama, ps, persistent=True)  # fills the prefix cache with no canary watching
        out, g = run(llama, ps, STRICT, persistent=True)
    finally:
        llama.destroy_cached_continuous_batching_manager()
    st = g.stats()
    assert st["violations"] == 0 and st["internal_errors"] == 0 and not errors(out)
    assert st["slots_unverifiable"] > 0  # the warm blocks were read, counted, not reported
    assert st["slots_verified"] > st["slots_unverifiable"]  # what was written under the canary is checked


# ---- the canary's own failures --------------------------------------------------------------

# every internal function the integration's hooks reach, by (owner, attribute)
INTERNALS = [
    (cb.Protection, "build_steps"), (cb.Protection, "ensure_groups"), (cb.Protection, "poll"),
    # a hook's body (kvcanary.engines.base.hook): what the shield around it runs
    (cb.Protection, "release_frees"), (cb.Protection.offloaded, "__wrapped__"),
    (cb.Protection.copied, "__wrapped__"), (cb.Protection.restored, "__wrapped__"), (cb.Protection, "_stamps_of"),
    (cb.Protection.before, "__wrapped__"), (cb.Protection.after_forward, "__wrapped__"),
    (token_book.TokenBook, "update"), (token_book.TokenBook, "forget_except"), (StepBuilder, "build"),
    (cb_hooks, "to_device"), (cb_hooks, "host_io"),
    (ForwardArgs, "before"), (ForwardArgs, "after"), (fused_scrub, "scrub"),
    (checks, "set_state"), (canary_mod.Canary, "export_stamps"), (canary_mod.Canary, "drain"),
    (ViolationRing, "drain"),
]  # the compiled entries of the CPU's default backend (fused); test_unknown fails the torch ones


def _failing(orig, times):
    calls = {"n": 0}

    def boom(*a, **k):
        calls["n"] += 1
        if times is None or calls["n"] <= times:
            raise RuntimeError("injected failure inside kvcanary")
        return orig(*a, **k)

    return boom, calls


@pytest.fixture(scope="module")
def busy_baseline(llama):
    """A run that frees, forks, offloads and restores: outputs without the canary."""
    ps = prompts(16, seed=5)
    mp = pytest.MonkeyPatch()
    _cpu_offload_shim(mp)
    try:
        out, _ = run(llama, ps, forks=2, max_new_tokens=24, num_blocks=16, cpu_offload_space=0.01)
    finally:
        mp.undo()
    return ps, tokens(out)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
@pytest.mark.parametrize("owner,name", INTERNALS, ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n in INTERNALS])
def test_an_internal_failure_never_reaches_the_engine_nor_turns_into_false_reports(
        llama, busy_baseline, monkeypatch, owner, name, times):
    ps, base = busy_baseline
    _cpu_offload_shim(monkeypatch)
    boom, calls = _failing(getattr(owner, name), times)
    monkeypatch.setattr(owner, name, boom)
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        out, g = run(llama, ps, CanaryConfig(mode="log"), forks=2, max_new_tokens=24, num_blocks=16,
                     cpu_offload_space=0.01)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    assert calls["n"] > 0, f"{name} was never reached: the test exercises nothing"
    assert tokens(out) == base and not errors(out)
    st = g.stats()
    assert st["internal_errors"] >= 1
    assert st.get("violations", 0) == 0 and not g.violations, [g.describe(v) for v in g.violations[:3]]


def test_a_raising_on_violation_callback_is_counted_in_log_mode(llama):
    ps = prompts(12, seed=6)
    base, _ = run(llama, ps)

    def bad_callback(found):
        raise ValueError("a user callback bug")

    f, out, g = faulted(llama, ps, "flip_shared_byte", "log", on_violation=bad_callback)
    assert f.injected_at is not None and g.violations
    assert not errors(out) and g.stats()["internal_errors"] >= 1


def faulted(model, ps, fault, mode, on_violation=None, **cfg):
    """A quiet run of ``ps`` under ``mode`` with ``fault`` injected at the third forward."""
    f = CbFault(fault, at=3, seed=1)
    g = protect(model, CanaryConfig(mode=mode, content_budget_bytes=None, **cfg), on_violation=on_violation)
    g.hooks.append(f)
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        out, g = run(model, ps, guard=g)
    finally:
        logging.getLogger("kvcanary").setLevel(logging.WARNING)
    return f, out, g


# ---- raise and quarantine ---------------------------------------------------------------------

def test_raise_mode_raises_in_the_callers_thread_after_recording(llama):
    seen = []
    f = CbFault("flip_shared_byte", at=3, seed=1)
    g = protect(llama, CanaryConfig(mode="raise", content_budget_bytes=None), on_violation=seen.extend)
    g.hooks.append(f)
    logging.getLogger("transformers").setLevel(logging.CRITICAL)
    try:
        with pytest.raises(KvCorruptionError) as ei:
            run(llama, prompts(24, seed=6), guard=g)
    finally:
        logging.getLogger("transformers").setLevel(logging.WARNING)
    err = ei.value
    assert err.violations and all(v.checks & Check.CONTENT for v in err.violations)
    assert err.requests and all(v.request in err.requests for v in err.violations)
    assert g.violations == err.violations == seen  # recorded and passed on before the raise
    assert f.detail["slot"] in {v.slot for v in err.violations}


def test_quarantine_fails_only_the_readers_and_evicts_the_poisoned_block(llama):
    ps = prompts(24, seed=6)
    base, _ = run(llama, ps)
    f, out, g = faulted(llama, ps, "flip_shared_byte", "quarantine")
    failed = errors(out)
    assert failed and set(failed) == set(g.quarantine.failed)
    assert all("KV" in e for e in failed.values())
    readers = {v.request for v in g.violations}
    assert readers <= set(failed)
    kept = {k: v for k, v in tokens(out).items() if k not in failed}
    assert kept and kept == {k: v for k, v in tokens(base).items() if k in kept}
    block = f.detail["block"]
    ledger = g.groups["full_attention"].allocator.ledger
    assert block not in ledger.block_to_hash  # no later request's prefix can match it


@pytest.mark.parametrize("fault", ["flip_shared_byte", "redirect_table_entry"])
def test_repair_computes_the_readers_again_and_every_output_is_a_clean_runs(llama, fault):
    """A flipped byte in a shared prefix block (every holder read it) and a redirected table entry
    (one reader): the requests that read corrupted KV are re-queued, their token from bad KV dropped,
    and every request finishes with exactly the tokens of a clean run; the poisoned bytes are never
    read again."""
    ps = prompts(24, seed=6)
    base, _ = run(llama, ps)
    f, out, g = faulted(llama, ps, fault, "repair")
    st = g.stats()
    assert f.injected_at is not None and g.violations
    assert not errors(out) and st["requests_failed"] == 0 and st["harmful_tokens"] == 0
    assert st["repairs"] >= len({v.request for v in g.violations if v.request})
    assert tokens(out) == tokens(base)
    # nothing read the poisoned bytes after the forward that found them, and the pool is clean now
    assert {v.step for v in g.violations} == {min(v.step for v in g.violations)}
    canary = g.groups["full_attention"].canary
    canary.scrub(torch.arange(canary.num_slots))
    assert canary.drain() == []


def test_repair_fails_a_request_that_recomputing_does_not_heal_after_the_limit(llama):
    """A block freed while still referenced keeps being handed out again (the allocator itself is
    wrong): the readers it keeps hurting fail after repair_limit repairs, with the evidence;
    the requests it never touched finish as in a clean run."""
    ps = prompts(24, seed=6)
    base, _ = run(llama, ps)
    f, out, g = faulted(llama, ps, "free_shared_block", "repair", repair_limit=1)
    failed = errors(out)
    assert failed and all("after 1 repairs" in e for e in failed.values()), failed
    hurt = {v.request for v in g.violations}
    kept = {k: v for k, v in tokens(out).items() if k not in hurt}
    assert kept and kept == {k: v for k, v in tokens(base).items() if k in kept}


# ---- misuse -------------------------------------------------------------------------------------

def test_nested_protect_is_refused_and_the_outer_guard_keeps_working(llama):
    with protect(llama, CanaryConfig(mode="log")) as outer:
        with pytest.raises(UnsupportedError, match="already protected"):
            with protect(llama, CanaryConfig(mode="log")):
                pass
        gen, cbc = cb_configs()
        with torch.inference_mode():
            llama.generate_batch(prompts(4, seed=1), generation_config=gen, continuous_batching_config=cbc)
    assert outer.stats()["slots_stamped"] > 0


def test_protect_refuses_what_it_cannot_protect(llama):
    with pytest.raises(UnsupportedError, match="expected a transformers model that runs continuous batching.*Linear"):
        protect(torch.nn.Linear(2, 2))
    base = transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UnsupportedError, match="got LlamaModel"):
        protect(base)
    with pytest.raises(ConfigError, match=r"config: expected a CanaryConfig, a mapping of its field names to values or None "
                       r"\(e.g. CanaryConfig\(mode='raise'\) or \{'mode': 'raise'\}\), got str 'raise'"):
        protect(llama, "raise")  # type: ignore[arg-type]


def test_a_burst_logs_one_line_per_step_and_request_with_its_id(llama, caplog):
    f = CbFault("redirect_table_entry", at=3, seed=1)
    g = protect(llama, CanaryConfig(mode="log", content_budget_bytes=None))
    g.hooks.append(f)
    with caplog.at_level(logging.WARNING, "kvcanary"):
        out, g = run(llama, prompts(24, seed=6), guard=g)
    assert f.injected_at is not None and not errors(out)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcanary" and "violation" in r.getMessage()]
    keys = {(v.step, v.group, v.request) for v in g.violations}
    assert len(g.violations) > len(keys) and len(lines) == len(keys)  # slots aggregated, records kept
    rid = f.detail["request"]
    mine = {v.slot for v in g.violations if v.request == rid}
    assert any(f"request {rid}: {len(mine)} slot(s) failed" in ln for ln in lines), lines


def test_the_violations_log_names_the_request(llama, tmp_path):
    from kvcanary import eventlog

    path = str(tmp_path / "v.jsonl")
    _, _, g = faulted(llama, prompts(24, seed=6), "flip_shared_byte", "log", violations_log=path)
    lines = eventlog.read(path)
    assert lines and {ln["request"] for ln in lines} == {v.request for v in g.violations}
    assert all(ln["engine"] == "transformers" and ln["group"] == "full_attention" for ln in lines)
    assert sum(len(ln["violations"]) for ln in lines) == len(g.violations)
