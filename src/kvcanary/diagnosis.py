"""Diagnosis in words: each violation event's most likely bug class, with its evidence, the
requests that read the bad slots, and each slot's last writer.

A small table of rules (:data:`RULES`), tried in order; the first whose evidence is present
names the event's class. The evidence comes from the event's own per-slot records (what the slot
holds against what the reader expected) and from the canary's record of each slot's last writer
(the step and step row that last wrote it; the engine adapters turn the row into a request id).

==================== ======================================================================
class                what it means (and the evidence that picks it)
==================== ======================================================================
transfer             a transfer landed nothing, torn bytes or another block's bytes: the
                     landed slots do not match the fingerprints that travelled with them
padding_write        a padding token wrote real or reserved KV: the engine's batch sends a
                     padding write to a slot stamped for a live sequence, or the bytes of a
                     reserved slot (null block, read-padding page) or of a guarded slot (the
                     pool's first or last: a zeroed or a wrapped -1 slot id) changed
write_position       a token was written at the wrong position or to another slot than the
                     table holds (write-site checks)
write_input          the forward wrote another token or position than the engine's input stream
bytes_changed        the slot's bytes changed after they were written: its stamp is intact
                     (position, link, token), only the fingerprint differs
table_shifted        the table is shifted at a block boundary: every bad slot holds the reader's
                     own sequence at one constant offset from the position it was read for
slot_reused          a slot still referenced was freed (read empty after a write of its own), or
                     reused: another request wrote it in the step just before the read
never_written        a read of a slot no write ever filled (its stamp is empty, no last writer)
foreign_slot         a table entry points at another request's slot: the slot holds another
                     sequence, written by another request earlier (not just now)
unclassified         none of the above: the failed checks are the evidence
==================== ======================================================================
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

from kvcanary.violations import Check, Event, Site, Violation

Writer = Callable[[Violation], "tuple[int, str] | None"]  # (step, who) of the slot's last write
Holders = Callable[[Violation], "list[str] | None"]  # requests whose tables hold the slot's block (None: unknown)


@dataclass(frozen=True)
class Diagnosis:
    """One event's diagnosis."""

    kind: str
    text: str  # the bug class in words
    evidence: str
    readers: tuple[str, ...]  # every request (or step row) whose attention read the bad slots
    writers: tuple[str, ...]  # the bad slots' last writers ("req_3 at step 12")

    def describe(self) -> str:
        out = f"likely {self.kind}: {self.text} ({self.evidence})"
        if self.readers:
            out += f"; read by {', '.join(self.readers[:8])}{' ...' if len(self.readers) > 8 else ''}"
        if self.writers:
            out += f"; last written by {', '.join(self.writers[:4])}{' ...' if len(self.writers) > 4 else ''}"
        return out

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _who(v: Violation) -> str:
    return v.request if v.request is not None else f"row {v.row} of step {v.step}"


META = Check.POSITION | Check.LINK | Check.TOKEN


def _transfer(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if ev.site == Site.TRANSFER and Check.CONTENT in ev.checks:
        return f"{ev.slots} landed slot(s) differ from the fingerprints that travelled with their stamps"
    return None


def _padding_write(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if ev.site == Site.WRITE and Check.PADDING_WRITE in ev.checks:
        v = next(x for x in ev.violations if Check.PADDING_WRITE in x.checks)
        if Check.BAD_SLOT in v.checks:
            return f"a padding token wrote slot {v.slot}, outside the pool"
        if v.stored_position >= 0:
            return (f"a padding token of step {ev.step} wrote slot {v.slot}, stamped for position {v.stored_position} "
                    f"of a live sequence ({ev.slots} such slot(s))")
        return f"a padding token of step {ev.step} wrote reserved slot {v.slot}"
    if ev.site == Site.GUARD and Check.CONTENT in ev.checks:
        v = ev.violations[0]
        what = ("reserved slot(s), which the engine never writes," if v.position < 0 else
                "guarded slot(s) (where a zeroed or a wrapped -1 slot id lands), with intact stamps,")
        return f"the bytes of {ev.slots} {what} changed by step {ev.step} (slot {v.slot})"
    return None


def _write_position(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    bad = Check.WRITE_POSITION | Check.WRITE_TABLE | Check.BAD_SLOT | Check.WRITE_DUPLICATE
    if ev.site == Site.WRITE and ev.checks & bad:
        v = next(x for x in ev.violations if x.checks & bad)
        if Check.WRITE_DUPLICATE in v.checks:
            return f"two tokens of one step wrote slot {v.slot}"
        if Check.WRITE_POSITION in v.checks:
            return f"a token written at position {v.stored_position} where the row's next is {v.position}"
        return f"written to slot {v.slot}, the table holds {v.aux} for position {v.position}"
    return None


def _write_input(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if ev.site == Site.WRITE and ev.checks & (Check.WRITE_INPUT_TOKEN | Check.WRITE_INPUT_POSITION):
        v = ev.violations[0]
        return f"position {v.position}: token {v.stored_token} written, the input stream has {v.expected_token}"
    return None


def _never_written(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    empty = [v for v, x in zip(ev.violations, w) if Check.EMPTY in v.checks and x is None]
    if empty and Check.EMPTY in ev.checks:
        return f"{len(empty)} slot(s) read with an empty stamp that no write of this canary's ever filled"
    return None


def _freed_under(ev: Event, w: list[tuple[int, str] | None], holders_of: Holders | None = None) -> str | None:
    freed = [(v, x) for v, x in zip(ev.violations, w) if Check.EMPTY in v.checks and x is not None]
    if holders_of is not None:  # the reader must still hold the freed block (else its table points elsewhere)
        freed = [(v, x) for v, x in freed if _who(v) in (holders_of(v) or [_who(v)])]
    if not freed:
        return None
    v, (step, who) = freed[0]
    return (f"slot {v.slot} was written by {who} at step {step}, then freed, while {_who(v)} still reads it "
            f"({len(freed)} such slot(s))")


def _bytes_changed(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if ev.checks == Check.CONTENT:
        return f"{ev.slots} slot(s) with intact position, link and token stamps whose KV fingerprint changed"
    return None


def _table_shifted(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    vs = [v for v in ev.violations if Check.POSITION in v.checks and v.stored_position >= 0]
    if not vs:
        return None
    # the most common offset (a rolled table wraps its last entries around)
    d, n = collections.Counter(v.stored_position - v.position for v in vs).most_common(1)[0]
    # the evidence: a bad slot holds the reader's own token of the position it holds
    expected = {v.position: v.expected_token for v in ev.violations if v.expected_token >= 0}
    own = [v for v in vs if v.stored_position - v.position == d and expected.get(v.stored_position, -1) == v.stored_token]
    if not own or 2 * n < len(vs):
        return None
    return (f"{n} of {len(vs)} bad slot(s) hold the reader's own sequence at positions {d:+d} from where they were read "
            f"(slot {own[0].slot}, read for position {own[0].position}, holds its token of position "
            f"{own[0].stored_position})")


def _foreign(ev: Event, w: list[tuple[int, str] | None], reuse: bool,
             holders_of: Callable[[Violation], list[str] | None] | None = None) -> str | None:
    if not ev.checks & META:
        return None
    pairs = [(v, x) for v, x in zip(ev.violations, w) if v.checks & META and x is not None and x[1] != _who(v)]
    if not pairs:
        return None
    v, (step, who) = pairs[0]
    holders = holders_of(v) if holders_of is not None else None
    if holders is not None:  # the engine's own tables: does the reader still hold the slot's block?
        reused = _who(v) in holders
        where = (f"its block is in the tables of {', '.join(sorted(holders)[:4])}" if reused else
                 f"the reader's table does not hold its block ({', '.join(sorted(holders)[:4]) or 'no one'} does)")
    else:  # no tables: a write just before the read points at a reuse
        reused = ev.step - step <= 1
        where = "the step before this read" if reused else f"{ev.step - step} steps before this read"
    if reused != reuse:
        return None
    return (f"slot {v.slot} holds position {v.stored_position} of another sequence, written by {who} at step {step}; "
            f"{where}")


def _write_content(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if Check.WRITE_CONTENT in ev.checks:
        v = next(x for x in ev.violations if Check.WRITE_CONTENT in x.checks)
        layers = sorted({x.aux for x in ev.violations if Check.WRITE_CONTENT in x.checks})
        return (f"{ev.slots} new token(s) whose cache rows differ from the K/V the model computed, in layer(s) "
                f"{', '.join(map(str, layers[:8]))} (first: position {v.position}, slot {v.slot})")
    return None


def _attention(ev: Event, w: list[tuple[int, str] | None]) -> str | None:
    if Check.ATTENTION in ev.checks:
        v = next(x for x in ev.violations if Check.ATTENTION in x.checks)
        out = (f"layer {v.aux} head {v.expected_token} position {v.position}: error {v.stored_link / 1e6:.3g} of the "
               f"largest |V| read, tolerance {v.expected_link / 1e6:.3g}; the table and the stamps are right")
        if v.stored_position:
            out += f"; the kernel's output is what reading every cached block {abs(v.stored_position)} page(s) " \
                   f"{'on' if v.stored_position > 0 else 'back'} gives"
        return out
    return None


def _plain(rule: Callable[[Event, list], str | None]) -> Callable[[Event, list, Holders | None], str | None]:
    return lambda e, w, h: rule(e, w)


RULES: tuple[tuple[str, str, Callable[[Event, list, Holders | None], str | None]], ...] = (
    ("transfer", "a transfer landed nothing or the wrong bytes", _plain(_transfer)),
    ("cache_write", "the cache write landed other bytes than the model computed", _plain(_write_content)),
    ("kernel_read", "the attention kernel computed another output than the verified KV gives (its own addressing, "
     "layout, scale, mask or softmax)", _plain(_attention)),
    ("padding_write", "a padding write landed in real or reserved KV", _plain(_padding_write)),
    ("write_position", "a write at the wrong position or slot", _plain(_write_position)),
    ("write_input", "the forward wrote other tokens than its input", _plain(_write_input)),
    ("bytes_changed", "the KV bytes changed after they were written", _plain(_bytes_changed)),
    ("table_shifted", "the block table is shifted at a block boundary", _plain(_table_shifted)),
    ("slot_reused", "a slot still referenced was freed (and is handed out again)", _freed_under),
    ("slot_reused", "a slot still referenced was reused by another request", lambda e, w, h: _foreign(e, w, True, h)),
    ("foreign_slot", "a table entry points at another request's slot", lambda e, w, h: _foreign(e, w, False, h)),
    ("never_written", "a read of a never-written slot", _plain(_never_written)),
)


def explain(ev: Event, writer_of: Writer | None = None, readers: Iterable[str] = (),
            holders_of: Holders | None = None) -> Diagnosis:
    """The diagnosis of one event: the first rule of :data:`RULES` whose evidence is present."""
    w = [writer_of(v) if writer_of is not None else None for v in ev.violations]
    writers = tuple(dict.fromkeys(f"{x[1]} at step {x[0]}" for x in w if x is not None))
    rs = tuple(dict.fromkeys(readers)) or (_who(ev.violations[0]),)
    for kind, text, rule in RULES:
        evidence = rule(ev, w, holders_of)
        if evidence is not None:
            return Diagnosis(kind, text, evidence, rs, writers)
    names = "|".join(c.name or "?" for c in Check if c in ev.checks)
    return Diagnosis("unclassified", "no rule matched", f"failed {names}", rs, writers)


def annotate(evs: list[Event], writer_of: Writer | None = None, holders_of: Holders | None = None) -> list[Event]:
    """``evs`` with their diagnoses; an event's readers are every request of any event of the batch
    that read one of its slots (in the same layer group), not only its own."""
    by_slot: dict[tuple[object, int], list[str]] = {}
    for ev in evs:
        for v in ev.violations:
            if v.site in (Site.VERIFY, Site.FIRST_READ):
                by_slot.setdefault((v.group, v.slot), []).append(_who(v))
    out = []
    for ev in evs:
        readers = [r for v in ev.violations for r in by_slot.get((v.group, v.slot), [])]
        out.append(dataclasses.replace(ev, diagnosis=explain(ev, writer_of, readers, holders_of)))
    return out
