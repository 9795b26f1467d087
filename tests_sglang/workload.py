"""The fixed workload the SGLang tests run on an engine without the canary and on one with it: each
part crosses one engine path the canary must verify clean, and :func:`run` returns every request's
greedy tokens and what SGLang says it did (``meta_info``)."""

PREFIX = list(range(100, 132))  # 32 tokens shared by the shared-prefix prompts
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SHARED = [PREFIX + [300 + i, 400 + i, 500 + i] for i in range(3)]
LONG = [list(range(600, 750)), list(range(600, 700)) + list(range(800, 840))]  # over the 64-token prefill chunk
# enough tokens between them to overrun a pool of 1024 slots: without ignore_eos, and with SGLang's
# new-token ratio at 0.01 (conftest), the scheduler admits them all and then retracts decodes
PRESSURE = [[40 + j] + list(range(200 + 9 * j, 230 + 9 * j)) for j in range(10)]
PRESSURE_PARAMS = {"temperature": 0, "max_new_tokens": 90}


def _gen(engine, prompts, params):
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [o["output_ids"] for o in outs], [o["meta_info"] for o in outs]


def run(engine):
    """``(tokens, meta)``: per part, each request's output token ids and its ``meta_info``."""
    parts = {
        "shared": (SHARED, GREEDY),  # a prefill whose prompts share 32 tokens (deduplicated after)
        "shared_again": (SHARED, GREEDY),  # the same prompts served from the radix cache
        "chunked": (LONG, GREEDY),  # chunked prefill (the second prompt shares 100 tokens)
        "chunked_again": (LONG, GREEDY),  # radix hits on chunk-checkpointed prompts
        "n2": ([PREFIX + [7, 8]], {**GREEDY, "n": 2}),  # parallel sampling: children of one cached prompt
        "pressure": (PRESSURE, PRESSURE_PARAMS),  # retraction under memory pressure, then re-prefill
    }
    tokens, meta = {}, {}
    for name, (prompts, params) in parts.items():
        tokens[name], meta[name] = _gen(engine, prompts, params)
    return tokens, meta
