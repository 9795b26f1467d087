"""The scheduler's side of a forward: each request's real token stream, from SGLang's own request
state, into the adapter's token book.

In SGLang's scheduler process the batch the model worker runs (``ScheduleBatch``) holds the
requests in the order of the ``ForwardBatch``'s rows (``batch.reqs[r]`` is row ``r``). A request's
tokens are ``origin_input_ids + output_ids``: position ``p`` of its sequence holds that list's
``p``-th token for every ``p`` written so far (its ``fill_ids`` lag behind the outputs while it
decodes, so they are not read). A request aborted before it ran has its prompt replaced by a
one-token stub (SGLang makes its last prefill cheap that way): a stream that got shorter, or a
request about to finish by an abort, is read again from position 0.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kvcanary.engines.token_book import TokenBook


def tail(req: Any, have: int, upto: int) -> list[int]:
    """Request ``req``'s tokens at positions ``[have, upto)`` (``origin_input_ids + output_ids``)."""
    origin, out = req.origin_input_ids, req.output_ids
    n0 = len(origin)
    if have >= n0:
        return list(out[have - n0 : upto - n0])
    return list(origin[have : min(upto, n0)]) + list(out[: max(0, upto - n0)])


def book_rows(book: TokenBook, reqs: Sequence[Any], upto: Sequence[int]) -> torch.Tensor:
    """Bring each request's stream in ``book`` up to position ``upto[i]`` (the row's length after this
    forward) with one write, and return each request's row of the book (int64 ``[len(reqs)]``)."""
    items: list[tuple[str, int, list[int]]] = []
    for req, u in zip(reqs, upto):
        rid = req.rid
        have = book.have.get(rid, 0)
        if have and (req.to_finish is not None or len(req.origin_input_ids) + len(req.output_ids) < have):
            book.forget(rid)  # an abort may have replaced the prompt: the stream is read again
            have = 0
        if have < u:
            items.append((rid, have, tail(req, have, u)))
    book.extend_all(items)
    rows = [book.row.get(req.rid, TokenBook.BLANK) for req in reqs]
    return torch.tensor(rows, dtype=torch.int64)


def request_ids(reqs: Sequence[Any] | None, rows: int) -> list[str]:
    """The request id of each of a forward's ``rows`` (``""`` where the batch does not say)."""
    rids = [str(r.rid) for r in reqs] if reqs is not None else []
    return rids if len(rids) == rows else [""] * rows
