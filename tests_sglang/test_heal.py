"""The zoo's SGLang fault classes on the real engine, in ``quarantine`` and ``repair``: each is found in
the forward it strikes, named by the request that read it; ``quarantine`` fails that request (no
token computed from the bad KV reaches it) and ``repair`` computes it again to the output of a
clean run; the request beside it in the same forwards is untouched, its output a clean run's.

Classes (tests_sglang/control/ injects them, each into its own prompts): a flipped byte in a cached
prefix (Z16), a ``req_to_token`` entry off by one (Z14), a slot the radix cache still references
freed through the allocator (Z02, Z10), an aborted request's KV landing in another request's slot
(Z01, Z13), and on the torch-native attention, a cache write landing zeros (the write check) and an
attention output scaled in every layer (the read audit)."""

import asyncio
import random

import pytest

G = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
# kind -> (the fault's fields besides its prefix, whether it strikes a decode)
FAULTS = {
    "flip": {"position": 9, "layer": 1, "half": "v"},
    "shift": {"position": 11},
    "free_referenced": {"position": 5},
    "late_write": {"position": 7, "decode": True},
    "write_zeros": {"position": 3, "layer": 1, "decode": True},
    "attn_scale": {"position": 3, "decode": True},
}
EXPECTED = {"flip": "CONTENT", "shift": "POSITION", "free_referenced": "EMPTY", "late_write": "CONTENT",
            "write_zeros": "WRITE_CONTENT", "attn_scale": "ATTENTION"}


def _prompts(name):
    """A victim's and a bystander's prompt of their own (random tokens: no other test's prefix)."""
    rng = random.Random(name)
    return [rng.randrange(3, 1000) for _ in range(25)], [rng.randrange(3, 1000) for _ in range(21)]


def _aborted(engine, prompt):
    """A streaming request aborted after two chunks: its id."""

    async def go():
        gen = await engine.async_generate(input_ids=prompt, sampling_params={**G, "max_new_tokens": 100}, stream=True)
        rid, n = None, 0
        async for chunk in gen:
            rid, n = chunk["meta_info"]["id"], n + 1
            if n == 2:
                engine.tokenizer_manager.abort_request(rid=rid)
        return rid

    return asyncio.get_event_loop().run_until_complete(go())


@pytest.mark.parametrize("mode", ["quarantine", "repair"])
@pytest.mark.parametrize("kind", list(FAULTS))
def test_each_class_is_found_in_the_forward_it_strikes_and_healed(canary, kind, mode):
    victim, bystander = _prompts(f"{kind}-{mode}")
    clean = [o["output_ids"] for o in canary.engine.generate(input_ids=[victim, bystander], sampling_params=G)]
    fault = {"kind": kind, "prefix": victim[:20], **FAULTS[kind]}
    if kind == "late_write":
        fault["from_rid"] = _aborted(canary.engine, _prompts(f"aborted-{mode}")[0])
    before = canary.state()
    n = len(before["injected"])
    canary.command(mode=mode, fault=fault)
    try:
        outs = canary.engine.generate(input_ids=[victim, bystander], sampling_params=G)
        st = canary.state()
    finally:
        canary.command(mode="log")
    assert not st["errors"], st["errors"]
    faults = st["injected"][n:]
    assert len(faults) == 1 and faults[0]["kind"] == kind, faults
    f = faults[0]
    hit, other = outs
    assert f["rid"] == hit["meta_info"]["id"]
    struck = [v for e in canary.events() if e["step"] == f["forward"] for v in e["violations"]]
    named = [v for v in struck if v["request"] == f["rid"]]
    assert named and any(EXPECTED[kind] in v["checks"] for v in named), struck
    if mode == "quarantine":
        reason = hit["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "kvcanary" in reason["message"], reason
        assert f["rid"] in st["failed"]
        # no token sampled in or after the forward that read the bad KV
        assert hit["output_ids"] == clean[0][: len(hit["output_ids"])] and len(hit["output_ids"]) < len(clean[0])
    else:
        assert hit["output_ids"] == clean[0], (hit["output_ids"], clean[0])
        assert hit["meta_info"]["finish_reason"]["type"] == "length"
        assert st["stats"]["repairs"] > before["stats"]["repairs"] and f["rid"] not in st["failed"]
    assert other["output_ids"] == clean[1] and other["meta_info"]["finish_reason"]["type"] == "length"
    assert other["meta_info"]["id"] not in st["failed"]
    assert st["stats"]["internal_errors"] == before["stats"]["internal_errors"]
    # whatever the fault named left the radix cache: the prompt is served clean again
    again = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]
    assert again["output_ids"] == clean[0]
    assert not [e for e in canary.events() if e["step"] > f["forward"] and e["request"] == again["meta_info"]["id"]]


def test_repair_gives_up_on_a_request_that_reads_corrupted_kv_again_and_again(canary):
    victim, _ = _prompts("limit")
    clean = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]["output_ids"]
    before = canary.state()["stats"]
    # a table entry that stays wrong: every forward that reads position 11 from the cache reads it shifted
    canary.command(mode="repair", fault={"kind": "shift", "prefix": victim[:20], "position": 11, "repeat": 10})
    try:
        out = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]
        canary.command(fault=None)
        st = canary.state()
    finally:
        canary.command(mode="log")
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "again after 2 repairs" in reason["message"], reason
    assert st["stats"]["repairs"] - before["repairs"] == 2
    assert out["output_ids"] == clean[: len(out["output_ids"])]
    assert st["stats"]["internal_errors"] == before["internal_errors"]


@pytest.mark.parametrize("mode", ["quarantine", "repair"])
def test_a_request_hurt_in_the_middle_of_its_chunked_prefill_is_healed(canary, mode):
    """The fault strikes the first chunk of a prompt longer than the 64-token prefill chunk, while
    the scheduler holds the request as its chunked request: it is failed, or retracted and computed
    again to a clean run's output, and the engine goes on."""
    rng = random.Random(f"chunked-{mode}")
    prefix = [rng.randrange(3, 1000) for _ in range(40)]
    victim = prefix + [rng.randrange(3, 1000) for _ in range(130)]
    canary.engine.generate(input_ids=[prefix], sampling_params=G)  # the prefix is now in the radix cache
    clean = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]["output_ids"]
    canary.engine.generate(input_ids=[[rng.randrange(3, 1000) for _ in range(600)]],
                           sampling_params={**G, "max_new_tokens": 1})  # evicts the victim's own tail
    before = canary.state()
    n = len(before["injected"])
    canary.command(mode=mode, fault={"kind": "flip", "prefix": prefix[:20], "position": 30, "half": "k"})
    try:
        out = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]
        st = canary.state()
    finally:
        canary.command(mode="log")
    assert not st["errors"], st["errors"]
    f = st["injected"][n]
    assert f["rid"] == out["meta_info"]["id"]
    if mode == "repair":
        assert out["output_ids"] == clean and st["stats"]["repairs"] > before["stats"]["repairs"]
    else:
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    again = canary.engine.generate(input_ids=[victim], sampling_params=G)[0]
    assert again["output_ids"] == clean
    assert st["stats"]["internal_errors"] == before["stats"]["internal_errors"]
