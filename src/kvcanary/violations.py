"""Violation ring, counters and typed records.

Checks append rows of ``NUM_FIELDS`` int64 to a fixed-capacity ring on the pool's device and bump
a monotonic counter; row ``k`` goes to ``ring[k % capacity]``. The host drains rows it has not yet
seen; rows overwritten before they were drained are counted as lost, never dropped silently.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class Check(enum.IntFlag):
    """Which checks failed; a record's ``checks`` is a combination of these bits."""

    POSITION = 1  # the slot holds another position than the table says
    LINK = 2  # the slot's link does not follow from its predecessor's (foreign, stale or shifted slot)
    TOKEN = 4  # the slot holds another token than the request has at that position
    CONTENT = 8  # the slot's KV bytes changed since they were stamped
    EMPTY = 16  # the slot was never stamped (or was released) but is read
    BAD_SLOT = 32  # a table entry (verify) or a written slot (write) outside the pool
    WRITE_POSITION = 64  # a new token's position is not cached_len + its index in the row
    WRITE_TABLE = 128  # a new token was written to another slot than the table holds for its position
    WRITE_INPUT_TOKEN = 256  # a new token differs from the expected input stream
    WRITE_INPUT_POSITION = 512  # a new token's position differs from the expected input stream
    WRITE_DUPLICATE = 1024  # two tokens of one step wrote one slot (each is reported; the slot is left unstamped)
    PADDING_WRITE = 2048  # a padding token wrote a slot stamped for a live sequence, or a reserved slot
    WRITE_CONTENT = 4096  # the cache holds other K/V bytes at a new token's slot than the model computed
    ATTENTION = 8192  # the attention output differs from attention recomputed from the verified KV


class Site(enum.IntEnum):
    """Where a violation was found."""

    VERIFY = 0  # before a forward, on a slot the step reads
    WRITE = 1  # after a forward, on a slot the step wrote
    SCRUB = 2  # patrol scrub of cached slots
    TRANSFER = 3  # KV landed from another tier or machine, checked against its travelling stamps
    FIRST_READ = 4  # before a request's first read of KV another request wrote (a prefix-cache hit)
    GUARD = 5  # after a forward, on a guard slot: a reserved slot's bytes changed, or a guarded live slot's
    AUDIT = 6  # inside a forward: a sampled query's attention output, recomputed from the cache (kvcanary.audit)


# Field indices of a ring row.
(F_SITE, F_CHECKS, F_STEP, F_ROW, F_SLOT, F_POSITION, F_EXP_TOKEN, F_STORED_TOKEN, F_STORED_POSITION,
 F_EXP_LINK, F_STORED_LINK, F_EXP_CONTENT, F_STORED_CONTENT, F_AUX) = range(14)
NUM_FIELDS = 14


class Counter(enum.IntEnum):
    """Slots of the device counter vector."""

    STEPS = 0
    SLOTS_VERIFIED = 1
    LINKS_CHECKED = 2
    LINKS_UNCHECKED = 3  # window heads: their predecessor is not readable
    CONTENT_SLOTS_VERIFIED = 4
    CONTENT_SLOTS_SKIPPED = 5  # read this step but left out by the content budget
    CONTENT_BYTES_VERIFIED = 6
    SLOTS_STAMPED = 7
    CONTENT_BYTES_STAMPED = 8
    SLOTS_SCRUBBED = 9
    CONTENT_BYTES_SCRUBBED = 10
    VIOLATIONS = 11
    SLOTS_UNVERIFIABLE = 12  # read this step but in the unknown state (never seen written by this canary)
    SLOTS_VERIFIED_AFTER_WRITE = 13  # reads of slots the same step wrote, verified once they were stamped
    GUARD_CHECKS = 14  # guard slots fingerprinted (reserved and guarded live slots, every forward)


NUM_COUNTERS = len(Counter)


@dataclass(frozen=True)
class Violation:
    """One decoded violation. ``expected_*`` is what the step implies, ``stored_*`` the slot's stamp.

    ``row`` is the step row (-1 for scrub); ``position`` is the position the step implies for the
    slot (verify: the table's position; write: ``cached_len`` + the token's index in its row);
    ``stored_*`` are what the slot's stamp holds (write: what was just written). ``expected_link``
    and ``expected_content`` are 0 where that check did not run. ``aux`` is the predecessor slot
    (verify, -1 at a window or sequence head) or the slot the table maps the position to (write).

    The write check and the read audit (:mod:`kvcanary.audit`) fill the fields so: ``aux`` is the
    layer; ``expected_token`` the attention head (audit) or the first KV head whose bytes differ
    (write); ``stored_token`` which half differs (write: 1 K, 2 V, 3 both); ``expected_link`` the
    tolerance and ``stored_link`` the error, in millionths of the largest |V| read (audit);
    ``stored_position`` the block shift that explains the kernel's output, 0 where none does or
    none was tried (audit).
    """

    site: Site
    checks: Check
    step: int
    row: int
    slot: int
    position: int
    expected_token: int
    stored_token: int
    stored_position: int
    expected_link: int
    stored_link: int
    expected_content: int
    stored_content: int
    aux: int
    request: str | None = None  # the request behind the step row, where the engine adapter knows it
    group: str | None = None  # the layer group (canary) that found it, where there are several

    @classmethod
    def from_row(cls, r: list[int]) -> "Violation":
        (step, row, slot, position, exp_tok, tok, pos, exp_link, link, exp_cont, cont, aux) = r[F_STEP:NUM_FIELDS]
        return cls(Site(r[F_SITE]), Check(r[F_CHECKS]), step, row, slot, position, exp_tok, tok, pos, exp_link, link,
                   exp_cont, cont, aux)

    def describe(self) -> str:
        names = "|".join(c.name or "?" for c in Check if c in self.checks)
        if self.checks & (Check.WRITE_CONTENT | Check.ATTENTION):
            return self._describe_audit(names)
        where = f"row {self.row} " if self.row >= 0 else ""
        if self.request is not None:
            where = f"request {self.request} ({where.strip()}) " if where else f"request {self.request} "
        reserved = self.site == Site.GUARD and self.position < 0
        s = (
            f"[{self.site.name.lower()} step {self.step}] {names}: {where}slot {self.slot} "
            + ("(reserved)" if reserved else f"position {self.position}")
        )
        if Check.POSITION in self.checks or Check.EMPTY in self.checks:
            s += f" (slot holds position {self.stored_position})"
        if Check.TOKEN in self.checks or Check.WRITE_INPUT_TOKEN in self.checks:
            s += f" (token expected {self.expected_token}, got {self.stored_token})"
        if Check.WRITE_TABLE in self.checks:
            s += f" (table holds slot {self.aux})"
        if Check.CONTENT in self.checks:
            s += " (KV bytes changed since the canary first saw them)" if reserved else " (KV bytes changed since stamped)"
        if Check.PADDING_WRITE in self.checks:
            s += " (a padding token wrote it)"
        return s

    def _describe_audit(self, names: str) -> str:
        who = f"request {self.request} (row {self.row})" if self.request is not None else f"row {self.row}"
        head = f"[{self.site.name.lower()} step {self.step}] {names}: {who} layer {self.aux}"
        if Check.WRITE_CONTENT in self.checks:
            half = {1: "K", 2: "V", 3: "K and V"}.get(self.stored_token, "K/V")
            return (f"{head} position {self.position} slot {self.slot}: the cache holds other {half} bytes than the "
                    f"model computed (first differing KV head {self.expected_token})")
        out = (f"{head} head {self.expected_token} position {self.position}: the attention output is "
               f"{self.stored_link / 1e6:.3g} of max|V| away from attention over the verified KV "
               f"(tolerance {self.expected_link / 1e6:.3g})")
        if self.stored_position:
            out += f"; reading {abs(self.stored_position)} block(s) {'on' if self.stored_position > 0 else 'back'} explains it"
        return out

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["site"] = self.site.name.lower()
        d["checks"] = [c.name for c in Check if c in self.checks]
        return d


def append_rows(counters: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor) -> None:
    """Append violation ``rows`` (int64 ``[n, NUM_FIELDS]``) to ``ring`` (``[capacity, NUM_FIELDS]``)
    as the kernels do: row ``i`` ever recorded lands at ``i % capacity``; ``counters`` counts them."""
    n = rows.shape[0]
    if n == 0:
        return
    cap = ring.shape[0]
    start = int(counters[Counter.VIOLATIONS])
    if n > cap:  # only the last `capacity` rows can survive
        rows = rows[n - cap :]
        start += n - cap
    idx = torch.arange(start, start + rows.shape[0], device=rows.device) % cap
    ring[idx] = rows
    counters[Counter.VIOLATIONS] += n


class ViolationRing:
    """Device ring of violation rows plus the device counter vector.

    Parameters
    ----------
    capacity : rows the ring holds before old, undrained rows are overwritten (counted as lost)
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.rows = torch.zeros(capacity, NUM_FIELDS, dtype=torch.int64, device=device)
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=device)
        # a CPU ring's counters as numpy, made once: each drain reads one element of it (a torch call
        # per drain costs tens of microseconds right after an engine's forward)
        self._host = self.counters.numpy() if self.counters.is_cpu else None
        self.drained = 0
        self.lost = 0

    def count(self, counter: int) -> int:
        """One counter's value (a CPU ring's through its numpy view; a device ring's is read back)."""
        return int(self._host[counter] if self._host is not None else self.counters[counter])

    def append(self, rows: torch.Tensor) -> None:
        """Append int64 ``[n, NUM_FIELDS]`` rows (torch path; n is known on the host)."""
        append_rows(self.counters, self.rows, rows)

    def drain(self) -> list[Violation]:
        """Decode the rows written since the last drain (syncs with the device)."""
        total = self.count(Counter.VIOLATIONS)
        new = total - self.drained
        if new <= 0:
            return []
        keep = min(new, self.capacity)
        self.lost += new - keep
        first = total - keep
        idx = torch.arange(first, total) % self.capacity
        host = self.rows[idx.to(self.rows.device)].cpu().tolist()
        self.drained = total
        return [Violation.from_row(r) for r in host]

    def counter_values(self) -> dict[str, int]:
        vals = self.counters.cpu().tolist()
        return {c.name.lower(): int(vals[c]) for c in Counter}


@dataclass(frozen=True)
class Event:
    """The violations one step found for one reader: a site, a step, a layer group and a request
    (or step row), with every per-slot record kept in ``violations``.

    A burst of corrupted slots becomes one event (one log line), not one line per slot.
    """

    site: Site
    step: int
    group: str | None
    request: str | None
    row: int
    checks: Check
    violations: tuple[Violation, ...]
    diagnosis: Any = None  # a kvcanary.diagnosis.Diagnosis, where the reporter diagnosed it

    @property
    def slots(self) -> int:
        return len({v.slot for v in self.violations})

    def describe(self) -> str:
        names = "|".join(c.name or "?" for c in Check if c in self.checks)
        who = f"request {self.request}" if self.request is not None else (f"row {self.row}" if self.row >= 0 else "")
        grp = f" group {self.group}" if self.group is not None else ""
        first = self.violations[0]
        out = (f"[{self.site.name.lower()} step {self.step}{grp}] {who + ': ' if who else ''}{self.slots} slot(s) "
               f"failed {names}; first: {first.describe()}")
        return out if self.diagnosis is None else f"{out} -- {self.diagnosis.describe()}"


def events(violations: list[Violation]) -> list[Event]:
    """Group violations into events per (site, step, group, request or row), in order of first sight."""
    by: dict[tuple[object, ...], list[Violation]] = {}
    for v in violations:
        key = (v.site, v.step, v.group, v.request if v.request is not None else v.row)
        by.setdefault(key, []).append(v)
    out = []
    for vs in by.values():
        checks = Check(0)
        for v in vs:
            checks |= v.checks
        f = vs[0]
        out.append(Event(f.site, f.step, f.group, f.request, f.row, checks, tuple(vs)))
    return out
