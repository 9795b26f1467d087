"""A longer randomized clean run on the canary's engine, behind a flag: ``--fuzz ROUNDS`` (or
``KVCANARY_SGLANG_FUZZ=ROUNDS``). Each round sends requests concurrently (so prefills, prefill chunks
and decodes share forwards): prompts drawn over a few shared prefixes of random lengths, random
output lengths, ``n`` of 1 or 2, some stopping at EOS, some aborted while they stream; the small pool
evicts and retracts. Nothing may be reported, and every read is verifiable."""

import asyncio
import random

import pytest


@pytest.fixture
def rounds(request):
    n = request.config.getoption("--fuzz")
    if not n:
        pytest.skip("the randomized clean fuzz is off: pass --fuzz ROUNDS or set KVCANARY_SGLANG_FUZZ")
    return n


async def _one(engine, rng, prefixes):
    prompt = rng.choice(prefixes)[: rng.randint(1, 60)] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))]
    params = {"temperature": 0, "max_new_tokens": rng.randint(1, 120), "ignore_eos": rng.random() < 0.3}
    if rng.random() < 0.15:
        params["n"] = 2
    if rng.random() < 0.1 and "n" not in params:  # aborted after a few chunks
        gen = await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True)
        k = rng.randint(1, 4)
        async for chunk in gen:
            k -= 1
            if k == 0:
                engine.tokenizer_manager.abort_request(rid=chunk["meta_info"]["id"])
        return "aborted", 0
    out = await engine.async_generate(input_ids=prompt, sampling_params=params)
    outs = out if isinstance(out, list) else [out]
    return "done", sum(o["meta_info"].get("num_retractions", 0) for o in outs)


def test_randomized_traffic_is_clean(canary, rounds):
    rng = random.Random(1234)
    prefixes = [[rng.randrange(3, 1000) for _ in range(60)] for _ in range(4)]
    before = canary.state()["stats"]
    events = len(canary.events())
    loop = asyncio.get_event_loop()
    ran = []
    for _ in range(rounds):
        ran += loop.run_until_complete(asyncio.gather(*[_one(canary.engine, rng, prefixes)
                                                          for _ in range(rng.randint(2, 16))]))
    kinds = [k for k, _ in ran]
    retracted = sum(r for _, r in ran)
    st = canary.state()
    s = st["stats"]
    assert not st["errors"]
    assert s["violations"] == before["violations"] and len(canary.events()) == events
    assert s["internal_errors"] == 0 and s["slots_unverifiable"] == before["slots_unverifiable"]
    assert s["slots_verified"] > before["slots_verified"] and "done" in kinds
    print(f"fuzz: {rounds} rounds, {len(kinds)} requests ({kinds.count('aborted')} aborted), "
          f"{retracted} retractions, {s['forwards'] - before['forwards']} forwards, {s['slots_verified'] - before['slots_verified']} slots "
          f"verified, 0 violations")
