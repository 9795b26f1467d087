"""The SGLang adapter's engine-free parts on stand-in batches shaped as SGLang's (no SGLang here):
steps from a ForwardBatch and req_to_token, the token streams from request state, and which
requests a violation hurt. A canary over such steps verifies clean and finds a table entry off by
one."""

from array import array
from types import SimpleNamespace

import pytest
import torch

from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.engines.sglang.heal import FAIL, REDO, Heal, holders, reasons
from kvcanary.engines.sglang.scheduler import book_rows, request_ids, tail
from kvcanary.engines.sglang.steps import build_step
from kvcanary.engines.token_book import TokenBook
from kvcanary.errors import StepError, UnsupportedError
from kvcanary.violations import Check, Site, Violation


class Mode:
    def __init__(self, name):
        self.name = name

    def is_idle(self):
        return self.name == "IDLE"

    def is_decode(self):
        return self.name == "DECODE"


def t(x):
    return torch.tensor(x, dtype=torch.int64)


def extend(rpi, prefix, new, tokens, slots):
    """An EXTEND batch: row r has ``prefix[r]`` cached tokens and ``new[r]`` new ones."""
    pos = [p + i for p, n in zip(prefix, new) for i in range(n)]
    return SimpleNamespace(forward_mode=Mode("EXTEND"), batch_size=len(rpi), req_pool_indices=t(rpi),
                           seq_lens=t([p + n for p, n in zip(prefix, new)]), extend_prefix_lens=t(prefix).int(),
                           extend_seq_lens=t(new).int(), input_ids=t(tokens), positions=t(pos), out_cache_loc=t(slots))


def decode(rpi, seq, tokens, slots):
    return SimpleNamespace(forward_mode=Mode("DECODE"), batch_size=len(rpi), req_pool_indices=t(rpi),
                           seq_lens=t(seq), input_ids=t(tokens), positions=t([s - 1 for s in seq]),
                           out_cache_loc=t(slots))


def table_with(rows):
    table = torch.zeros((8, 16), dtype=torch.int32)
    for r, slots in rows.items():
        table[r, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return table


def test_an_extend_reads_its_prefix_and_writes_its_new_tokens():
    table = table_with({7: [1, 2, 3, 4, 5], 6: [1, 2, 9]})
    fb = extend([7, 6], [3, 2], [2, 1], [13, 14, 22], [4, 5, 9])
    step = build_step(fb, table)
    assert step.cached_lens.tolist() == [3, 2] and step.new_offsets.tolist() == [0, 2, 3]
    assert step.table_rows.tolist() == [7, 6] and step.new_slots.tolist() == [4, 5, 9]
    assert step.written_from.tolist() == [3, 2]  # no row reads what this step writes


def test_a_decode_reads_all_but_its_new_token():
    table = table_with({3: [1, 2, 3, 4]})
    step = build_step(decode([3], [4], [40], [4]), table)
    assert step.cached_lens.tolist() == [3] and step.new_positions.tolist() == [3]


def test_a_row_reading_a_slot_another_row_writes_is_verified_after_the_writes():
    table = table_with({1: [1, 2, 3], 2: [1, 2, 3, 4]})  # row 2's prefix holds slot 3, which row 1 writes now
    step = build_step(extend([1, 2], [2, 3], [1, 1], [12, 13], [3, 4]), table)
    assert step.written_from.tolist() == [2, 2]


def test_modes_the_adapter_does_not_describe_are_refused_by_name():
    fb = decode([1], [2], [5], [2])
    fb.forward_mode = Mode("TARGET_VERIFY")
    with pytest.raises(UnsupportedError, match="TARGET_VERIFY"):
        build_step(fb, table_with({}))
    fb.forward_mode = Mode("IDLE")
    assert build_step(fb, table_with({})) is None


def test_a_batch_of_unequal_token_tensors_is_refused():
    fb = decode([1, 2], [2, 3], [5, 6], [2])
    with pytest.raises(StepError, match="out_cache_loc"):
        build_step(fb, table_with({}))


def req(rid, origin, output=(), to_finish=None):
    return SimpleNamespace(rid=rid, origin_input_ids=list(origin), output_ids=array("q", output), to_finish=to_finish)


def test_a_stream_is_the_prompt_then_the_outputs():
    r = req("a", [10, 11, 12], [20, 21])
    assert tail(r, 0, 5) == [10, 11, 12, 20, 21]
    assert tail(r, 1, 2) == [11]  # a prefill chunk
    assert tail(r, 3, 5) == [20, 21] and tail(r, 2, 4) == [12, 20]


def test_the_book_grows_with_each_forward_and_rereads_a_stream_an_abort_replaced():
    book = TokenBook()
    a, b = req("a", [10, 11, 12]), req("b", [30, 31])
    rows = book_rows(book, [a, b], [3, 2])
    assert book.buf[rows[0], :4].tolist() == [10, 11, 12, -1] and book.buf[rows[1], :2].tolist() == [30, 31]
    a.output_ids.append(20)
    book_rows(book, [a], [4])
    assert book.buf[rows[0], :4].tolist() == [10, 11, 12, 20]
    a.origin_input_ids, a.output_ids = [0], array("q")  # SGLang's one-token stub of an aborted prompt
    rows = book_rows(book, [a], [1])
    assert book.buf[rows[0], :2].tolist() == [0, -1]
    assert request_ids([a, b], 2) == ["a", "b"] and request_ids(None, 2) == ["", ""]


def _violation(slot, request=None, row=-1, checks=Check.CONTENT, site=Site.SCRUB):
    return Violation(site, checks, 0, row, slot, 0, -1, -1, 0, 0, 0, 0, 0, -1, request=request)


def _step():
    table = table_with({1: [1, 2, 3], 2: [1, 5], 3: [6, 7]})
    return build_step(extend([1, 2, 3], [2, 1, 1], [1, 1, 1], [1, 2, 3], [3, 5, 7]), table)


def test_a_record_of_no_request_hurts_every_row_that_holds_its_slot():
    step = _step()
    assert holders(step, t([1])) == [0, 1]
    assert set(reasons([_violation(1)], step, ["a", "b", "c"])) == {"a", "b"}
    assert set(reasons([_violation(7, request="c")], step, ["a", "b", "c"])) == {"c"}
    # a slot found spoiled in an earlier forward hurts whoever reads it now
    assert set(reasons([], step, ["a", "b", "c"], poisoned=[5])) == {"b"}


def test_repair_recomputes_a_hurt_request_until_its_limit_then_fails_it():
    step, rids = _step(), ["a", "b", "c"]
    h = Heal("repair", limit=2)
    for _ in range(2):
        h.forward([_violation(6, request="c", site=Site.VERIFY)], step, rids)
        assert h.due == {"c": (REDO, h.due["c"][1])} and "CONTENT" in h.due["c"][1]
        h.due.clear()  # the scheduler settled it
    h.forward([_violation(6, request="c", site=Site.VERIFY)], step, rids)
    act, why = h.due["c"]
    assert act == FAIL and "again after 2 repairs" in why
    h.forget("c")
    assert "c" not in h.repairs
    q = Heal("quarantine", limit=2)
    q.forward([_violation(6, request="c", site=Site.VERIFY)], step, rids)
    assert q.due["c"][0] == FAIL


def test_named_slots_are_poisoned_until_freed_and_only_spoiled_bytes_hurt_other_readers():
    step, rids = _step(), ["a", "b", "c"]
    h = Heal("quarantine", limit=2)
    # a wrong position at slot 2: the reader's table may be what is wrong, so only the reader is hurt
    h.forward([_violation(2, request="a", checks=Check.POSITION, site=Site.VERIFY)], step, rids)
    assert set(h.due) == {"a"} and h.poisoned == {2} and not h.spoiled
    # changed bytes at slot 1: every row holding it is hurt (a and b read it)
    h.due.clear()
    h.forward([_violation(1, request="b", checks=Check.CONTENT, site=Site.VERIFY)], step, rids)
    assert set(h.due) == {"a", "b"} and h.spoiled == {1} and h.poisoned == {1, 2}
    # an attention mismatch names no slot to poison
    h.forward([_violation(7, request="c", checks=Check.ATTENTION, site=Site.AUDIT)], step, rids)
    assert h.poisoned == {1, 2} and h.due["c"][0] == FAIL
    h.freed(t([1, 2]))
    assert not h.poisoned and not h.spoiled
    assert h.counts["slots_poisoned"] == 2


def test_a_canary_over_these_steps_is_clean_and_finds_an_entry_off_by_one():
    config = CanaryConfig(mode="log", content="none", backend="torch")
    c = Canary(32, None, config)
    table = table_with({1: [1, 2, 3, 4], 2: [1, 2, 3, 9]})
    book = TokenBook()
    a, b = req("a", [10, 11, 12, 13]), req("b", [10, 11, 12, 14])
    rows = book_rows(book, [a], [4])
    first = build_step(extend([1], [0], [4], [10, 11, 12, 13], [1, 2, 3, 4]), table, book.buf, rows)
    c.before_forward(first)
    c.after_forward(first)
    rows = book_rows(book, [b], [4])  # a radix hit on a's first three slots
    hit = build_step(extend([2], [3], [1], [14], [9]), table, book.buf, rows)
    c.before_forward(hit)
    c.after_forward(hit)
    assert c.drain() == []
    table[2, 1] = 3  # off by one: position 1 now points at position 2's slot
    b.output_ids.append(50)
    rows = book_rows(book, [b], [5])
    table[2, 4] = 10
    nxt = build_step(decode([2], [5], [50], [10]), table, book.buf, rows)
    c.before_forward(nxt)
    c.after_forward(nxt)
    found = c.drain()
    assert found and any(v.position == 1 and v.slot == 3 and Check.POSITION in v.checks for v in found)
