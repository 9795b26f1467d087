"""The token book: each request's known tokens by position, written a few at a time (decode) or as
one slice (a prompt, a prefill chunk), rows recycled, the buffer grown as streams lengthen."""

import random
from types import SimpleNamespace

import torch

from kvcanary.engines.token_book import TokenBook


def _grow(rng, states, most, prompt_most, runs):
    """transformers-style request states: up to ``most`` requests, each a prompt then generated
    tokens a few (or a chunk) at a time; the ones that grew this call."""
    grown = []
    for i in range(rng.randint(1, most)):
        rid = f"t{i}"
        st = states.setdefault(rid, SimpleNamespace(request_id=rid, generated_tokens=[],
                                                    initial_tokens=[rng.randrange(999) for _ in range(rng.randint(1, prompt_most))]))
        st.generated_tokens += [rng.randrange(999) for _ in range(rng.choice(runs))]
        grown.append(st)
    return grown


def test_updates_and_extends_lay_out_every_stream_as_given():
    rng = random.Random(7)
    book, truth = TokenBook(), {}
    states = {}
    for step in range(40):
        for st in _grow(rng, states, 20, 90, [1, 1, 3, 40]):
            truth[st.request_id] = st.initial_tokens + st.generated_tokens
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


def test_a_device_mirror_gets_only_what_changed_and_always_equals_the_record(monkeypatch):
    """The copy of the record a CUDA pool's steps read (here a second CPU tensor, through the same
    code): after random updates, extends, recycled rows and growth it equals the record, and between
    two forwards it is sent only the entries written in between, not the record."""
    from kvcanary.engines import token_book

    sent = []
    real = token_book._sent
    monkeypatch.setattr(token_book, "_sent", lambda host, device: sent.append(host.numel()) or real(host, device))
    rng = random.Random(3)
    book, dev = TokenBook(), torch.device("cpu")
    states = {}
    for step in range(60):
        _grow(rng, states, 12, 40, [1, 1, 2, 20])
        live = list(states.values())
        shape = book.buf.shape
        new = sum(len(s.initial_tokens) + len(s.generated_tokens) - book.have.get(s.request_id, 0) for s in live)
        book.update(live, [len(s.initial_tokens) + len(s.generated_tokens) for s in live])
        if rng.random() < 0.2:  # a request leaves; its row is recycled with stale tokens cleared
            gone = rng.choice(live).request_id
            book.forget(gone)
            del states[gone]
        sent.clear()
        mirror = book._synced(dev)
        assert mirror is not book.buf and torch.equal(mirror, book.buf), step
        assert bool((book.buf[TokenBook.BLANK] == -1).all())
        if step and book.buf.shape == shape:  # unchanged shape: the forward's writes only (3 int64 per entry)
            assert sum(sent) <= 3 * (new + book.buf.shape[1]), (sum(sent), new)
            assert sum(sent) < book.buf.numel() or new * 3 >= book.buf.numel()
    assert book.on("cpu") is book.buf
