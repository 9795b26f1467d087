"""The canary's configuration: one frozen dataclass, and the environment variables that set it.

Every ``KVCANARY_*`` variable is declared once in :data:`ENV` with the field it sets.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Literal, Mapping

from kvcanary.errors import ConfigError

Mode = Literal["off", "log", "raise", "quarantine", "repair"]
Backend = Literal["auto", "torch", "fused", "triton"]
BACKENDS = ("auto", "torch", "fused", "triton")
Content = Literal["none", "all"]
MODES = ("off", "log", "raise", "quarantine", "repair")
AUTO_BUDGET = {"cpu": 256 << 10, "cuda": 256 << 20}
AUTO_PATROL = {"cpu": 64 << 10, "cuda": 64 << 20}
CONTENTS = ("none", "all")
RING_ROW_BYTES = 14 * 8  # a violation row: kvcanary.violations.NUM_FIELDS int64 fields
MAX_RING_CAPACITY = 1 << 20  # 112 MiB of rows; a full ring takes seconds to decode on the host
# an average of V rows is never further than 2 * max |V| from the reference (itself such an average):
# the largest audit error (kvcanary.audit.error) any wrong weighting can show
MAX_AUDIT_TOLERANCE = 2.0


@dataclass(frozen=True)
class CanaryConfig:
    """How the canary checks and reports.

    Parameters
    ----------
    mode : ``off`` (engine untouched), ``log`` (report, never raise), ``raise`` (``poll`` raises),
        ``quarantine`` (report, never raise; engine adapters fail the requests that read corrupted
        KV and drop the poisoned blocks from the prefix cache, the rest of the batch goes on),
        ``repair`` (as ``quarantine``, but the requests that read corrupted KV are computed again
        from their first bad block and finish as a clean run would)
    content : ``all`` fingerprints every byte of every layout source; ``none`` checks metadata only
    content_budget_bytes : KV bytes re-fingerprinted per verify: ``"auto"`` (256 KiB on a CPU, 256 MiB on
        a GPU), a number, or ``None`` for every read slot; the window rotates across steps and what it
        leaves out is counted
    ring_capacity : violation rows held on the device between two polls (at most 2**20: 112 MiB); rows
        past it are counted as lost
    validate : check step values (ranges) on the host before each op (reads device tensors, so not
        under graph capture); ``None``: on for the CPU backends, off for Triton
    backend : ``auto`` (Triton on CUDA; on a CPU the fused path, or torch where numba is missing),
        ``torch`` (the reference: vectorized torch ops), ``fused`` (compiled CPU loops, numba) or
        ``triton`` (on a CPU only under ``TRITON_INTERPRET=1``); see :mod:`kvcanary.ops`
    scrub_slots : slots the patrol scrub re-fingerprints per ``scrub()`` call
    patrol_budget_bytes : KV bytes the patrol scrub re-fingerprints per forward where an engine
        adapter drives it (:meth:`kvcanary.canary.Canary.patrol`): ``"auto"`` (64 KiB on a CPU, 64 MiB
        on a GPU), a number, or 0 for no patrol. Cold cache (blocks no request reads) is then
        re-verified at least once every ``ceil(pool bytes / budget)`` forwards
    history : decoded violations kept on the canary for inspection
    violations_log : a file that every drained violation event is appended to as one JSON line
        (:mod:`kvcanary.eventlog`; the same format for every engine and process), or ``None``; its
        directory must exist and be writable (checked here, not at the first violation)
    metrics : keep Prometheus metrics (:mod:`kvcanary.metrics`; needs prometheus-client)
    metrics_port : also serve them over HTTP on this port, one exporter per process (implies
        ``metrics``); ``None``: no exporter of kvcanary's own
    repair_limit : ``repair`` mode: repairs of one request after which it fails instead (corruption
        that recomputing does not fix, such as a table pointing at the wrong block, must not loop)
    write_check : engine adapters compare the K and V each layer computed with what the cache holds
        at every new token's slot after the write (:mod:`kvcanary.audit`), in every layer (on vLLM's
        CPU path, in a share of the layers that ``audit_budget`` sets, see there)
    audit_queries : the most queries a forward audits (its attention output recomputed in fp32 from
        the verified cache and compared with the engine's, rotating over layers, requests and
        heads), and how many a forward in a new situation audits (:mod:`kvcanary.audit.budget`);
        0 turns the read audit off
    audit_budget : the share of the run's wall time the canary may take, the write check and read
        audit included: each audited forward in a known situation audits as many queries as the
        share leaves after the canary's other work, none where it leaves less than one query's time
        but one in each run of 8 such forwards (:mod:`kvcanary.audit.budget`); on
        vLLM's CPU path the write check checks that count's share of the layers, rotating, at least
        an eighth of them a forward, and the others' fingerprints are taken from the rows the layers
        computed; ``None``: every audited forward audits ``audit_queries`` and checks every layer
    audit_every : the write check and the read audit run on every ``audit_every``-th forward (1, the
        default: on every forward); the rotation carries on where it stopped
    audit_tolerance : the largest accepted error of an audited query, as a fraction of the largest
        |V| it reads, below 2 (no wrong weighting of V rows errs by 2 or more, so 2 would switch the
        audit off: ``audit_queries=0`` does that); ``None``: derived from the compute dtype and the
        query's logit size (:data:`kvcanary.audit.reference.TOLERANCE`)
    device_steps : the vLLM connector builds each forward's steps from the attention metadata on
        the pool's device and reads nothing back before the forward
        (:mod:`kvcanary.engines.vllm.device_steps`; request bookkeeping waits until after it);
        ``None``: on a pool off the CPU; ``True`` also on a CPU pool (the GPU path, run on a CPU)
    """

    mode: Mode = "log"
    content: Content = "all"
    content_budget_bytes: int | None | Literal["auto"] = "auto"
    ring_capacity: int = 4096
    validate: bool | None = None
    backend: Backend = "auto"
    scrub_slots: int = 4096
    patrol_budget_bytes: int | Literal["auto"] = "auto"
    history: int = 10_000
    violations_log: str | None = None
    metrics: bool = False
    metrics_port: int | None = None
    repair_limit: int = 2
    write_check: bool = True
    audit_queries: int = 64
    audit_budget: float | None = 0.01
    audit_every: int = 1
    audit_tolerance: float | None = None
    device_steps: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        if self.content not in CONTENTS:
            raise ConfigError(f"content: expected one of {CONTENTS}, got {self.content!r}")
        b = self.content_budget_bytes
        if not (b is None or (isinstance(b, str) and b == "auto") or (_is_int(b) and b >= 0)):
            raise ConfigError(f"content_budget_bytes: expected an integer >= 0, 'auto' or None, got {_shown(b)}")
        for name in ("ring_capacity", "scrub_slots", "history"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ConfigError(f"{name}: expected an integer >= 1, got {_shown(v)}")
            if v < 1:
                raise ConfigError(f"{name}: expected >= 1, got {v}")
        if self.ring_capacity > MAX_RING_CAPACITY:
            raise ConfigError(
                f"ring_capacity: expected an integer in 1 .. {MAX_RING_CAPACITY}, got {self.ring_capacity}: the ring "
                f"is {RING_ROW_BYTES} bytes a row on the pool's device ({MAX_RING_CAPACITY} rows are "
                f"{MAX_RING_CAPACITY * RING_ROW_BYTES >> 20} MiB), and a poll decodes every row it holds on the host "
                f"(several seconds for a full ring of that size); rows past the capacity are counted as lost "
                f"(violations_lost), not dropped unsaid")
        pb = self.patrol_budget_bytes
        if not ((isinstance(pb, str) and pb == "auto") or (_is_int(pb) and pb >= 0)):
            raise ConfigError(f"patrol_budget_bytes: expected an integer >= 0 or 'auto', got {_shown(pb)}")
        if self.violations_log is not None and not (isinstance(self.violations_log, str) and self.violations_log):
            raise ConfigError(f"violations_log: expected a file path or None, got {_shown(self.violations_log)}")
        if self.violations_log is not None:
            wrong = _unappendable(self.violations_log)
            if wrong:  # found now, not at the first violation, when the record would be lost
                raise ConfigError(f"violations_log: {wrong}")
        if not isinstance(self.metrics, bool):
            raise ConfigError(f"metrics: expected True or False, got {_shown(self.metrics)}")
        if self.metrics_port is not None and not (_is_int(self.metrics_port) and 0 < self.metrics_port < 65536):
            raise ConfigError(f"metrics_port: expected a TCP port in 1 .. 65535 or None, got {_shown(self.metrics_port)}")
        if not (_is_int(self.repair_limit) and self.repair_limit >= 0):
            raise ConfigError(f"repair_limit: expected an integer >= 0, got {_shown(self.repair_limit)}")
        if not isinstance(self.write_check, bool):
            raise ConfigError(f"write_check: expected True or False, got {_shown(self.write_check)}")
        if not (_is_int(self.audit_queries) and 0 <= self.audit_queries <= 4096):
            raise ConfigError(f"audit_queries: expected an integer in 0 .. 4096, got {_shown(self.audit_queries)}")
        ab = self.audit_budget
        if ab is not None and not (isinstance(ab, (int, float)) and not isinstance(ab, bool) and 0 < ab <= 1):
            raise ConfigError(f"audit_budget: expected a share of the forward's time in (0, 1] (0.01: 1 %) or None, "
                              f"got {_shown(ab)}")
        if not (_is_int(self.audit_every) and self.audit_every >= 1):
            raise ConfigError(f"audit_every: expected an integer >= 1, got {_shown(self.audit_every)}")
        t = self.audit_tolerance
        if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e6):
            raise ConfigError(f"audit_tolerance: expected a positive number below {MAX_AUDIT_TOLERANCE:g} or None, "
                              f"got {_shown(t)}")
        if t is not None and t >= MAX_AUDIT_TOLERANCE:
            raise ConfigError(
                f"audit_tolerance: expected a number in (0, {MAX_AUDIT_TOLERANCE:g}) or None, got {t!r}: an audited "
                f"query's error is max |engine - reference| / max |V| it reads, and an attention output is an average "
                f"of the V rows read, so however wrongly a kernel weighs them (mask, scale, page, head order) the "
                f"error stays at or below {MAX_AUDIT_TOLERANCE:g}: a tolerance of {t!r} would switch the read audit "
                f"off without saying so; to turn it off, set audit_queries=0 (KVCANARY_AUDIT_QUERIES=0)")
        if self.validate is not None and not isinstance(self.validate, bool):
            raise ConfigError(f"validate: expected True, False or None, got {_shown(self.validate)}")
        if self.device_steps is not None and not isinstance(self.device_steps, bool):
            raise ConfigError(f"device_steps: expected True, False or None, got {_shown(self.device_steps)}")

    def patrol_for(self, device_type: str) -> int:
        """The patrol scrub's bytes per forward on a device of this type (0: no patrol)."""
        if self.patrol_budget_bytes == "auto":
            return AUTO_PATROL.get(device_type, AUTO_PATROL["cpu"])
        return int(self.patrol_budget_bytes)

    def budget_for(self, device_type: str) -> int | None:
        """The per-verify content budget in bytes on a device of this type (``None``: unlimited)."""
        if self.content_budget_bytes == "auto":
            return AUTO_BUDGET.get(device_type, AUTO_BUDGET["cpu"])
        return self.content_budget_bytes

    @classmethod
    def from_env(cls, base: "CanaryConfig | None" = None, environ: Mapping[str, str] | None = None) -> "CanaryConfig":
        """``base`` (default: defaults) with every set ``KVCANARY_*`` variable applied.

        A bad value raises :class:`ConfigError` naming the variable, the value and what is
        expected. A ``KVCANARY_*`` name kvcanary does not read (a typo such as ``KVCANARY_MOD``)
        is logged once per process (logger ``kvcanary``) with the closest known name.
        """
        env = os.environ if environ is None else environ
        config = base or cls()
        for var, (fname, parse) in ENV.items():
            if var in env:
                try:
                    change: dict[str, Any] = {fname: parse(env[var])}
                    config = replace(config, **change)
                except ValueError as e:  # a parser's, or the field check's (ConfigError)
                    raise ConfigError(f"{var}: {str(e).removeprefix(fname + ': ')}") from None
        _warn_unknown(env)
        return config


    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], base: "CanaryConfig | None" = None, where: str = "config",
                     also: tuple[str, ...] = ()) -> "CanaryConfig":
        """``base`` (default: defaults) with each ``{field name: value}`` of ``mapping`` applied.

        A value may be the field's own type or a string, read as its ``KVCANARY_*`` variable is
        (``"auto"``, ``"none"``, ``"1"``, ...). A key that is no field raises :class:`ConfigError`
        naming it, ``where`` it was found and the closest field name; ``also`` lists keys the caller
        reads itself (skipped here). A bad value raises naming the key and what is expected.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{where}: expected a mapping of CanaryConfig field names to values, "
                              f"got {_shown(mapping)}")
        config = base or cls()
        parsers = {fname: parse for fname, parse in ENV.values()}
        for key, value in mapping.items():
            if key in also:
                continue
            if key not in parsers:
                known = [*parsers, *also]
                near = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"expected one of {', '.join(known)}"
                raise ConfigError(f"{where}: unknown key {key!r} (not a CanaryConfig field); {hint}")
            try:
                change: dict[str, Any] = {key: parsers[key](value) if isinstance(value, str) else value}
                config = replace(config, **change)
            except ValueError as e:  # a parser's, or the field check's (ConfigError)
                raise ConfigError(f"{where}: {key}: {str(e).removeprefix(key + ': ')}") from None
        return config


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not a count


def _shown(v: object) -> str:
    return f"{type(v).__name__} {v!r}"


def _unappendable(path: str) -> str | None:
    """Why a violation log cannot be appended to at ``path`` ("expected X, got Y"), or ``None``."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"expected a file to append violation events to, got {path!r}, a directory"
    if not os.path.isdir(where):
        return f"expected a file in an existing directory, got {path!r}: directory {where!r} does not exist"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"expected a file this process can append to, got {path!r}, which is not writable"
    elif not os.access(where, os.W_OK | os.X_OK):
        return f"expected a file in a writable directory, got {path!r}: directory {where!r} is not writable"
    return None


def _auto_int(s: str, expected: str) -> int | str:
    if s.strip().lower() == "auto":
        return "auto"
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"expected {expected}, got {s!r}") from None


def _budget(s: str) -> int | None | str:
    if s.strip().lower() in ("", "none", "unlimited"):
        return None
    return _auto_int(s, "an integer, 'auto' or 'none'")


def _patrol(s: str) -> int | str:
    return _auto_int(s, "an integer or 'auto'")


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"expected an integer, got {s!r}") from None


def _tolerance(s: str) -> float | None:
    if s.strip().lower() in ("", "none", "auto"):
        return None
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"expected a positive number or 'auto', got {s!r}") from None


def _share(s: str) -> float | None:
    if s.strip().lower() in ("none", "off"):
        return None
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"expected a share in (0, 1] such as 0.01, or 'none', got {s!r}") from None


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, got {s!r}")


def _auto_bool(s: str) -> bool | None:
    return None if s.strip().lower() in ("", "auto", "none") else _bool(s)


ENV: dict[str, tuple[str, Callable[[str], object]]] = {
    "KVCANARY_MODE": ("mode", str),
    "KVCANARY_CONTENT": ("content", str),
    "KVCANARY_CONTENT_BUDGET_BYTES": ("content_budget_bytes", _budget),
    "KVCANARY_RING_CAPACITY": ("ring_capacity", _int),
    "KVCANARY_VALIDATE": ("validate", _bool),
    "KVCANARY_SCRUB_SLOTS": ("scrub_slots", _int),
    "KVCANARY_PATROL_BUDGET_BYTES": ("patrol_budget_bytes", _patrol),
    "KVCANARY_HISTORY": ("history", _int),
    "KVCANARY_BACKEND": ("backend", str),
    "KVCANARY_VIOLATIONS_LOG": ("violations_log", str),
    "KVCANARY_METRICS": ("metrics", _bool),
    "KVCANARY_METRICS_PORT": ("metrics_port", _int),
    "KVCANARY_REPAIR_LIMIT": ("repair_limit", _int),
    "KVCANARY_WRITE_CHECK": ("write_check", _bool),
    "KVCANARY_AUDIT_QUERIES": ("audit_queries", _int),
    "KVCANARY_AUDIT_BUDGET": ("audit_budget", _share),
    "KVCANARY_AUDIT_EVERY": ("audit_every", _int),
    "KVCANARY_AUDIT_TOLERANCE": ("audit_tolerance", _tolerance),
    "KVCANARY_DEVICE_STEPS": ("device_steps", _auto_bool),
}

# KVCANARY_* variables read elsewhere, which set no CanaryConfig field
OTHER_ENV: dict[str, str] = {
    "KVCANARY_CACHE_DIR": "where the fused CPU loops are compiled to (kvcanary.fused.cache)",
    "KVCANARY_EVENTS_FILE": "the vLLM tests and fuzz: count engine events in every vLLM process (vllm_events)",
    "KVCANARY_STAMP_STORE": "the vLLM connector's stamp directory, beside another connector's stored KV",
    "KVCANARY_TEST_FAULT": "the vLLM tests' fault plugin: the fault to inject in every worker",
    "KVCANARY_TEST_FAULT_AT": "the vLLM tests' fault plugin: the forward it is injected at",
    "KVCANARY_SGLANG_FUZZ": "the SGLang tests: rounds of the randomized clean fuzz (0: off)",
    "KVCANARY_TEST_CONTROL": "the SGLang tests' control plugin: the directory its commands and state are in",
    "KVCANARY_REAL_PYTHON": "the vLLM fuzz: an interpreter with kvcanary's real extra, to convert the trained model",
    "KVCANARY_TEST_WORKERS": "scripts/test and test-vllm: the suite's worker processes (pytest-xdist; 0: one process)",
}
_warned: set[str] = set()


def _warn_unknown(env: Mapping[str, str]) -> None:
    """Log, once per process and name, each ``KVCANARY_*`` variable kvcanary does not read."""
    known = [*ENV, *OTHER_ENV]
    for var in env:
        if not var.startswith("KVCANARY_") or var in ENV or var in OTHER_ENV or var in _warned:
            continue
        _warned.add(var)
        near = difflib.get_close_matches(var, known, n=1)
        hint = f"did you mean {near[0]}?" if near else f"expected one of {', '.join(known)}"
        logging.getLogger("kvcanary").warning("kvcanary: %s is not a kvcanary variable and is ignored; %s", var, hint)


assert {f for f, _ in ENV.values()} == {f.name for f in fields(CanaryConfig)}  # every field has its variable
