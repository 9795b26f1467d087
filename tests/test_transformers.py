"""transformers continuous batching under the canary: clean runs verify clean, outputs are
unchanged, injected faults are detected, offloaded blocks carry their stamps."""

import logging
import random
import types

import pytest
import torch
import transformers
from transformers.generation.continuous_batching import offloading_manager
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestState

from kvcanary import CanaryConfig, Check, Site, UnsupportedError
from kvcanary.engines.transformers import check_version, cb_configs, protect, tiny_model
from kvcanary.faults.transformers_cb import CbFault


def prompts(n=12, seed=0, prefix=24):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(prefix)] for _ in range(3)]
    return [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model(seed=0, layers=2)


def generate(model, ps, guard_config=None, hooks=(), **cb):
    gen, cbc = cb_configs(**cb)
    with torch.inference_mode():
        if guard_config is None:
            return model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc), None
        with protect(model, guard_config) as guard:
            guard.hooks.extend(hooks)
            out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cbc)
    return out, guard


def tokens(out):
    return {k: v.generated_tokens for k, v in out.items()}


def test_clean_prefix_sharing_and_identical_outputs(llama):
    ps = prompts()
    base, _ = generate(llama, ps)
    out, guard = generate(llama, ps, CanaryConfig(mode="raise", content_budget_bytes=None))
    assert tokens(out) == tokens(base)
    st = guard.stats()
    assert st["violations"] == 0 and st["internal_errors"] == 0
    assert st["slots_verified"] > 0 and st["content_bytes_verified"] > 0
    assert st["slots_stamped"] == sum(len(p) for p in ps) + sum(len(t) - 1 for t in tokens(out).values())


def test_the_engines_frees_are_released_together_and_verify_clean(llama, monkeypatch):
    """The engine frees blocks one call at a time (a finished request's, a prefix's duplicates): the
    protection notes them and releases them together at its next hook (one compiled loop a group),
    before that forward's reads are verified; freed blocks handed out again verify clean."""
    from kvcanary.canary import Canary
    from kvcanary.engines.transformers.entry import Protection

    frees, releases = [], []
    note, release = Protection.free_later, Canary.release_blocks
    monkeypatch.setattr(Protection, "free_later", lambda self, i, b: frees.append(len(b)) or note(self, i, b))
    monkeypatch.setattr(Canary, "release_blocks", lambda self, b, bs: releases.append(len(b)) or release(self, b, bs))
    ps = prompts(16, seed=4)
    base, _ = generate(llama, ps, max_new_tokens=12, num_blocks=16)
    out, guard = generate(llama, ps, CanaryConfig(mode="raise", content_budget_bytes=None), max_new_tokens=12,
                          num_blocks=16)
    assert tokens(out) == tokens(base)
    st = guard.stats()
    assert st["violations"] == 0 and st["internal_errors"] == 0
    assert 0 < len(releases) < len(frees)  # several frees released in one go
    assert sum(releases) <= sum(frees)  # (those freed after the last forward: at the run's end, exported too)
    assert not guard.frees  # none left behind


def test_sliding_window_and_hybrid_groups():
    for model in (tiny_model(seed=0, layers=2, sliding_window=12), _hybrid()):
        ps = prompts(8, seed=3)
        base, _ = generate(model, ps)
        out, guard = generate(model, ps, CanaryConfig(mode="raise", content_budget_bytes=None))
        assert tokens(out) == tokens(base)
        assert guard.stats()["violations"] == 0 and "sliding_attention" in guard.groups
        assert guard.stats()["links_unchecked"] > 0  # window heads: their predecessor left the window


def test_eviction_and_soft_reset_under_memory_pressure(llama, monkeypatch):
    resets = []
    orig = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: resets.append(1) or orig(self))
    ps = prompts(16, seed=4)
    base, _ = generate(llama, ps, max_new_tokens=24, num_blocks=14)
    out, guard = generate(llama, ps, CanaryConfig(mode="raise"), max_new_tokens=24, num_blocks=14)
    assert tokens(out) == tokens(base)
    assert guard.stats()["violations"] == 0 and resets


def _cpu_offload_shim(monkeypatch):
    """CPU builds of torch cannot pin memory; let the offloading manager allocate its swap pool plainly."""
    def empty(*a, pin_memory=False, **k):
        return torch.empty(*a, **k)
    monkeypatch.setattr(offloading_manager, "torch", types.SimpleNamespace(**{**vars(torch), "empty": empty}))


def test_offloaded_blocks_carry_stamps_and_torn_restore_is_caught(llama, monkeypatch):
    _cpu_offload_shim(monkeypatch)
    calls = {"offload": 0, "restore": 0}
    orig_off = offloading_manager.OffloadingManager._offload_to_cpu

    def count_off(self, *a):
        calls["offload"] += 1
        return orig_off(self, *a)

    monkeypatch.setattr(offloading_manager.OffloadingManager, "_offload_to_cpu", count_off)
    ps = prompts(16, seed=5)
    kw = dict(max_new_tokens=24, num_blocks=14, cpu_offload_space=0.01)
    base, _ = generate(llama, ps, **kw)
    out, guard = generate(llama, ps, CanaryConfig(mode="raise"), **kw)
    assert calls["offload"] > 0 and guard.stats()["slots_scrubbed"] > 0  # restores were verified
    assert guard.stats()["violations"] == 0
    assert tokens(out) == tokens(base)

    torn = {}

    def tear(prot, runner, batch):  # flip a byte of the host copy of the first offloaded block
        if torn or not prot.offloaded_stamps:
            return
        rid = next(iter(prot.offloaded_stamps))
        for m in _managers:
            blocks = m._request_id_to_cpu_blocks.get(rid)
            if blocks:
                name, ids = next(iter(blocks.items()))
                m._cpu_views[name][ids[0], 7] ^= 0x40
                torn["rid"] = rid

    _managers = []
    orig_init = offloading_manager.OffloadingManager.__init__

    def track(self, *a, **k):
        orig_init(self, *a, **k)
        _managers.append(self)

    monkeypatch.setattr(offloading_manager.OffloadingManager, "__init__", track)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    out, guard = generate(llama, ps, CanaryConfig(mode="log"), hooks=[tear], **kw)
    assert torn
    hits = [v for v in guard.violations if v.site == Site.TRANSFER]
    assert hits and all(v.checks == Check.CONTENT for v in hits)


@pytest.mark.parametrize("fault,checks", [
    ("flip_shared_byte", Check.CONTENT),
    ("redirect_table_entry", Check.POSITION | Check.LINK | Check.TOKEN),
    ("free_shared_block", Check.POSITION | Check.LINK | Check.TOKEN | Check.CONTENT),
])
def test_injected_faults_are_detected(llama, fault, checks):
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    f = CbFault(fault, at=3, seed=1)
    out, guard = generate(llama, prompts(24, seed=6), CanaryConfig(mode="log", content_budget_bytes=None), hooks=[f])
    assert f.injected_at is not None
    hits = [v for v in guard.violations if v.step >= f.injected_at and v.checks & checks]
    assert hits, guard.violations[:3]
    assert guard.request_of(hits[0]) is not None


def test_off_mode_leaves_the_engine_untouched(llama):
    original = ModelRunner.compute_batch
    with protect(llama, CanaryConfig(mode="off")):
        assert ModelRunner.compute_batch is original
    with protect(llama, CanaryConfig(mode="log")):
        assert ModelRunner.compute_batch is not original
    assert ModelRunner.compute_batch is original


@pytest.mark.parametrize("backend,mode,loads", [("auto", "log", True), ("fused", "raise", True),
                                               ("torch", "log", False), ("auto", "off", False)])
def test_protect_loads_the_compiled_loops_before_the_engines_first_forward(llama, monkeypatch, backend, mode, loads):
    """The groups' canaries are made in the engine's first forward; the compiled loops they run are
    loaded at protect(), so that forward does not pay for it (no first-run penalty)."""
    import kvcanary.fused

    calls = []
    monkeypatch.setattr(kvcanary.fused, "available", lambda: calls.append(1))
    with protect(llama, CanaryConfig(mode=mode, backend=backend)):
        assert bool(calls) == loads


def test_version_check():
    check_version(transformers.__version__)
    with pytest.raises(UnsupportedError, match=r"transformers 4.57.1 is not supported .* expected transformers>=5.24,<5.25"):
        check_version("4.57.1")


def test_decode_fast_path_steps_match_the_read_index_steps(llama):
    # on the decode fast path flash attention reads the cache through block tables; CPU builds
    # cannot run it, so every decode forward of a real run is also described as the fast path
    # would (its block table filled by the cache itself) and both steps must check alike
    from kvcanary import checks
    from kvcanary.engines.transformers.hooks import host_io
    from kvcanary.violations import NUM_COUNTERS

    seen = {"decodes": 0, "reported": 0}

    def compare(prot, runner, batch):
        reqs = list(host_io(runner.inputs_and_outputs).requests_in_batch)
        if not reqs or any(fs.query_length != 1 for fs in reqs):
            return
        allocs = runner.cache.cache_allocators
        width = 1 + max(len(a.block_table.get(fs.state.request_id, [])) for a in allocs.values() for fs in reqs)
        table = torch.full((len(allocs), len(reqs), width), -1, dtype=torch.int32)
        for i, fs in enumerate(reqs):
            runner.cache.fill_block_table(fs.state.request_id, fs.state.position_offset - 1, 1, table[:, i])
        by_index = prot.build_steps(runner, batch, reqs)
        fast = prot.build_steps(runner, {**batch, "block_table": table}, reqs)
        for name, g in prot.groups.items():
            stamps = g.canary.stamps.clone()
            stamps[int(fast[name].new_slots[0]) - 1, checks.POSITION] += 7  # a stale slot both must report
            out = []
            for step in (by_index[name], fast[name]):
                st, cnt = stamps.clone(), torch.zeros(NUM_COUNTERS, dtype=torch.int64)
                rows = checks.verify(st, g.canary.layout, step, cnt, torch.zeros(1, dtype=torch.int64), None, 0)
                rows = torch.cat([rows, checks.stamp(st, g.canary.layout, step, cnt, 0)])
                out.append((st, cnt, sorted(map(tuple, rows.tolist()))))
            assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]
            seen["reported"] += len(out[0][2])
        seen["decodes"] += 1

    out, guard = generate(llama, prompts(), CanaryConfig(mode="raise"), hooks=[compare])
    assert seen["decodes"] > 5 and seen["reported"] > 0 and guard.stats()["violations"] == 0


def test_token_book_streams_and_recycles_rows():
    from kvcanary.engines.token_book import TokenBook

    class S:
        def __init__(self, rid, init, gen):
            self.request_id, self.initial_tokens, self.generated_tokens = rid, init, gen

    book = TokenBook()
    a, b = S("a", [1, 2, 3], []), S("b", [9] * 300, [])
    assert book.streams([a, b], [3, 300], 301)[0, :4].tolist() == [1, 2, 3, -1]
    a.generated_tokens += [4, 5]
    got = book.streams([a], [5], 6)
    assert got.tolist() == [[1, 2, 3, 4, 5, -1]]
    row_a = book.row["a"]
    book.forget_except({"b"})
    c = S("c", [7], [])
    assert book.streams([c], [1], 2).tolist() == [[7, -1]] and book.row["c"] == row_a
    assert book.streams([b, c], [4, 1], 3).tolist() == [[9, 9, 9], [7, -1, -1]]  # a window narrower than a stream


def test_demo_main_job_reports_a_clean_run_and_every_injected_detection(capsys):
    from kvcanary.cli import main

    assert main(["demo", "--model", "tiny", "--layers", "2", "--inject", "--json"]) == 0
    out = __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["violations"] == 0 and out["outputs_identical"] is True and out["slots_verified"] > 0
    assert out["write_slots_checked"] > 0 and out["attention_queries_audited"] > 0  # the audit ran, clean
    assert [f["fault"] for f in out["injected"]] == ["flip_shared_byte", "redirect_table_entry", "free_shared_block"]
    assert all(f["detected"] and "request" in f["first_detection"] for f in out["injected"])


def test_forked_requests_carry_stamps_to_copied_blocks(llama, monkeypatch):
    from kvcanary.engines.transformers import Protection

    gen, cb = cb_configs(max_new_tokens=8)
    gen.num_return_sequences, gen.do_sample = 3, True
    rng = random.Random(0)
    ps = [[rng.randrange(1000) for _ in range(rng.randint(10, 30))] for _ in range(6)]

    def run():
        with torch.inference_mode(), protect(llama, CanaryConfig(mode="log", content_budget_bytes=None)) as guard:
            out = llama.generate_batch(ps, generation_config=gen, continuous_batching_config=cb)
        return out, guard

    out, guard = run()
    assert len(out) == 18 and guard.stats()["violations"] == 0
    assert guard.stats()["slots_scrubbed"] > 0  # the copied blocks were verified on landing
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    monkeypatch.setattr(Protection, "copied", lambda *a: None)  # without it, a fork reads unstamped copies
    _, blind = run()
    assert any(v.checks & (Check.EMPTY | Check.POSITION | Check.LINK) for v in blind.violations)


def _hybrid():
    """A Qwen2 model alternating sliding-window (12) and full-attention layers."""
    common = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(1)
    m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=12, layer_types=["sliding_attention", "full_attention"] * 2, **common))
    m.config._attn_implementation = "sdpa"
    return m.eval()


def _row_tokens(step):
    """int64 ``[R, max span]``: row ``r``'s expected token at positions ``[0, cached + new)``, -1 past them."""
    span = step.cached_lens.long() + (step.new_offsets[1:] - step.new_offsets[:-1]).long()
    w = int(span.max()) if step.num_rows else 0
    rows = step.expected_row_of(torch.arange(step.num_rows))
    et = step.expected_tokens
    pos = torch.arange(w)
    got = et[rows][:, pos.clamp(max=et.shape[1] - 1)].long()
    return torch.where((pos[None, :] < span[:, None]) & (pos[None, :] < et.shape[1]), got, -1)


@pytest.mark.parametrize("which", ["llama", "hybrid"])
def test_fused_step_building_equals_the_torch_construction(llama, which):
    """On a CPU pool the fused backend fills each forward's tables with compiled loops: every field
    of every group's step equals the torch construction's, on a run with shared prefixes, memory
    pressure and (hybrid) sliding-window groups."""
    seen = {"forwards": 0, "reads": 0}

    def compare(prot, runner, batch):
        from kvcanary.engines.transformers.hooks import host_io

        reqs = list(host_io(runner.inputs_and_outputs).requests_in_batch)
        if not reqs:
            return
        a = prot.build_steps(runner, batch, reqs)
        b = type(prot).build_steps.__globals__["build_steps"](prot.groups, prot.book, runner, batch, reqs, fused=False)
        assert a.keys() == b.keys()
        for name in a:
            # the expected tokens as each row sees them, at every position it reads or writes (a step
            # may read a token record in place through expected_rows, or hold its own copy)
            assert torch.equal(_row_tokens(a[name]), _row_tokens(b[name])), name
            for f in a[name].__dataclass_fields__:
                if f in ("expected_tokens", "expected_rows"):
                    continue
                x, y = getattr(a[name], f), getattr(b[name], f)
                if f == "slot_table" and x is not None:
                    # the compiled build rounds the width up (its buffers outlive a forward): the columns
                    # past the torch build's are -1; the torch build's scratch row and column are left out
                    r, w = a[name].num_rows, y.shape[1] - 1
                    assert bool((x[:r, w:] == -1).all()), (name, f)
                    x, y = x[:r, :w], y[:r, :w]
                if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                    assert x is not None and y is not None and torch.equal(x.long(), y.long()), (name, f)
                else:
                    assert x == y, (name, f)
            seen["reads"] += int((a[name].cached_lens - a[name].starts()).sum())
        seen["forwards"] += 1

    model = llama if which == "llama" else _hybrid()
    out, guard = generate(model, prompts(10, seed=4), CanaryConfig(mode="raise"), hooks=[compare], num_blocks=24)
    assert guard.groups and next(iter(guard.groups.values())).canary.backend == "fused"
    assert seen["forwards"] > 10 and seen["reads"] > 100 and guard.stats()["violations"] == 0


@pytest.mark.parametrize("budget", [128 << 10, 0], ids=["patrol", "no-patrol"])
def test_the_patrol_finds_a_flip_in_cold_cache_within_its_pass(llama, budget):
    """A bit flipped in a block the prefix cache keeps but no live request holds: no read finds it;
    the patrol scrub, a share of the pool per forward, does within one pass (``patrol_pass_steps``),
    and without the patrol nothing does."""
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    f = CbFault("flip_cold_byte", at=8, seed=1)
    ps = [p[: 10 + 3 * i] for i, p in enumerate(prompts(24, seed=3))]
    out, guard = generate(llama, ps, CanaryConfig(mode="log", patrol_budget_bytes=budget), hooks=[f],
                          max_new_tokens=24, num_blocks=128)
    st = guard.stats()
    assert f.injected_at is not None and f.detail["cold"]
    hits = [v for v in guard.violations if v.slot == f.detail["slot"]]
    if budget:
        assert 0 < st["patrol_pass_steps"] <= 32 and st["slots_scrubbed"] > 0
        assert st["forwards"] - f.injected_at > st["patrol_pass_steps"]  # the run outlasts one pass
        assert hits and hits[0].site == Site.SCRUB and all(v.checks == Check.CONTENT for v in hits)
        assert hits[0].step - f.injected_at <= st["patrol_pass_steps"]
    else:
        # (first reads of prefix hits re-fingerprint through the same op: slots_scrubbed counts them)
        assert st["patrol_pass_steps"] == 0 and not [v for v in hits if v.site == Site.SCRUB]


@pytest.mark.parametrize("mode", ["repair", "quarantine"])
def test_a_cold_block_the_patrol_finds_corrupted_never_serves_a_prefix_hit(llama, mode):
    """Healing modes: the patrol finds a flip in a cached block; the block leaves the prefix cache at
    once, so the later requests with its prefix compute it afresh and no read of it is ever reported.
    A request that had already taken the block (a prefix match, before its first read) is repaired
    or failed with the others' outputs a clean run's."""
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    ps = [p[: 10 + 3 * i] for i, p in enumerate(prompts(24, seed=3))]
    base, _ = generate(llama, ps, max_new_tokens=24, num_blocks=128)
    f = CbFault("flip_cold_byte", at=8, seed=1)
    out, guard = generate(llama, ps, CanaryConfig(mode=mode, patrol_budget_bytes=1 << 30), hooks=[f],
                          max_new_tokens=24, num_blocks=128)
    st = guard.stats()
    assert f.injected_at is not None and f.detail["cold"]
    assert guard.violations and {v.site for v in guard.violations} == {Site.SCRUB}
    failed = {k for k, o in out.items() if o.error}
    assert st["requests_failed"] == len(failed) and (mode == "quarantine" or not failed)
    kept = {k: t for k, t in tokens(out).items() if k not in failed}
    assert kept == {k: t for k, t in tokens(base).items() if k not in failed}


@pytest.mark.parametrize("first_read", [True, False], ids=["first-read-verified", "without"])
def test_a_prefix_hit_verifies_every_byte_of_the_blocks_before_its_first_read(llama, monkeypatch, first_read):
    """A byte of a cached prefix block flips just before a new request's first read of it (a
    prefix-cache hit). With no content window (budget 0) and no patrol, the first-read check still
    finds it in that forward, before the read (no harmful read), naming every request that hit it;
    without that check nothing finds it."""
    from kvcanary.engines import transformers as cb
    from kvcanary.engines.transformers.hooks import host_io
    from kvcanary.faults.transformers_cb import full_group

    if not first_read:
        monkeypatch.setattr(cb.Protection, "verify_first_reads", lambda self, *a: None)
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    hit = {}

    def flip_before_first_hit(prot, runner, batch):
        for fs in host_io(runner.inputs_and_outputs).requests_in_batch:
            past = fs.state.position_offset - fs.query_length
            if not hit and fs.state.request_id not in prot.seen and past >= 8 and prot.groups:
                g = full_group(prot)
                slot = g.allocator.block_table[fs.state.request_id][0] * g.block_size + 1
                g.canary.layout.sources[0].slot_bytes(slot)[0, 5] ^= 4
                hit.update(rid=fs.state.request_id, slot=slot, forward=prot.forwards)

    cfg = CanaryConfig(mode="log", content_budget_bytes=0, patrol_budget_bytes=0)
    out, guard = generate(llama, prompts(24, seed=6), cfg, hooks=[flip_before_first_hit], max_new_tokens=8,
                          num_blocks=128, max_requests_per_batch=4)
    assert hit, "no request hit a cached prefix"
    found = [v for v in guard.violations if v.slot == hit["slot"]]
    if not first_read:
        assert not found
        return
    assert found and all(v.site == Site.FIRST_READ and v.checks == Check.CONTENT for v in found)
    assert min(v.step for v in found) == hit["forward"]  # reported before the forward that reads it
    assert hit["rid"] in {v.request for v in found}  # each first reader is named (several may hit one block)


def test_a_write_into_the_read_trash_is_found_after_that_forward(llama):
    """Padding tokens read their KV from the read trash, which the engine never writes: a stray
    write into it (a padding write index left at 0) is found by the guards at the end of that forward,
    diagnosed as a padding write, and nothing is reported before it."""
    from kvcanary.faults.transformers_cb import full_group

    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    done = {}

    def write_read_trash(prot, runner, batch):
        if not done and prot.forwards == 5:
            g = full_group(prot)
            assert g.canary.layout.reserved == (0, 1) and g.canary.guard_slots == 3  # and the pool's last slot
            g.canary.layout.sources[1].slot_bytes(0)[0, 3] ^= 0x10
            done["forward"] = prot.forwards

    out, guard = generate(llama, prompts(8, seed=2), CanaryConfig(mode="log"), hooks=[write_read_trash],
                          max_new_tokens=8)
    from kvcanary.diagnosis import explain
    from kvcanary.violations import events

    assert done
    (ev,) = events(guard.violations)
    assert ev.site == Site.GUARD and [v.slot for v in ev.violations] == [0]
    assert ev.step == done["forward"]  # found at the end of that very forward
    d = explain(ev)
    assert d.kind == "padding_write" and "reserved" in d.evidence
    assert guard.stats()["guard_checks"] > 0


def test_a_padded_batch_reports_padding_writes_into_live_kv_only(llama):
    """A batch padded to a static size sends its padding tokens' writes to the write trash; the
    adapter passes the padded part of each write index to the canary, which reports a padding write
    that went to a live slot and ignores the trash."""
    from kvcanary.engines.transformers.steps import padding_writes
    from kvcanary.faults.transformers_cb import full_group

    seen = {}

    def capture(prot, runner, batch):
        if prot.forwards == 4 and not seen:
            steps = prot.build_steps(runner, batch)
            g = full_group(prot)
            live = int((g.canary.stamps[:, 1] >= 0).nonzero()[0])
            w = batch["write_index"][g.index]
            padded = {**batch, "write_index": [torch.cat([w, torch.tensor([g.trash, g.trash])]) for w in
                                               batch["write_index"]]}
            seen["trash"] = padding_writes(prot.groups, padded, steps)
            stray = torch.tensor([g.trash, (live // g.block_size) * g.pages.block_stride + live % g.block_size])
            padded["write_index"] = [torch.cat([w, stray]) for w in batch["write_index"]]
            seen["stray"] = padding_writes(prot.groups, padded, steps)
            seen["live"] = live
            seen["plain"] = padding_writes(prot.groups, batch, steps)

    generate(llama, prompts(6, seed=4), CanaryConfig(mode="log"), hooks=[capture], max_new_tokens=6)
    assert seen["plain"] == {}  # unpadded: no padding writes
    assert all(t.tolist() == [-1, -1] for t in seen["trash"].values())
    g = "full_attention" if "full_attention" in seen["stray"] else next(iter(seen["stray"]))
    assert seen["stray"][g].tolist() == [-1, seen["live"]]
    from kvcanary import Canary
    from kvcanary.step import Step

    t = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    c = Canary(64, config=CanaryConfig(mode="log"))
    c.stamps[9, 1] = 3
    c.after_forward(Step(slot_table=t(50)[None], cached_lens=t(0), new_offsets=t(0, 1), new_tokens=t(1),
                         new_positions=t(0), new_slots=t(50)), t(-1, 9))
    (v,) = c.poll()
    assert v.slot == 9 and v.checks == Check.PADDING_WRITE


class _NoDirectPath(list):
    """``hooks.KEEP`` that never holds a forward: every cache update looks its protection up."""

    def __getitem__(self, i):
        return None

    def __setitem__(self, i, v):
        pass


def test_the_per_layer_hooks_time_is_the_canarys(llama, monkeypatch):
    """Where the cache update looks its protection up (here every forward's, the direct path off),
    that lookup and the references to the layer's K and V are the canary's time, in its
    ``canary_us`` (here made 20 ms longer a call, so it shows)."""
    import time

    from kvcanary.engines.transformers import hooks

    calls = []
    real = hooks._by_tensor

    def slow(t):
        calls.append(1)
        time.sleep(0.02)
        return real(t)

    def run():
        return generate(llama, prompts(4), CanaryConfig(mode="raise"), max_new_tokens=4)[1].stats()["canary_us"]

    monkeypatch.setattr(hooks, "KEEP", _NoDirectPath([None]))
    run()  # warm
    base = run()
    monkeypatch.setattr(hooks, "_by_tensor", slow)
    slowed = run()
    assert calls and slowed - base >= 0.9 * 0.02e6 * len(calls)


def test_the_direct_paths_time_is_the_canarys_and_it_takes_every_layers_references(llama, monkeypatch):
    """A decode-sized forward keeps every layer's K and V for the write check after it: the cache
    update takes them directly (no protection looked up), and that time is the canary's too (each
    reference made 20 ms slower here); the write check reads them (every layer's writes checked)."""
    import time

    from kvcanary.engines.transformers import audit as cb_audit
    from kvcanary.engines.transformers import hooks

    calls, lookups = [], []

    class Slow(dict):
        def __setitem__(self, k, v):
            calls.append(k)
            time.sleep(0.02)
            super().__setitem__(k, v)

    def run():
        return generate(llama, prompts(4), CanaryConfig(mode="raise"), max_new_tokens=4)[1].stats()

    run()  # warm
    base = run()["canary_us"]
    made = cb_audit.CbAudit.__init__

    def init(self, prot):
        made(self, prot)
        self.stash = Slow()

    real = hooks._by_tensor
    monkeypatch.setattr(cb_audit.CbAudit, "__init__", init)
    monkeypatch.setattr(hooks, "_by_tensor", lambda t: lookups.append(1) or real(t))
    st = run()
    assert calls and st["canary_us"] - base >= 0.9 * 0.02e6 * len(calls)
    assert len(lookups) < len(calls)  # most layers' references were taken directly
    layers = llama.config.num_hidden_layers
    assert st["write_slots_checked"] > 0 and len(calls) % layers == 0


def test_a_cache_tensors_protection_is_remembered_until_it_changes(llama):
    from kvcanary.engines.transformers import hooks

    t, other = torch.zeros(4), torch.zeros(4)
    prot = object()
    hooks.protect_cache(t, prot)
    try:
        assert hooks._by_tensor(t) is prot and hooks._by_tensor(t) is prot  # the second from the memo
        assert hooks._by_tensor(other) is None
        hooks.protect_cache(t, None)
        assert hooks._by_tensor(t) is None  # the memo went with the change
        view = t[:2]  # another tensor on the same storage: the same pool
        hooks.protect_cache(t, prot)
        assert hooks._by_tensor(view) is prot
    finally:
        hooks.protect_cache(t, None)
