"""Prometheus metrics of kvcanary: one registry of its own, names in Prometheus style.

Turn them on with ``CanaryConfig(metrics=True)`` (``KVCANARY_METRICS=1``), or serve them on a port
with ``KVCANARY_METRICS_PORT`` (an exporter thread per process, for engines with no metrics
endpoint of their own). Needs ``prometheus-client`` (``pip install kvcanary[metrics]``).

Every series carries the labels ``engine``, ``group`` (the layer group or pool a canary watches),
``tp_rank``, ``pp_rank`` and ``dp_rank``, so one Prometheus server sums or compares every rank of
every node; kvcanary aggregates nothing itself. Engines that run workers in several processes and
export through ``PROMETHEUS_MULTIPROC_DIR`` (vLLM's API server) pick the values up from there:
prometheus-client writes them to that directory when it is set, and gauges keep one series per
process.

Counters mirror :meth:`kvcanary.canary.Canary.stats` (``kvcanary_<stat>_total``), plus
``kvcanary_violations_total{check, site}`` from the drained violation records. Gauges: the share of
read slots whose bytes were re-fingerprinted (``kvcanary_content_coverage_ratio``), the patrol
scrub's position in its pass (``kvcanary_scrub_position_ratio``), the forwards one patrol pass takes
(``kvcanary_patrol_pass_steps``: the worst-case delay before corruption of KV no request reads is
found), the oldest a stamped slot's last re-fingerprint can be (``kvcanary_unverified_age_max_steps``),
and the time of the last update
(``kvcanary_last_update_timestamp_seconds``: a canary that stops updating it is not running).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
import time
from typing import Any, Iterable

from kvcanary.errors import ConfigError
from kvcanary.violations import Check, Violation

log = logging.getLogger("kvcanary")

LABELS = ("engine", "group", "tp_rank", "pp_rank", "dp_rank")
# stats key -> (metric name without the _total suffix, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "steps": ("kvcanary_steps", "Forwards the canary checked"),
    "slots_verified": ("kvcanary_slots_verified", "KV slots verified before a read (position, link, token)"),
    "slots_stamped": ("kvcanary_slots_stamped", "KV slots stamped after a write"),
    "content_slots_verified": ("kvcanary_content_slots_verified", "Read slots whose KV bytes were re-fingerprinted"),
    "content_slots_skipped": ("kvcanary_content_slots_skipped", "Read slots left out by the content budget"),
    "content_bytes_verified": ("kvcanary_content_bytes_verified", "KV bytes re-fingerprinted before a read"),
    "content_bytes_stamped": ("kvcanary_content_bytes_stamped", "KV bytes fingerprinted after a write"),
    "slots_scrubbed": ("kvcanary_slots_scrubbed", "Cached slots re-fingerprinted by the scrub"),
    "content_bytes_scrubbed": ("kvcanary_content_bytes_scrubbed", "KV bytes re-fingerprinted by the scrub"),
    "scrub_passes": ("kvcanary_scrub_passes", "Complete patrol-scrub passes over the pool"),
    "slots_unverifiable": ("kvcanary_unverifiable_slots", "Reads of slots in the unknown state (counted, never reported)"),
    "internal_errors": ("kvcanary_internal_errors", "Failures of the canary's own (counted, not raised)"),
    "violations_lost": ("kvcanary_violations_lost", "Violation records overwritten before they were drained"),
    "guard_checks": ("kvcanary_guard_checks", "Guard slots (reserved, or where a stray padding write lands) checked"),
    "repairs": ("kvcanary_repairs", "Requests computed again because they read corrupted KV (repair mode)"),
    "requests_failed": ("kvcanary_requests_failed", "Requests failed because they read corrupted KV"),
    "blocks_evicted": ("kvcanary_blocks_evicted", "Blocks dropped from the prefix cache because their bytes changed"),
    "harmful_tokens": ("kvcanary_harmful_tokens", "Tokens sampled from corrupted KV before the canary reported it "
                       "(an upper bound; kvcanary.harm)"),
    "device_forwards": ("kvcanary_device_steps", "Forwards whose steps were built on the device, nothing read back "
                        "before them (vLLM)"),
    "audit_queries": ("kvcanary_audit_queries", "Attention queries the read audit recomputed from the verified KV"),
    "write_slots_checked": ("kvcanary_write_slots_checked", "New tokens' layer writes the write check compared bit "
                            "for bit with what the layer computed"),
    "write_bytes_checked": ("kvcanary_write_bytes_checked", "KV bytes the write check compared"),
    "write_slots_unchecked": ("kvcanary_write_slots_unchecked", "New tokens' layer writes the time budget left to "
                              "the content checks (fingerprinted from what the layer computed)"),
}


class Metrics:
    """kvcanary's metrics in one registry (``registry``; a fresh one by default)."""

    def __init__(self, registry: Any = None) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise ConfigError("metrics: prometheus-client is not installed (pip install 'kvcanary[metrics]' "
                              "or prometheus-client)") from None
        self.pc = pc
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self.counters = {k: pc.Counter(name, text, LABELS, registry=self.registry) for k, (name, text) in COUNTERS.items()}
        self.violations = pc.Counter("kvcanary_violations", "KV-cache violations found, by failed check and site",
                                     LABELS + ("check", "site"), registry=self.registry)
        mp: dict[str, Any] = {"multiprocess_mode": "all"}  # one series per process under PROMETHEUS_MULTIPROC_DIR
        self.coverage = pc.Gauge("kvcanary_content_coverage_ratio",
                                 "Share of read slots whose KV bytes were re-fingerprinted (since start)", LABELS,
                                 registry=self.registry, **mp)
        self.scrub_position = pc.Gauge("kvcanary_scrub_position_ratio",
                                       "Position of the patrol scrub in its pass over the pool (0..1)", LABELS,
                                       registry=self.registry, **mp)
        self.patrol_pass = pc.Gauge("kvcanary_patrol_pass_steps",
                                    "Forwards the patrol scrub takes over the whole pool: the worst-case delay before "
                                    "corrupted KV that no request reads is found (0: no patrol)", LABELS,
                                    registry=self.registry, **mp)
        self.unverified_age = pc.Gauge("kvcanary_unverified_age_max_steps",
                                       "At most how many forwards ago any stamped slot's KV bytes were last "
                                       "re-fingerprinted (the patrol's walk bounds it)", LABELS,
                                       registry=self.registry, **mp)
        self.updated = pc.Gauge("kvcanary_last_update_timestamp_seconds", "Unix time of the canary's last update",
                                LABELS, registry=self.registry, **mp)
        self._seen: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def publish(self, source: Any, stats: dict[str, int], labels: dict[str, str]) -> None:
        """Bring the counters up to date with one canary's (``source``) ``stats``
        (:meth:`Canary.stats`): each counter grows by what the canary counted since its last
        publish, so canaries that come and go under the same labels add up."""
        key = tuple(str(labels.get(k, "")) for k in LABELS)
        with self._lock:
            seen = self._seen.setdefault(source, {})
            for k, c in self.counters.items():
                v = int(stats.get(k, 0))
                child = c.labels(*key)  # exported from the first update on, at 0: alerts see its first rise
                if v > seen.get(k, 0):
                    child.inc(v - seen.get(k, 0))
                seen[k] = max(v, seen.get(k, 0))
            read = stats.get("slots_verified", 0)
            if read:
                self.coverage.labels(*key).set(stats.get("content_slots_verified", 0) / read)
            if stats.get("num_slots"):
                self.scrub_position.labels(*key).set(stats.get("scrub_position", 0) / stats["num_slots"])
            self.patrol_pass.labels(*key).set(stats.get("patrol_pass_steps", 0))
            self.unverified_age.labels(*key).set(stats.get("unverified_age_max_steps", 0))
            self.updated.labels(*key).set(time.time())

    def count(self, found: Iterable[Violation], labels: dict[str, str]) -> None:
        """Count drained violations by each failed check and site."""
        key = tuple(str(labels.get(k, "")) for k in LABELS)
        for v in found:
            group = v.group if v.group is not None else key[1]
            for c in Check:
                if c in v.checks:
                    self.violations.labels(key[0], group, *key[2:], str(c.name).lower(), v.site.name.lower()).inc()

    def text(self) -> str:
        """The text exposition of this registry (what a scrape returns)."""
        return self.pc.generate_latest(self.registry).decode()


_process: list[Metrics] = []
_served: dict[int, bool] = {}
_plock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's :class:`Metrics` (made on first use)."""
    with _plock:
        if not _process:
            _process.append(Metrics())
        return _process[0]


def serve(port: int) -> bool:
    """Export this process's metrics over HTTP on ``port`` (once per process); ``False`` when the
    port is taken (another worker of the same node serves it: give each its own port, or export
    through ``PROMETHEUS_MULTIPROC_DIR``)."""
    m = process_metrics()
    with _plock:
        if port in _served:
            return _served[port]
        try:
            m.pc.start_http_server(port, registry=m.registry)
            _served[port] = True
            log.info("kvcanary: metrics served on port %d", port)
        except OSError as e:
            _served[port] = False
            log.warning("kvcanary: metrics port %d unavailable in process %d (%s); this process's metrics are "
                        "not exported", port, os.getpid(), e)
        return _served[port]
