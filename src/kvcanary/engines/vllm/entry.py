"""Protect a vLLM V1 engine with one flag: a KV connector that stamps and verifies every worker's cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvCanaryConnector","kv_role":"kv_both"}'
    LLM(model=..., kv_transfer_config={"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"})

The name resolves through kvcanary's ``vllm.general_plugins`` entry point
(:func:`kvcanary.engines.vllm.plugin.register`), loaded in every vLLM process. Configuration comes
from the ``KVCANARY_*`` variables (default mode ``log``); ``KVCANARY_VIOLATIONS_LOG`` collects every
worker's events in one JSONL file. With another connector, list both under vLLM's
``MultiConnector``; the canary verifies what the other one lands.

The connector declares vLLM's ``SupportsHMA``, so turning it on leaves the hybrid KV cache manager,
the KV cache groups and the pool as vLLM builds them; each worker runs one canary per KV cache group
(:mod:`kvcanary.engines.vllm.groups`).

Scheduler side (engine core, :mod:`kvcanary.engines.vllm.scheduler`): ships, per step, each scheduled
request's new committed token ids, the draft tokens its forward writes (speculative decoding), its
computed-token count, where rejected drafts were rolled back, and the slot of its first new token;
and the blocks vLLM zeroes or copies. Worker side (each worker and tensor-parallel rank): at ``bind_connector_metadata``, inside the forward
context, it builds each group's step from that group's attention metadata
(:mod:`kvcanary.engines.vllm.steps`) and verifies every cached slot each request reads; reads of
slots that another request of the batch computes in this same forward (a prefix-cache hit handed out
before its KV exists) are left to ``wait_for_save``, which stamps the written slots and then
verifies those. Beside a connector that stores and loads KV: :mod:`kvcanary.engines.vllm.transfer`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcanary.canary import Canary
from kvcanary.engines.base import Adapter, hook, named
from kvcanary.engines.vllm import backends
from kvcanary.engines.vllm import heal as vllm_heal
from kvcanary.engines.vllm import positions
from kvcanary.engines.vllm.audit import VllmAudit
from kvcanary.engines.vllm.device_steps import DeviceRows, device_rows, device_step, resolve
from kvcanary.engines.vllm.groups import GroupPlan, plan_groups, single_group
from kvcanary.engines.vllm.scheduler import CanaryMeta, SchedulerSide
from kvcanary.engines.vllm.settings import connector_config, pp_rank, rank
from kvcanary.engines.vllm.steps import (Kept, ReqStep, Rows, block_slots, build_step, group_metadata, match_rows,
                                         rolled_back, written_by)
from kvcanary.engines.vllm.transfer import TransferSide
from kvcanary.errors import UnsupportedError
from kvcanary.geometry.base import KvGeometry
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

log = logging.getLogger("kvcanary")
NAME = "KvCanaryConnector"
__all__ = ["KvCanaryConnector", "CanaryMeta", "ReqStep", "NAME"]


@dataclass
class _Group:
    """One KV cache group on a worker: its plan, its canary and this forward's step."""

    plan: GroupPlan
    name: str
    canary: Canary
    step: Step | None = None


class KvCanaryConnector(SchedulerSide, TransferSide, KVConnectorBase_V1, SupportsHMA, Adapter):
    """vLLM V1 KV connector that runs kvcanary on every worker. Loads and saves no KV itself."""

    engine = "vllm"

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        config, stamp_store = connector_config(self._kv_transfer_config)
        Adapter.__init__(self, config)
        bs = int(vllm_config.cache_config.block_size)
        self.plans: list[GroupPlan] | None = plan_groups(kv_cache_config, vllm_config) if kv_cache_config else None
        covered = [p for p in self.plans or [] if p.covered]
        # the group whose first-new-token slots match the worker's rows to the scheduler's requests
        self.primary = covered[0].index if covered else 0
        self.block_size = covered[0].block_size if covered else bs
        # healing: vLLM takes bad block ids from a model with one KV cache group only
        self.ship_blocks = config.mode in vllm_heal.HEAL_MODES
        block_level = len(self.plans or [None]) == 1
        self.heal = vllm_heal.WorkerHeal(config.mode, config.repair_limit, block_level)
        self.sched_heal = vllm_heal.SchedulerHeal()
        if self.ship_blocks and not block_level and role == KVConnectorRole.SCHEDULER:
            log.warning("kvcanary: this model has %d KV cache groups, and vLLM recomputes or fails requests by bad "
                        "block only with one; requests that read corrupted KV are failed one step later instead%s",
                        len(self.plans or []), " (mode 'repair' cannot recompute them)" if config.mode == "repair" else "")
        self.stamp_store = stamp_store
        self.rank = rank()
        SchedulerSide.__init__(self)
        # worker side
        self.groups: list[_Group] = []
        self.forwards = 0
        self.rows: Rows | None = None  # this forward's rows, matched to their requests
        self.drows: DeviceRows | None = None  # the device path: this forward's rows, not read back yet
        self.kept = Kept()  # the CPU path's rows' and steps' buffers, kept across forwards of one shape
        self.device_forwards = 0  # forwards whose steps were built on the device
        self._history: dict[int, list[str]] = {}  # forward -> its rows' request ids (the diagnosis' writers)
        self.seen: set[str] = set()  # requests whose first read of cached KV was verified
        self.meta = CanaryMeta()  # this forward's metadata from the scheduler side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.geometry: dict[str, KvGeometry] = {}  # each covered layer's cache (kvcanary.geometry)
        self.backends: dict[str, str] = {}  # each covered layer's attention backend (its get_name())
        self.spans: dict[str, tuple[int, int]] = {}  # each covered layer's sources in its group's layout
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self._mrope_said = False
        self.audit = VllmAudit(self, int(heads))  # the write check and read audit in each attention layer

    # ---- worker side --------------------------------------------------------------------------

    @property
    def canary(self) -> Canary | None:
        """The primary KV cache group's canary (the only one of a model with one group)."""
        g = self.group(self.primary)
        return g.canary if g is not None else None

    def group(self, index: int) -> _Group | None:
        """The worker's KV cache group ``index`` (``None``: not covered)."""
        return next((g for g in self.groups if g.plan.index == index), None)

    def canaries(self) -> list[Canary]:
        return [g.canary for g in self.groups]

    def named_canaries(self) -> dict[str, Canary]:
        return {g.name: g.canary for g in self.groups}

    def fault_layers(self) -> list[str]:
        """The primary group's fingerprinted layers (where the fault injectors corrupt bytes)."""
        g = self.group(self.primary)
        return list(g.plan.layers) if g is not None else []

    def request_at(self, step: int, row: int) -> str | None:
        rids = self._history.get(step, [])
        return rids[row] or None if 0 <= row < len(rids) else None

    def metric_labels(self) -> dict[str, str]:
        return {"engine": self.engine, "tp_rank": str(self.rank), "pp_rank": str(pp_rank()),
                "dp_rank": str(getattr(self._vllm_config.parallel_config, "data_parallel_rank", 0))}

    @hook("register_kv_caches")
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        plans = self.plans or single_group(self.block_size, list(kv_caches))
        covered = [p for p in plans if p.covered]
        for p in plans:
            if not p.covered:
                log.warning("kvcanary: KV cache %s is not covered: %s", p.describe(), p.why_not)
        for p in covered:
            name = "kv" if len(covered) == 1 else f"g{p.index}"
            self.groups.append(_Group(p, name, self._canary_for(p, kv_caches)))
        self.audit.register(self.groups, {n: g for n, g in self.geometry.items() if self.backends[n] == backends.CPU})
        self.audit.say_skipped({n: b for n, b in self.backends.items() if b != backends.CPU})
        if self.groups:
            positions.install(self)

    @hook("the position check")
    def model_positions(self, given: torch.Tensor | None) -> None:
        """The positions the model is given this forward (:mod:`kvcanary.engines.vllm.positions`):
        each covered group's expected new positions, checked when its new tokens are stamped."""
        if given is None:
            return
        if given.dim() != 1:
            if not self._mrope_said:
                self._mrope_said = True
                log.warning("kvcanary: the model takes M-RoPE positions ([3, tokens]); the positions it is given "
                            "are not checked against the stamped ones")
            return
        for g in self.groups:
            step = g.step
            if step is None or step.num_new > given.shape[0]:
                continue
            # the compiled stamp reads it through the step's descriptor, that field's entries remade
            step.assign_new("expected_new_positions", given[: step.num_new].long())

    def _canary_for(self, plan: GroupPlan, kv_caches: dict[str, torch.Tensor]) -> Canary:
        """A group's canary: each layer's bytes described by the geometry of the attention backend
        vLLM chose for it (:mod:`kvcanary.engines.vllm.backends`), the null block (block 0, which
        tables pad with and nothing may write) reserved."""
        names = [n for n in plan.layers if n in kv_caches]
        bs = plan.block_size
        if not names:  # a group of draft layers only: positions are checked, no bytes
            some = next(iter(kv_caches.values()))
            return Canary(int(some.shape[0]) * bs, None, self.config, device=some.device, healer="vllm")
        layout = backends.resolved_layout(self._vllm_config, self._kv_cache_config)
        layers = []
        for i, n in enumerate(names):
            backend = backends.backend_of(self._vllm_config, n)
            self.backends[n] = backend
            layers.append(backends.geometry(backend, kv_caches[n], bs, backends.layer_spec(plan.spec, n)
                                            if plan.spec is not None else None, layout, i))
        self.geometry.update(zip(names, layers))
        sources: list[Any] = []
        spans = {}
        for i, (n, g) in enumerate(zip(names, layers)):
            start = len(sources)
            sources += g.sources(f"layer{i}")
            spans[n] = (start, len(sources))
        kv = KvLayout(tuple(sources), reserved=tuple(range(bs)))
        canary = Canary(layers[0].num_blocks * bs, kv, self.config, healer="vllm")
        if canary.layout is kv:  # its stamps fingerprint these sources (not with content='none')
            self.spans.update(spans)
        return canary

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        for g in self.groups:
            g.step = None
        if self.groups and isinstance(connector_metadata, CanaryMeta):
            self.before_forward(connector_metadata)

    def metadata(self, by_layer: Any, index: int) -> Any:
        """KV cache group ``index``'s attention metadata in this forward (:func:`group_metadata`)."""
        return group_metadata(by_layer, self.plans or [], index)

    @hook("the before-forward check")
    def before_forward(self, meta: CanaryMeta) -> None:
        """Build each group's step of this forward from its attention metadata and verify every
        cached slot the forward reads."""
        from vllm.forward_context import get_forward_context

        for rid in meta.finished:
            self.book.forget(rid)
            self.seen.discard(rid)
            self.heal.forget(rid)
            self.harm.forget(rid)
        self.book.extend_all([(r.req_id, r.start, r.tokens) for r in meta.reqs if r.tokens])
        by_layer = get_forward_context().attn_metadata
        if meta.zeroed:  # zeroed bytes: their stamps go too (a read before a write is EMPTY)
            for g in self.groups:
                g.canary.release(block_slots(meta.zeroed, g.plan.block_size, g.canary.device))
        if meta.copies:  # copied blocks carry their source's stamps; their landed bytes are verified
            src, dst = [c[0] for c in meta.copies], [c[1] for c in meta.copies]
            for g in self.groups:
                bs = g.plan.block_size
                dev = g.canary.device
                g.canary.import_stamps(block_slots(dst, bs, dev), g.canary.export_stamps(block_slots(src, bs, dev)))
        mds = {g.plan.index: self.metadata(by_layer, g.plan.index) for g in self.groups} if by_layer else {}
        md = mds.get(self.primary)
        if md is None:
            return  # a dummy forward (profiling, warm-up): nothing to check
        live = [g for g in self.groups if mds.get(g.plan.index) is not None]
        self.meta = meta
        if self._on_device(md):
            self._before_on_device(mds, live)
            return
        # the kept buffers where every canary checks a step's values on each use (compiled)
        kept = self.kept if all(g.canary.backend == "fused" for g in live) else None
        rows = self.rows = match_rows(md, meta.reqs, self.book, kept=kept)
        for g in live:
            p = g.plan
            g.step = build_step(mds[p.index], rows, p.block_size, p.window, kept=kept, group=p.index)
        self._bookkeep(rows, live)
        self._verify_first_reads(live, rows)
        for g in live:
            assert g.step is not None
            g.canary.before_forward(g.step)
        self.audit.begin(live, rows, self.forwards)

    def _on_device(self, md: Any) -> bool:
        """Whether this forward's steps are built on the device (``device_steps``; by default where
        the metadata is not on the CPU)."""
        on = self.config.device_steps
        return md.query_start_loc.device.type != "cpu" if on is None else on

    def _before_on_device(self, mds: dict[int, Any], live: list[_Group]) -> None:
        """The device path (:mod:`kvcanary.engines.vllm.device_steps`): each group's step built from
        its metadata on the device and verified, with no value read back before the forward. What
        needs each row's request on the host (:meth:`_bookkeep`, first reads) runs after the
        forward, before the stamps (:meth:`after_forward`). The write check and read audit plan
        from host rows, so they do not run here (they wrap vLLM's CPU attention only)."""
        rows = device_rows(mds[self.primary], self.meta.reqs, self.book)
        self.rows, self.drows = None, rows
        self.audit.folds = {}  # no content folded inside the layers: the stamps fingerprint every source
        for g in live:
            g.step = device_step(mds[g.plan.index], rows, g.plan.block_size, g.plan.window)
            g.canary.before_forward(g.step)
        self.device_forwards += 1
        if self.device_forwards == 1 and self.audit.groups:
            log.warning("kvcanary: steps are built on the device (device_steps); the write check and read audit, "
                        "which plan from host rows before the forward, do not run on its forwards")

    def _bookkeep(self, rows: Rows, live: list[_Group]) -> None:
        """What needs each row's request on the host, before the stamps: the harm count's rows, the
        rows' history (the diagnosis' writers), and the slots to release: rolled-back positions, and
        blocks another KV cache group writes now."""
        # the tokens each row samples: its last sampled token and its drafts, where it reaches the end
        self.harm.forward(self.groups[0].canary.step_id, {
            x.req_id: 1 + len(x.drafts) for x in rows.reqs
            if x is not None and x.computed + x.scheduled - len(x.drafts) >= self.book.have.get(x.req_id, 0)})
        self._history[self.forwards] = rows.rids
        self._history.pop(self.forwards - self.config.history, None)
        if len(live) > 1:
            self._release_other_groups(live)
        for g in live:
            assert g.step is not None
            for i, slots in rolled_back(g.step, rows, g.plan.block_size):
                gone = written_by(slots, g.canary.writers, self._history, rows.rids[i])
                if gone.numel():
                    g.canary.release(gone)

    def _release_other_groups(self, live: list[_Group]) -> None:
        """Block ids are shared by every KV cache group and the groups' layers overlay one memory: a
        block another group writes now belongs to that group, so its stamps in this group go."""
        written = {}
        for g in live:
            assert g.step is not None
            s = g.step.new_slots.long()
            written[g.plan.index] = torch.unique(torch.div(s[s >= 0], g.plan.block_size, rounding_mode="floor"))
        for g in live:
            blocks = torch.cat([b for i, b in written.items() if i != g.plan.index])
            blocks = blocks[(blocks > 0) & (blocks * g.plan.block_size < g.canary.num_slots)]
            if blocks.numel():
                g.canary.release(block_slots(blocks.tolist(), g.plan.block_size, g.canary.device))

    def _verify_first_reads(self, live: list[_Group], rows: Rows) -> None:
        """A request's first step with KV already cached (a local prefix-cache hit) reads blocks it
        did not write: every byte of them is verified before this forward, in every group over the
        positions its kernel reads (up to the positions this same step writes or another connector
        lands, which are checked as they are written or land)."""
        steps = {}
        for g in live:
            assert g.step is not None
            steps[g.name] = g.step
        self.verify_new_readers(steps, rows.rids, self.seen)

    def wait_for_save(self) -> None:
        if any(g.step is not None for g in self.groups):
            self.after_forward()

    @hook("the after-forward check")
    def after_forward(self) -> None:
        """Stamp every group's written slots, verify the reads of this forward's own writes, run the
        patrol's share, then report and heal what the forward's checks found."""
        live = [g for g in self.groups if g.step is not None]
        drows, self.drows = self.drows, None
        if drows is not None:  # the device path: the rows' requests, read back now the forward ran
            self.rows = resolve(drows)
            self._bookkeep(self.rows, live)
        assert self.rows is not None
        rows = self.rows
        self.audit.finish()  # the audited queries every layer kept, in one call
        found: list[Violation] = []
        for g in live:
            assert g.step is not None
            # with this forward's share of the patrol over cold cache
            g.canary.after_forward(g.step, patrol=not rows.unknown_new, folded=self.audit.folds.get(g.name))
            if rows.unknown_new:  # a draft the scheduler had not filled in: its slot's stamp is unknown
                s = g.step.new_slots.long()
                g.canary.forget(s[(s >= 0) & (g.step.new_tokens < 0)])
                g.canary.patrol()
        if drows is not None:  # a request's first read of cached KV, byte for byte (the same bytes: the forward
            self._verify_first_reads(live, rows)  # wrote none of them, and the slots it wrote are stamped now)
        for g in live:
            group = g.name if len(self.groups) > 1 else None
            found += [dataclasses.replace(self._first_reader(g.name, v) if v.site == Site.FIRST_READ
                                          else named(v, rows.rids), group=group) for v in g.canary.drain()]
        one = len(self.groups) == 1
        found += [dataclasses.replace(named(v, rows.rids), group=None if one else v.group) for v in self.audit.drain()]
        self.audit.end()
        self.forwards += 1
        self.report_and_heal(found)
        self.publish_metrics()
        if self.stamp_store:
            self.store_stamps()

    def report_and_heal(self, found: list[Violation]) -> None:
        """Hand a forward's violations to healing (``quarantine``, ``repair``), count the harm, then
        report them."""
        if found:  # with block ids, vLLM drops the reporting forward's output for every reader
            self.count_harm(found, healed=self.ship_blocks and self.heal.block_level)
        if self.ship_blocks and found and self.rows is not None:
            g = self.group(self.primary)
            if g is not None:
                reqs = {r.req_id: r for r in self.rows.reqs if r is not None}
                self.heal.forward(found, reqs, g.plan.block_size, g.canary.num_slots)
                poisoned = self.heal.take_release()
                if poisoned:
                    g.canary.release(block_slots(poisoned, g.plan.block_size, g.canary.device))
        self.report(found, rank=self.rank)

    def heal_counts(self) -> dict[str, int]:
        return {**Adapter.heal_counts(self), **self.heal.counts}

    def own_counts(self) -> dict[str, int]:
        return {**Adapter.own_counts(self), "device_forwards": self.device_forwards}

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The bad blocks of this forward (healing modes, one KV cache group): vLLM drops the forward's
        output for every request whose computed blocks hold one, then recomputes or fails them."""
        return self.heal.take_invalid()

    def build_connector_worker_meta(self) -> vllm_heal.HealReport | None:
        """Requests to fail and blocks to evict, for the scheduler side (healing modes)."""
        return self.heal.take_report()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.ship_blocks:
            self.sched_heal.bind()
            if self.sched_heal.scheduler is None and (self.config.mode == "repair" or not self.heal.block_level):
                raise UnsupportedError(f"kvcanary mode {self.config.mode!r}: this vLLM's scheduler was not found, so "
                                       "requests that keep reading corrupted KV could not be failed")

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, vllm_heal.HealReport):
            self.sched_heal.apply(meta, self._kv_cache_manager)

    def _first_reader(self, name: str, v: Violation) -> Violation:
        rid = self.first_reader(name, v)
        return dataclasses.replace(v, request=rid) if rid else v

    def stats(self) -> dict[str, int]:
        out = Adapter.stats(self)
        out["forwards"] = self.forwards
        out["device_forwards"] = self.device_forwards
        out["steps_kept"] = self.kept.reused  # a group's step refilled in place (the shape held)
        plans = self.plans or []
        out["kv_cache_groups"] = len(plans) or len(self.groups)
        out["kv_cache_groups_covered"] = len(self.groups)
        out.update(self.audit.stats())
        # the scheduler side's hooks (in this process: all of them where the engine runs in-process)
        out["scheduler_us"] = int(SchedulerSide.seconds * 1e6)
        return out

    def recover(self) -> None:
        self.audit.end()
        for g in self.groups:
            g.step = None
        self.rows = self.drows = None
        self.kept.clear()
        Adapter.recover(self)
