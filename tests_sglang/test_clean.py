"""With kvcanary on (KVCANARY_MODE=log, nothing in the engine's code), SGLang's greedy outputs are
those of the plain engine on the same fixed workload, nothing is reported, and the canary verified
the reads of every crossing the workload claims (radix-cache hits, chunked prefill, n > 1,
retraction, an abort)."""

import asyncio

import workload


def test_outputs_are_the_plain_engines_and_nothing_is_reported(canary, reference):
    ref_tokens, ref_meta = reference
    before = canary.state()["stats"]
    tokens, meta = workload.run(canary.engine)
    assert tokens == ref_tokens
    st = canary.state()
    s = st["stats"]
    assert st["mode"] == "log" and not st["errors"]
    assert s["violations"] == 0 and s["internal_errors"] == 0 and s["slots_unverifiable"] == 0
    assert canary.events() == []
    # the crossings happened: radix hits, chunked prefill, n=2, retraction
    assert all(m["cached_tokens"] == len(p) - 1 for m, p in zip(meta["shared_again"], workload.SHARED))
    assert all(m["cached_tokens"] >= 64 for m in meta["chunked_again"])
    assert len(tokens["n2"]) == 2
    assert sum(m.get("num_retractions", 0) for m in meta["pressure"]) > 0, "no retraction: the pool is too large"
    assert [m.get("num_retractions", 0) for m in meta["pressure"]] == \
        [m.get("num_retractions", 0) for m in ref_meta["pressure"]]
    # every read was verified, and the written slots were fingerprinted
    prompt_tokens = sum(len(p) for p in workload.SHARED) * 2 + sum(len(p) for p in workload.LONG) * 2
    assert s["slots_verified"] > prompt_tokens and s["content_bytes_stamped"] > 0
    assert s["slots_stamped"] > sum(len(t) for part in tokens.values() for t in part)
    assert s["forwards"] > before["forwards"]
    # the write check saw every new token of every layer, and the read audit ran on every forward
    forwards = s["forwards"] - before["forwards"]
    checked = s["write_slots_checked"] - before["write_slots_checked"]
    assert checked >= 2 * (s["slots_stamped"] - before["slots_stamped"])  # 2 layers
    assert s["audit_queries"] - before["audit_queries"] >= forwards


def test_an_aborted_request_leaves_nothing_to_report(canary, reference):
    ref_tokens, _ = reference
    prompt = workload.SHARED[0]

    async def go():
        gen = await canary.engine.async_generate(input_ids=prompt, sampling_params={**workload.GREEDY,
                                                                                   "max_new_tokens": 200}, stream=True)
        got = []
        async for chunk in gen:
            got = chunk["output_ids"] if "output_ids" in chunk else got
            if len(got) >= 3 and not aborted:
                aborted.append(True)
                canary.engine.tokenizer_manager.abort_request(rid=chunk["meta_info"]["id"])
            last = chunk
        return last

    aborted = []
    last = asyncio.get_event_loop().run_until_complete(go())
    assert aborted and last["meta_info"]["finish_reason"]["type"] == "abort"
    # the aborted request's KV went into the radix cache: the same prompt reads it, and verifies clean
    again = canary.engine.generate(input_ids=[prompt], sampling_params=workload.GREEDY)[0]
    assert again["output_ids"] == ref_tokens["shared"][0]
    s = canary.state()["stats"]
    assert s["violations"] == 0 and s["internal_errors"] == 0
    assert canary.events() == []
