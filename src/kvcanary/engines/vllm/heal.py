"""Healing on vLLM: the requests that read corrupted KV are recomputed (``repair``) or failed
(``quarantine``), and blocks whose bytes changed leave the prefix cache.

Both modes go through vLLM's own path for KV that failed to load: in the forward where the canary
finds corruption, the worker connector returns the bad block ids
(``get_block_ids_with_load_errors``), and vLLM's scheduler drops that forward's output for every
running request whose computed blocks hold one, then, under ``kv_load_failure_policy``
``"recompute"`` (``repair``), truncates each to its first bad block and computes it again, or under
``"fail"`` (``quarantine``) fails it and evicts the bad blocks and their dependents from the prefix
cache. So no token computed from corrupted KV leaves the engine.

Which block a report names, so that exactly the hurt requests are hit:

- the reader's slot is where the scheduler's table says (the block's bytes or stamps are wrong):
  that block, which every request holding it reads;
- the worker read a block the scheduler never gave that request (a redirected or stale table
  entry): the reader's own block at that position, or its first unshared block after it, so that
  healthy requests sharing its prefix are not hit; the reader recomputes from there;
- the patrol scrub or a guard found a block's bytes changed: that block (its running holders are
  hit), and it is evicted from the prefix cache through the scheduler side, so a cold corrupted
  block never serves a later prefix hit.

The bound: a request repaired more than ``repair_limit`` times (a table that keeps pointing at the
wrong block is not fixed by recomputing) fails, with the evidence, through the scheduler side.

vLLM refuses block-level failures when a model has several KV cache groups (block ids are not
unique to a group there); with several groups both modes fail the requests that read corrupted KV
through the scheduler side instead, one step later (repair cannot recompute there: it says so once
at start).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvcanary.engines.vllm.steps import ReqStep
from kvcanary.errors import ConfigError
from kvcanary.violations import Check, Site, Violation

log = logging.getLogger("kvcanary")
HEAL_MODES = ("quarantine", "repair")
POLICY = {"quarantine": "fail", "repair": "recompute"}  # each mode's kv_load_failure_policy


def check_policy(mode: str, kv_transfer_config: Any) -> None:
    """Refuse a canary mode that contradicts the ``kv_load_failure_policy`` of the same
    ``--kv-transfer-config`` (vLLM's default policy is ``"fail"``)."""
    if mode not in POLICY:
        return
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail") or "fail"
    if policy != POLICY[mode]:
        raise ConfigError(
            f"kvcanary mode {mode!r} needs kv_load_failure_policy {POLICY[mode]!r} in --kv-transfer-config "
            f"(vLLM {'recomputes' if mode == 'repair' else 'fails'} the requests that read corrupted KV through it), "
            f"got {policy!r}")


@dataclass
class HealReport(KVConnectorWorkerMetadata):
    """What a forward's workers ask of the scheduler side: requests to fail, blocks to evict."""

    fail: dict[str, str] = field(default_factory=dict)  # request id -> the evidence
    evict: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, HealReport):
            self.fail.update(other.fail)
            self.evict |= other.evict
        return self


class WorkerHeal:
    """One worker's healing state: turns each forward's violations into bad block ids and a
    :class:`HealReport`."""

    def __init__(self, mode: str, limit: int, block_level: bool) -> None:
        self.mode, self.limit, self.block_level = mode, limit, block_level
        self.repairs: dict[str, int] = {}  # request id -> repairs so far
        self.failing: set[str] = set()  # requests failed, until vLLM says they finished
        self.invalid: set[int] = set()
        self.release: set[int] = set()  # poisoned blocks whose stamps go (evicted, or to be recomputed)
        self.report = HealReport()
        self.counts = {"repairs": 0, "requests_failed": 0, "blocks_evicted": 0}

    def forward(self, found: list[Violation], reqs: dict[str, ReqStep], block_size: int, num_slots: int) -> None:
        """Take one forward's violations (of the primary group when ``block_level``): ``reqs`` are
        the forward's requests by id, with the scheduler's blocks."""
        hurt: dict[str, Violation] = {}
        stuck: set[str] = set()  # hurt requests no block of their own can be named for
        for v in found:
            block = v.slot // block_size if 0 <= v.slot < num_slots and not v.checks & Check.BAD_SLOT else -1
            if v.request is not None:  # a reader, or a writer whose KV went astray
                hurt.setdefault(v.request, v)
                if not self._add(_named_block(v, reqs.get(v.request), block, block_size)):
                    stuck.add(v.request)
                if not self.block_level and v.checks & Check.CONTENT and block > 0:
                    self.report.evict.add(block)  # vLLM's fail policy would evict it; here the scheduler side does
            elif v.site in (Site.SCRUB, Site.GUARD) and v.checks & Check.CONTENT and block > 0:
                self._add(block)
                self.report.evict.add(block)
                self.release.add(block)  # found once: its holders compute it again, no one else reads it
        for rid, v in hurt.items():
            if rid in self.failing:  # failed already: its outputs are dropped until the scheduler ends it
                continue
            healable = self.block_level and rid not in stuck
            if self.mode == "repair" and healable:
                n = self.repairs[rid] = self.repairs.get(rid, 0) + 1
                if n <= self.limit:
                    self.counts["repairs"] += 1
                    continue
                why = f"request {rid} read corrupted KV again after {self.limit} repairs: {v.describe()}"
            else:
                why = f"request {rid} read corrupted KV: {v.describe()}"
            if self.mode == "repair" or not healable:  # else vLLM's fail policy fails it
                self.report.fail[rid] = why
            self.failing.add(rid)
            self.counts["requests_failed"] += 1

    def _add(self, block: int | None) -> bool:
        if block is not None and block > 0 and self.block_level:  # block 0 is the null block
            self.invalid.add(block)
            return True
        return False

    def take_release(self) -> list[int]:
        out, self.release = sorted(self.release), set()
        return out

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_report(self) -> HealReport | None:
        out, self.report = self.report, HealReport()
        self.counts["blocks_evicted"] += len(out.evict)
        return out if out.fail or out.evict else None

    def forget(self, rid: str) -> None:
        """Request ``rid`` finished."""
        self.repairs.pop(rid, None)
        self.failing.discard(rid)


def _named_block(v: Violation, req: ReqStep | None, block: int, block_size: int) -> int | None:
    """The block a reader's violation is reported under (see the module docstring)."""
    if req is None or not req.blocks or v.position < 0:
        return block if block > 0 else None
    i = v.position // block_size
    if i < len(req.blocks) and req.blocks[i] == block:
        return block
    j = max(i, req.private_from)
    if j < len(req.blocks):
        return req.blocks[j]
    return req.blocks[i] if i < len(req.blocks) else None


class SchedulerHeal:
    """The scheduler side's healing: evicts poisoned blocks from the prefix cache and fails the
    requests the workers name, the way vLLM fails a request (its client gets an error)."""

    def __init__(self) -> None:
        self.scheduler: Any = None

    def bind(self) -> None:
        """Find the scheduler that is binding its KV cache manager to this connector (vLLM offers a
        connector no public way to fail a running request; the scheduler's set of requests to fail
        at its next update is that way)."""
        frame = sys._getframe(2)
        while frame is not None:
            obj = frame.f_locals.get("self")
            if hasattr(obj, "finish_requests") and isinstance(getattr(obj, "encoder_cache_mismatch_reqs", None), set):
                self.scheduler = obj
                return
            frame = frame.f_back  # type: ignore[assignment]

    def apply(self, report: HealReport, kv_cache_manager: Any) -> None:
        if report.evict and kv_cache_manager is not None:
            kv_cache_manager.evict_blocks(set(report.evict))
        for rid, why in report.fail.items():
            log.error("kvcanary: failing request %s: %s", rid, why)
            if self.scheduler is not None:
                self.scheduler.encoder_cache_mismatch_reqs.add(rid)
