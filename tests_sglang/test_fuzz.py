"""Randomized clean traffic on the canary's engines: nothing may be reported and every read is
verifiable. Each round sends requests concurrently (so prefills, prefill chunks and decodes share
forwards): prompts drawn over a few shared prefixes of random lengths (radix-cache hits; prompts
past the 64-token chunk are prefilled in chunks), random output lengths, ``n`` of 1 or 2, some
stopping at EOS, some aborted while they stream, and some cancelled and sent again at once while
others read the same prefix (the pattern of SGLang #23392); the small pool evicts and retracts.

CI runs a few fixed rounds on the Llama engine and on the Gemma2 engine (sliding-window layers,
whose windows the read audit recomputes); ``--fuzz ROUNDS`` (or ``KVCANARY_SGLANG_FUZZ=ROUNDS``) runs
a long one on each."""

import asyncio
import random

import pytest

FIXED = 3  # rounds CI runs on each engine


@pytest.fixture
def rounds(request):
    n = request.config.getoption("--fuzz")
    if not n:
        pytest.skip("the long randomized clean fuzz is off: pass --fuzz ROUNDS or set KVCANARY_SGLANG_FUZZ")
    return n


async def _streamed(engine, prompt, params, chunks):
    """Stream a request and cancel it after ``chunks`` chunks: its id."""
    gen = await engine.async_generate(input_ids=prompt, sampling_params=params, stream=True)
    rid = None
    async for chunk in gen:
        rid = chunk["meta_info"]["id"]
        chunks -= 1
        if chunks == 0:
            engine.tokenizer_manager.abort_request(rid=rid)
    return rid


async def _one(engine, rng, prefixes):
    prompt = rng.choice(prefixes)[: rng.randint(1, 60)] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))]
    params = {"temperature": 0, "max_new_tokens": rng.randint(1, 120), "ignore_eos": rng.random() < 0.3}
    if rng.random() < 0.15:
        params["n"] = 2
    roll = rng.random()
    if roll < 0.1 and "n" not in params:  # aborted after a few chunks
        await _streamed(engine, prompt, params, rng.randint(1, 4))
        return "aborted", 0
    if roll < 0.2 and "n" not in params:  # cancelled, then sent again at once (a client's retry)
        await _streamed(engine, prompt, params, rng.randint(1, 3))
        kind = "retried"
    else:
        kind = "done"
    out = await engine.async_generate(input_ids=prompt, sampling_params=params)
    outs = out if isinstance(out, list) else [out]
    return kind, sum(o["meta_info"].get("num_retractions", 0) for o in outs)


def _fuzz(c, rounds, seed):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(60)] for _ in range(4)]
    before = c.state()["stats"]
    events = len(c.events())
    loop = asyncio.get_event_loop()
    ran = []
    for _ in range(rounds):
        ran += loop.run_until_complete(asyncio.gather(*[_one(c.engine, rng, prefixes)
                                                          for _ in range(rng.randint(2, 16))]))
    kinds = [k for k, _ in ran]
    retracted = sum(r for _, r in ran)
    st = c.state()
    s = st["stats"]
    assert not st["errors"]
    assert s["violations"] == before["violations"] and len(c.events()) == events
    assert s["internal_errors"] == before["internal_errors"] and s["slots_unverifiable"] == before["slots_unverifiable"]
    assert s["slots_verified"] > before["slots_verified"] and "done" in kinds
    assert s["audit_queries"] > before["audit_queries"] and s["write_slots_checked"] > before["write_slots_checked"]
    print(f"fuzz: {rounds} rounds, {len(kinds)} requests ({kinds.count('aborted')} aborted, "
          f"{kinds.count('retried')} cancelled and retried), {retracted} retractions, "
          f"{s['forwards'] - before['forwards']} forwards, {s['slots_verified'] - before['slots_verified']} slots "
          f"verified, {s['audit_queries'] - before['audit_queries']} queries audited, 0 violations")
    return kinds


def test_a_few_fixed_rounds_are_clean(canary):
    kinds = _fuzz(canary, FIXED, 1238)
    assert {"aborted", "retried"} <= set(kinds)


def test_randomized_traffic_is_clean(canary, rounds):
    _fuzz(canary, rounds, 4321)


def test_sliding_window_traffic_is_clean(gemma2):
    kinds = _fuzz(gemma2, FIXED, 1243)
    assert {"aborted", "retried"} <= set(kinds)


def test_long_sliding_window_traffic_is_clean(gemma2, rounds):
    _fuzz(gemma2, rounds, 98)
