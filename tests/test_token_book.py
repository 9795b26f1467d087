"""The token book: each request's known tokens by position, written a few at a time (decode) or as
one slice (a prompt, a prefill chunk), rows recycled, the buffer grown as streams lengthen."""

import random
from types import SimpleNamespace

import torch

from kvcanary.engines.token_book import TokenBook


def test_updates_and_extends_lay_out_every_stream_as_given():
    rng = random.Random(7)
    book, truth = TokenBook(), {}
    states = {}
    for step in range(40):
        # transformers-style states: a prompt, then generated tokens one (or a chunk) at a time
        for i in range(rng.randint(1, 20)):
            rid = f"t{i}"
            st = states.setdefault(rid, SimpleNamespace(request_id=rid, generated_tokens=[],
                                                        initial_tokens=[rng.randrange(999) for _ in range(rng.randint(1, 90))]))
            st.generated_tokens += [rng.randrange(999) for _ in range(rng.choice([1, 1, 3, 40]))]
            truth[rid] = st.initial_tokens + st.generated_tokens
        live = list(states.values())
        upto = [rng.randint(0, len(truth[s.request_id])) for s in live]
        got = book.streams(live, upto, max(upto + [1]))
        for row, (s, u) in enumerate(zip(live, upto)):
            want = truth[s.request_id][:u]
            assert got[row, :u].tolist() == want and bool((got[row, u:] == -1).all())
        # vLLM-style: (rid, start, tokens) records, some long
        items = []
        for i in range(rng.randint(0, 6)):
            rid = f"v{i}"
            have = len(truth.get(rid, []))
            new = [rng.randrange(999) for _ in range(rng.choice([1, 2, 17, 300]))]
            truth[rid] = truth.get(rid, []) + new
            items.append((rid, have, new))
        book.extend_all(items)
        for rid, _, _ in items:
            n = len(truth[rid])
            assert book.window([rid], [n], n)[0].tolist() == truth[rid] and book.have[rid] == n
    assert book.buf.shape[1] >= max(len(t) for t in truth.values())
    assert isinstance(book.buf, torch.Tensor)
