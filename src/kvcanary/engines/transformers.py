"""Protect HuggingFace transformers continuous batching (``generate_batch``, the CB manager).

One call::

    with kvcanary.engines.transformers.protect(model) as guard:
        out = model.generate_batch(prompts, generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    print(guard.stats(), guard.violations)

Every forward of the model's continuous-batching runner is bracketed: before it, every cached
slot each request's attention will read (taken from the forward's own ``read_index``) is
verified; after it, the slots written (``write_index``) are stamped with content fingerprints of
every layer's K and V. One canary per layer group (full attention, sliding window), each over that
group's own slot space. CPU offloading is followed too: stamps travel with offloaded blocks and the
restored bytes are verified against them on the way back.

transformers is imported inside functions only; ``import kvcanary`` never needs it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engines import transformers_hooks as cb_hooks
from kvcanary.engines.base import Adapter
from kvcanary.engines.hf_models import cb_configs, tiny_model
from kvcanary.engines.transformers_audit import CbAudit
from kvcanary.engines.transformers_quarantine import Quarantine
from kvcanary.engines.transformers_steps import Group, build_steps, group_layout, padding_writes
from kvcanary.errors import ConfigError, UnsupportedError
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

__all__ = ["Protection", "protect", "check_version", "group_layout", "tiny_model", "cb_configs"]

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


class Protection(Adapter):
    """The canaries of one protected model; a context manager that installs and removes the hooks.

    Parameters
    ----------
    model : a transformers model that runs continuous batching (has ``generate_batch``)
    config : canary configuration (default ``CanaryConfig(mode="log")``). ``raise``: the first
        violation stops the engine and ``generate_batch`` raises :class:`KvCorruptionError` in the
        caller's thread; ``quarantine``: the requests that read corrupted KV fail with that error,
        their poisoned blocks leave the prefix cache, and every other request finishes normally;
        ``repair``: those requests are computed again from the start instead (failing after
        ``repair_limit`` repairs)
    check_tokens : verify each read slot's token against the request's real token stream
    on_violation : called with every batch of drained violations (request ids filled in)
    """

    engine = "transformers"

    def __init__(self, model: Any, config: CanaryConfig | None = None, check_tokens: bool = True,
                 on_violation: Callable[[list[Violation]], None] | None = None) -> None:
        import transformers

        check_version(transformers.__version__)
        if config is not None and not isinstance(config, CanaryConfig):
            raise ConfigError(f"config: expected a CanaryConfig (e.g. CanaryConfig(mode={config!r})), "
                              f"got {type(config).__name__} {config!r}")
        if not callable(getattr(model, "generate_batch", None)) or not hasattr(model, "config"):
            raise UnsupportedError(f"model: expected a transformers model that runs continuous batching "
                                   f"(a causal LM with generate_batch), got {type(model).__name__}")
        super().__init__(config or CanaryConfig(mode="log"), on_violation)
        self.model = model
        self.check_tokens = check_tokens
        self.groups: dict[str, Group] = {}
        self.cache: Any = None
        self.forwards = 0
        self._seen: set[str] = set()  # requests whose first read of cached KV was verified
        self._offloaded: dict[str, dict[str, torch.Tensor | None]] = {}
        self.rows: dict[int, list[str]] = {}  # forward -> request id of each step row
        self.hooks: list[Callable[["Protection", Any, dict], None]] = []  # run before each forward's checks
        self._stream: Any = None
        self.quarantine = Quarantine(self)
        self.audit = CbAudit(self)  # the write check and the read audit inside each forward
        self._padding: dict[str, torch.Tensor] = {}  # each group's padding writes of the forward in flight
        self._freed: dict[str, dict[int, torch.Tensor]] = {}  # group -> block -> stamps, freed since the last forward
        self._builder: Any = None  # the compiled step builder's buffers (fused backend)

    # ---- install / remove -------------------------------------------------------------------

    def __enter__(self) -> "Protection":
        if self.config.mode != "off":
            other = cb_hooks.ACTIVE.get(id(self.model))
            if other is not None:
                raise UnsupportedError(
                    f"model {type(self.model).__name__} is already protected by an active protect(); nested "
                    f"protection is not supported: use the outer guard, or exit it before protecting again")
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
        if self.cache is not None:
            cb_hooks.BY_CACHE.pop(cb_hooks.pool_key(self.cache.cache_tensor), None)
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
                    holders = g.holders(v.slot // g.tpp)
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
        return g.holders(v.slot // g.tpp) if g is not None and v.slot >= 0 else None

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
        return cb_hooks.canary_work(self._stream)

    def recover(self) -> None:
        self._offloaded.clear()
        super().recover()

    # ---- hooks ------------------------------------------------------------------------------------

    def _ensure_groups(self, cache: Any, fresh: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """Build one canary per layer group the first time a cache is seen. Blocks it already holds
        were written before the canary was watching (a warm engine): they start unknown, except
        those of ``fresh`` requests (nothing cached yet, so nothing of theirs was written)."""
        if self.cache is cache:
            return
        groups = {name: Group(name, a.index, a, self.config) for name, a in cache.cache_allocators.items()}
        for g in groups.values():
            a = g.allocator
            held = {b for rid, blocks in a.block_table.items() if rid not in fresh for b in blocks}
            held |= set(a.ledger.cached_blocks) | set(a.ledger.block_to_hash)
            if held:
                g.canary.forget(g.block_slots(held))
        self.groups, self.cache = groups, cache
        self.audit.groups_changed(groups)
        cb_hooks.BY_CACHE[cb_hooks.pool_key(cache.cache_tensor)] = self
        cb_hooks.BY_POOL[id(cache.pool)] = self

    def build_steps(self, runner: Any, batch: dict, reqs: list | None = None) -> dict[str, Step]:
        """One Step per layer group from a forward's own metadata (see :func:`transformers_steps.build_steps`)."""
        if self._builder is None and self.groups and next(iter(self.groups.values())).canary.backend == "fused":
            from kvcanary.engines.transformers_compiled import StepBuilder

            self._builder = StepBuilder()
        return build_steps(self.groups, self.book if self.check_tokens else None, runner, batch, reqs,
                           builder=self._builder)

    def before(self, runner: Any, batch: dict) -> dict[str, Step] | None:
        self._stream = getattr(runner.inputs_and_outputs, "compute_stream", None)  # the forward's (None on a CPU)
        return self.shielded("the before-forward hook", self._before, runner, batch)  # type: ignore[no-any-return]

    def _before(self, runner: Any, batch: dict) -> dict[str, Step] | None:
        reqs = list(cb_hooks.host_io(runner.inputs_and_outputs).requests_in_batch)
        rids = [fs.state.request_id for fs in reqs]
        if any(rid.startswith("__warmup") for rid in rids):
            return None
        self._freed.clear()
        if self.cache is not runner.cache:
            self._ensure_groups(runner.cache, {fs.state.request_id for fs in reqs
                                               if fs.state.position_offset == fs.query_length})
        for hook in self.hooks:
            hook(self, runner, batch)
        steps = self.build_steps(runner, batch, reqs)
        self._padding = padding_writes(self.groups, batch, steps)
        self._verify_first_reads(reqs, steps, rids)
        self.rows[self.forwards] = rids
        self.harm.forward(self.forwards, {fs.state.request_id: int(bool(fs.has_new_token)) for fs in reqs})
        self.rows.pop(self.forwards - self.config.history, None)
        for name, step in steps.items():
            self.groups[name].canary.before_forward(step)
        self.audit.begin(steps, reqs, batch)
        return steps

    def _verify_first_reads(self, reqs: list, steps: dict[str, Step], rids: list[str] | None = None) -> None:
        """A request seen for the first time with KV already cached (a prefix-cache hit, a fork's
        child) reads blocks it did not write: every byte of them is verified before this forward."""
        if rids is None:
            rids = [fs.state.request_id for fs in reqs]
        if self._seen.issuperset(rids):
            return
        for i, fs in enumerate(reqs):
            rid = rids[i]
            if rid in self._seen:
                continue
            self._seen.add(rid)
            past = fs.state.position_offset - fs.query_length
            if past <= 0:
                continue
            for name, step in steps.items():
                self.verify_first_read(name, step, i, int(step.starts()[i]), past, rid)

    def after(self, steps: dict[str, Step] | None) -> None:
        if steps is not None:
            self.shielded("the after-forward hook", self._after, steps)
        self.audit.end()

    def _after(self, steps: dict[str, Step]) -> None:
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
        if self.forwards % 64 == 0 and self.cache is not None:  # requests that left the cache
            live = {rid for a in self.cache.cache_allocators.values() for rid in a.block_table}
            self.book.forget_except(live)
            self._seen &= live | {rid for rids in list(self.rows.values())[-2:] for rid in rids}

    def released(self, index: int, blocks: list[int]) -> None:
        """The engine returned ``blocks`` of the group with allocator ``index`` to its free pool."""
        self.shielded("the block-free hook", self._released, index, blocks)

    def _released(self, index: int, blocks: list[int]) -> None:
        for name, g in self.groups.items():
            if g.index == index:
                slots = g.block_slots(blocks)
                # the offloading manager frees a victim's blocks before it copies them out: keep their
                # stamps until the next forward, for the offload hook
                was = g.canary.export_stamps(slots)
                if was is not None:
                    freed = self._freed.setdefault(name, {})
                    freed.update((b, was[i * g.tpp : (i + 1) * g.tpp]) for i, b in enumerate(blocks))
                g.canary.release(slots)
                self.quarantine.freed(name, blocks)

    def pool_reset(self) -> None:
        """The engine gave every block back (a cache reset): every slot is free."""
        self.shielded("the pool-reset hook", self._pool_reset)

    def _pool_reset(self) -> None:
        for g in self.groups.values():
            g.canary.release(torch.arange(g.canary.num_slots, device=g.canary.device))
        self.quarantine.poisoned.clear()

    def offloaded(self, cache: Any, rids: set[str], tables: dict[str, dict[str, list[int]]]) -> None:
        """Blocks of ``rids`` were copied to the CPU tier: keep their stamps beside them."""
        self.shielded("the offload hook", self._offloaded_hook, cache, rids, tables)

    def _offloaded_hook(self, cache: Any, rids: set[str], tables: dict[str, dict[str, list[int]]]) -> None:
        self._ensure_groups(cache)
        for rid in rids:
            self._offloaded[rid] = {name: self._stamps_of(name, blocks) for name, blocks in tables[rid].items() if blocks}

    def _stamps_of(self, name: str, blocks: list[int]) -> torch.Tensor | None:
        """The stamps of ``blocks`` of group ``name`` as they were before the engine freed them."""
        g, freed = self.groups[name], self._freed.get(name, {})
        now = g.canary.export_stamps(g.block_slots(blocks))
        if now is None or not freed:
            return now
        return torch.cat([freed.get(b, now[i * g.tpp : (i + 1) * g.tpp]) for i, b in enumerate(blocks)])

    def copied(self, allocator: Any, source: list[int], dest: list[int]) -> None:
        """A fork copied whole blocks inside the pool: their stamps follow, and the copies are verified."""
        self.shielded("the block-copy hook", self._copied, allocator, source, dest)

    def _copied(self, allocator: Any, source: list[int], dest: list[int]) -> None:
        g = next((g for g in self.groups.values() if g.allocator is allocator), None)
        if g is not None:
            g.canary.import_stamps(g.block_slots(dest), g.canary.export_stamps(g.block_slots(source)))
            self.poll()

    def restored(self, cache: Any, rids: list[str]) -> None:
        """Blocks of ``rids`` came back from the CPU tier: install their stamps and verify the bytes."""
        self.shielded("the restore hook", self._restored, cache, rids)

    def _restored(self, cache: Any, rids: list[str]) -> None:
        self._ensure_groups(cache)
        for rid in rids:
            saved = self._offloaded.pop(rid, {})
            for name, g in self.groups.items():
                blocks = g.allocator.block_table.get(rid, [])
                stamps = saved.get(name)
                n = 0 if stamps is None else min(len(blocks), stamps.shape[0] // g.tpp)
                if n:
                    g.canary.import_stamps(g.block_slots(blocks[:n]), stamps[: n * g.tpp])  # type: ignore[index]
                if len(blocks) > n:  # stamps that did not travel: the canary lost track, not corruption
                    g.canary.forget(g.block_slots(blocks[n:]))
            self.poll(request=rid)


def protect(model: Any, config: CanaryConfig | None = None, **kw: Any) -> Protection:
    """Protect ``model``'s continuous batching; use the result as a context manager."""
    return Protection(model, config, **kw)
