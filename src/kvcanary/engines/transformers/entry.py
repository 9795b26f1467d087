"""transformers continuous batching: :func:`protect` a model, and the :class:`Protection` that
brackets each forward of its continuous-batching runner. Before it, every cached slot each
request's attention will read (the forward's own ``read_index``) is verified; after it, the slots
written (``write_index``) are stamped with content fingerprints of every layer's K and V. One canary
per layer group (full attention, sliding window), each over that group's own slot space."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engines.base import Adapter, hook
from kvcanary.engines.transformers import hooks as cb_hooks
from kvcanary.engines.transformers.audit import CbAudit
from kvcanary.engines.transformers.compiled import StepBuilder
from kvcanary.engines.transformers.heal import Quarantine
from kvcanary.engines.transformers.scheduler import SchedulerSide
from kvcanary.engines.transformers.steps import build_steps, padding_writes
from kvcanary.engines.transformers.transfer import TransferSide
from kvcanary.errors import ConfigError, UnsupportedError
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

log = logging.getLogger("kvcanary")
SUPPORTED = ((5, 24), (5, 25))  # [low, high) of (major, minor), the range the tests run on
SUPPORTED_TEXT = ">=5.24,<5.25"


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedError` unless ``version`` is in the tested range."""
    try:
        key = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        key = (-1, -1)
    if not SUPPORTED[0] <= key < SUPPORTED[1]:
        raise UnsupportedError(
            f"transformers {version} is not supported by kvcanary's continuous-batching integration; "
            f"expected transformers{SUPPORTED_TEXT} (pip install 'kvcanary[transformers]')"
        )


class Protection(SchedulerSide, TransferSide, Adapter):
    """The canaries of one protected model; a context manager that installs and removes the hooks.

    Parameters
    ----------
    model : a transformers model that runs continuous batching (has ``generate_batch``)
    config : a :class:`CanaryConfig`, used as it is; ``None`` (default): ``log`` mode with every set
        ``KVCANARY_*`` variable applied; or a mapping of field names to values (``{"mode": "repair"}``),
        those fields over the ``None`` case's. ``raise``: the first
        violation stops the engine and ``generate_batch`` raises :class:`KvCorruptionError` in the
        caller's thread; ``quarantine``: the requests that read corrupted KV fail with that error,
        their poisoned blocks leave the prefix cache, and every other request finishes normally;
        ``repair``: those requests are computed again from the start instead (failing after
        ``repair_limit`` repairs)
    check_tokens : verify each read slot's token against the request's real token stream
    on_violation : called with every batch of drained violations (request ids filled in)
    """

    engine = "transformers"

    def __init__(self, model: Any, config: CanaryConfig | Mapping[str, Any] | None = None, check_tokens: bool = True,
                 on_violation: Callable[[list[Violation]], None] | None = None) -> None:
        import transformers

        check_version(transformers.__version__)
        config = _config_of(config)
        if not callable(getattr(model, "generate_batch", None)) or not hasattr(model, "config"):
            raise UnsupportedError(f"model: expected a transformers model that runs continuous batching "
                                   f"(a causal LM with generate_batch), got {type(model).__name__}")
        Adapter.__init__(self, config, on_violation)
        SchedulerSide.__init__(self)
        TransferSide.__init__(self)
        self.model = model
        self.check_tokens = check_tokens
        self.forwards = 0
        self.rows: dict[int, list[str]] = {}  # forward -> request id of each step row
        self.hooks: list[Callable[["Protection", Any, dict], None]] = []  # run before each forward's checks
        self.stream: Any = None  # the forward's compute stream (None on a CPU): the canary's work runs on it
        self.quarantine = Quarantine(self)
        self.audit = CbAudit(self)  # the write check and the read audit inside each forward
        self._padding: dict[str, torch.Tensor] = {}  # each group's padding writes of the forward in flight
        self._builder: Any = None  # the compiled step builder's buffers (fused backend)

    # ---- install / remove -------------------------------------------------------------------

    def _load_loops(self) -> None:
        """The compiled CPU loops loaded from their cache (or compiled, without ``kvcanary warmup``) now,
        where a model on the CPU may run the fused backend: the groups' canaries are made in the
        engine's first forward (the cache exists from then), which would otherwise pay for it (about
        half a second, once per process). Nothing where numba is missing: the canary says so when
        it is made, as before."""
        device = getattr(self.model, "device", None)
        if self.config.backend in ("auto", "fused") and getattr(device, "type", None) == "cpu":
            from kvcanary.fused import available

            available()

    def __enter__(self) -> "Protection":
        if self.config.mode != "off":
            other = cb_hooks.ACTIVE.get(id(self.model))
            if other is not None:
                raise UnsupportedError(
                    f"model {type(self.model).__name__} is already protected by an active protect(); nested "
                    f"protection is not supported: use the outer guard, or exit it before protecting again")
            self._load_loops()
            cb_hooks.install()
            cb_hooks.ACTIVE[id(self.model)] = self
            if self.config.mode != "off":  # the attention modules whose forwards are audited
                for m in self.model.modules():
                    if hasattr(m, "layer_idx") and hasattr(m, "scaling"):
                        cb_hooks.AUDITED[id(m)] = self.audit
                        self.audit.modules[int(m.layer_idx)] = m
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if cb_hooks.ACTIVE.get(id(self.model)) is self:
            cb_hooks.ACTIVE.pop(id(self.model))
        for key in [k for k, a in cb_hooks.AUDITED.items() if a is self.audit]:
            del cb_hooks.AUDITED[key]
        self.audit.stop_keeping()
        if self.cache is not None:
            cb_hooks.protect_cache(self.cache.cache_tensor, None)
            cb_hooks.BY_POOL.pop(id(self.cache.pool), None)
        if not cb_hooks.ACTIVE:
            cb_hooks.uninstall()
        self.shielded("the final metrics update", self.publish_metrics, True)
        if exc_type is None:
            self.raise_pending()  # a raise-mode error that no generate_batch call has raised yet

    # ---- reporting ----------------------------------------------------------------------------

    def poll(self, request: str | None = None) -> list[Violation]:
        """Drain every group's violations, name the request behind each, record them in
        ``violations``, call ``on_violation``, log one line per event; ``raise`` mode then raises,
        ``quarantine`` mode marks the readers for failing. ``request``: the request behind
        violations without a step row (a transfer into its blocks)."""
        found: list[Violation] = []
        for name, g in self.groups.items():
            for v in g.canary.drain():
                rid = self.request_of(v) if v.row >= 0 else request
                if v.site == Site.FIRST_READ:  # the ring keeps the order the reads were verified in
                    rid = self.first_reader(name, v) or rid
                if rid is None and v.row < 0:
                    holders = g.holders(g.block_of(v.slot))
                    rid = holders[0] if holders else None
                found.append(dataclasses.replace(v, request=rid, group=name))
        found += [dataclasses.replace(v, request=self.request_of(v)) for v in self.audit.drain()]
        if not found:
            return found
        self.count_harm(found, healed=self.config.mode in ("quarantine", "repair"))
        self.report(found)
        if self.config.mode in ("quarantine", "repair"):
            self.quarantine.mark(found)
        return found

    def holders_of(self, v: Violation) -> list[str] | None:
        g = self.groups.get(v.group) if v.group is not None else None
        return g.holders(g.block_of(v.slot)) if g is not None and v.slot >= 0 else None

    def request_at(self, step: int, row: int) -> str | None:
        rids = self.rows.get(step, [])
        return rids[row] if 0 <= row < len(rids) else None

    def request_of(self, v: Violation) -> str | None:
        """The request id behind a verify or write violation's step row, while it is remembered."""
        if v.request is not None:
            return v.request
        rids = self.rows.get(v.step, [])
        return rids[v.row] if 0 <= v.row < len(rids) else None

    def describe(self, v: Violation) -> str:
        rid = self.request_of(v)
        group = v.group or next((n for n, g in self.groups.items() if v in g.canary.history), "?")
        return f"{dataclasses.replace(v, request=None).describe()} [request {rid}, group {group}]"

    def canaries(self) -> list[Any]:
        return [g.canary for g in self.groups.values()]

    def heal_counts(self) -> dict[str, int]:
        return {**super().heal_counts(), "requests_failed": len(self.quarantine.failed),
                "repairs": self.quarantine.repaired}

    def named_canaries(self) -> dict[str, Any]:
        return {name: g.canary for name, g in self.groups.items()}

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["forwards"] = self.forwards
        out["requests_quarantined"] = len(self.quarantine.failed)
        out.update(self.audit.stats())
        return out

    def work_context(self) -> Any:
        return cb_hooks.canary_work(self.stream)

    def recover(self) -> None:
        self.offloaded_stamps.clear()
        self.frees.clear()  # every slot is unknown now: a freed one too
        super().recover()

    # ---- the forward ------------------------------------------------------------------------------

    def build_steps(self, runner: Any, batch: dict, reqs: list | None = None) -> dict[str, Step]:
        """One Step per layer group from a forward's own metadata (see :func:`kvcanary.engines.transformers.steps.build_steps`)."""
        if self._builder is None and self.groups and next(iter(self.groups.values())).canary.backend == "fused":
            self._builder = StepBuilder()
        return build_steps(self.groups, self.book if self.check_tokens else None, runner, batch, reqs,
                           builder=self._builder)

    @hook("the before-forward hook")
    def before(self, runner: Any, batch: dict) -> dict[str, Step] | None:
        """Before a forward: build its steps, verify first reads and every cached slot it reads, and
        plan its audit (``None``: a warm-up forward, not checked)."""
        reqs = list(cb_hooks.host_io(runner.inputs_and_outputs).requests_in_batch)
        rids = [fs.state.request_id for fs in reqs]
        if any(rid.startswith("__warmup") for rid in rids):
            return None
        self.freed_stamps.clear()
        if self.cache is not runner.cache:
            self.ensure_groups(runner.cache, {fs.state.request_id for fs in reqs
                                              if fs.state.position_offset == fs.query_length})
        for fn in self.hooks:
            fn(self, runner, batch)
        steps = self.build_steps(runner, batch, reqs)
        # the blocks freed since the last hook (its batch update's finished requests), before any read is
        # verified: here, after the step build's numpy calls, theirs cost a fraction of what they did alone
        self.release_frees(export=False)
        self._padding = padding_writes(self.groups, batch, steps)
        self.verify_first_reads(reqs, steps, rids)
        self.rows[self.forwards] = rids
        self.harm.forward(self.forwards, {fs.state.request_id: int(bool(fs.has_new_token)) for fs in reqs})
        self.rows.pop(self.forwards - self.config.history, None)
        for name, step in steps.items():
            self.groups[name].canary.before_forward(step)
        self.audit.begin(steps, reqs, batch, self.forwards)
        return steps

    def after(self, steps: dict[str, Step] | None) -> None:
        if steps is not None:
            self.after_forward(steps)
        self.audit.end()

    @hook("the after-forward hook")
    def after_forward(self, steps: dict[str, Step]) -> None:
        """After a forward: the audit's kept checks, stamps with the patrol's share, then the report."""
        self.audit.finish()  # the write checks a decode-sized forward keeps for after it
        for name, step in steps.items():  # with this forward's share of the patrol over cold cache
            self.groups[name].canary.after_forward(step, self._padding.get(name), patrol=True)
        for name, g in self.groups.items():
            if name not in steps:
                g.canary.patrol()
        self.forwards += 1
        self.poll()
        self.publish_metrics()
        self.forget_first_reads()
        if self.forwards % 64 == 0:  # requests that left the cache
            self.forget_departed()


def protect(model: Any, config: CanaryConfig | Mapping[str, Any] | None = None, **kw: Any) -> Protection:
    """Protect ``model``'s continuous batching; use the result as a context manager.

    ``config``: a :class:`CanaryConfig` (used as it is); ``None`` (the defaults in ``log`` mode, with
    every set ``KVCANARY_*`` variable applied); or a mapping of field names to values such as
    ``{"mode": "repair"}`` (those fields over the ``None`` case's)."""
    return Protection(model, config, **kw)


def _config_of(config: object) -> CanaryConfig:
    """The configuration ``protect(model, config)`` runs with (see :func:`protect`)."""
    if isinstance(config, CanaryConfig):
        return config
    base = CanaryConfig.from_env(CanaryConfig(mode="log"))
    if config is None:
        return base
    if isinstance(config, Mapping):
        return CanaryConfig.from_mapping(config, base, where="config")
    mode = config if isinstance(config, str) else "repair"  # a mode given alone: show it in both forms
    raise ConfigError(f"config: expected a CanaryConfig, a mapping of its field names to values or None (e.g. "
                      f"CanaryConfig(mode={mode!r}) or {{'mode': {mode!r}}}), got {type(config).__name__} {config!r}")
