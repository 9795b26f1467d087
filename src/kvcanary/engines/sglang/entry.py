"""Protect SGLang's engine with one environment variable and nothing in the user's code:

    KVCANARY_MODE=log python -m sglang.launch_server --model-path MODEL ...
    KVCANARY_MODE=repair python my_script.py       # which makes sgl.Engine(model_path=...)

kvcanary's ``sglang.srt.plugins`` entry point (:func:`kvcanary.engines.sglang.plugin.register`),
which SGLang loads in each of its processes, calls :func:`install` when ``KVCANARY_MODE`` is set
(``log``, ``raise``, ``quarantine`` or ``repair``; the other ``KVCANARY_*`` variables configure the
canary as everywhere). A user who restricts SGLang's plugins with ``SGLANG_PLUGINS`` lists
``kvcanary`` there. The SGLang methods wrapped, and what the canary does in each, are listed in
:mod:`.hooks`; this module holds the adapter those wraps call.

Radix-cache hits, prefix deduplication (a row re-pointed to the tree's slots after a forward),
chunked prefill, ``n > 1``, aborts and retraction all reach the canary through them: the table is
read as it stands at each forward, and stamps depend on tokens and positions, never on slot ids.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from kvcanary.canary import Canary
from kvcanary.config import CanaryConfig
from kvcanary.engines.base import Adapter, hook, named
from kvcanary.engines.sglang import heal
from kvcanary.engines.sglang.audit import SglangAudit
from kvcanary.engines.sglang.hooks import wrap_all
from kvcanary.engines.sglang.scheduler import book_rows, request_ids
from kvcanary.engines.sglang.steps import build_step, host_counts
from kvcanary.errors import ConfigError, UnsupportedError
from kvcanary.geometry.pages import page_major
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

log = logging.getLogger("kvcanary")
MODES = ("log", "raise", "quarantine", "repair")  # what KVCANARY_MODE may say for SGLang ("off": nothing installed)
NAME = "kv"  # the one pool's canary


class SglangCanary(Adapter):
    """kvcanary in SGLang's scheduler process: one canary over the token-to-KV pool, the write check
    and read audit on its torch-native attention, and the healing of the requests it finds hurt."""

    engine = "sglang"

    def __init__(self, config: CanaryConfig) -> None:
        Adapter.__init__(self, config)
        self.runner: Any = None  # the target model runner the canary watches
        self.allocator: Any = None
        self.canary: Canary | None = None
        self.audit: SglangAudit | None = None
        self.heal = heal.Heal(config.mode, config.repair_limit)
        self.off = False  # the engine's cache is one kvcanary does not describe: nothing is checked
        self.batch: Any = None  # the ScheduleBatch of the running forward
        self.reqs: list[Any] = []
        self.rids: list[str] = []
        self.step: Step | None = None
        self.seen: set[str] = set()  # requests whose first read of cached KV was verified
        self.forwards = 0
        self.raised: dict[str, str] = {}  # raise mode: requests failed with the canary's error
        self._history: dict[int, list[str]] = {}  # forward -> its rows' request ids

    @property
    def failed(self) -> dict[str, str]:
        """Every request the canary failed -> the evidence."""
        return {**self.heal.failed, **self.raised}

    def canaries(self) -> list[Canary]:
        return [self.canary] if self.canary is not None else []

    def named_canaries(self) -> dict[str, Canary]:
        return {NAME: self.canary} if self.canary is not None else {}

    def request_at(self, step: int, row: int) -> str | None:
        rids = self._history.get(step, [])
        return rids[row] or None if 0 <= row < len(rids) else None

    # ---- binding to the engine's pool -----------------------------------------------------------

    def watches(self, runner: Any) -> bool:
        """Whether ``runner``'s forwards are checked: the first target (not draft) runner of the
        process binds the canary to its pool."""
        if self.off or getattr(runner, "is_draft_worker", False):
            return False
        if self.runner is None:
            self.runner = runner
            try:
                self.bind(runner)
            except (UnsupportedError, ConfigError) as e:
                self.off = True
                log.error("kvcanary: the canary is off in this SGLang process: %s", e)
                return False
        return runner is self.runner

    def bind(self, runner: Any) -> None:
        """The canary over ``runner``'s pool: every layer's K and V rows (``[slots, heads, dim]``, the
        two halves of one allocation), slot 0 (SGLang's padding slot) reserved; the audit over the
        model's attention layers."""
        pool, alloc = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
        if type(alloc).__name__ != "TokenToKVPoolAllocator" or int(getattr(pool, "page_size", 1)) != 1:
            raise UnsupportedError(f"SGLang KV allocator {type(alloc).__name__} with page size "
                                   f"{getattr(pool, 'page_size', '?')}: kvcanary describes TokenToKVPoolAllocator "
                                   f"(page size 1) pools")
        ks, vs = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
        if not isinstance(ks, list) or not isinstance(vs, list) or len(ks) != len(vs) or not ks:
            raise UnsupportedError(f"SGLang KV pool {type(pool).__name__}: expected per-layer k_buffer and v_buffer "
                                   f"lists (MHATokenToKVPool); MLA, hybrid SWA and quantized pools are not described")
        args = getattr(runner, "server_args", None)
        if self.config.mode in heal.HEAL_MODES and args is not None and not getattr(args, "disable_overlap_schedule",
                                                                                    True):
            raise ConfigError(f"KVCANARY_MODE={self.config.mode} on SGLang needs the overlap scheduler off "
                              f"(--disable-overlap-schedule): a request is healed before its next forward is "
                              f"scheduled")
        layers = [page_major(k.unsqueeze(1), v.unsqueeze(1), i) for i, (k, v) in enumerate(zip(ks, vs))]
        layout = KvLayout(tuple(s for i, g in enumerate(layers) for s in g.sources(f"layer{i}")), reserved=(0,))
        healer = "sglang" if self.config.mode in heal.HEAL_MODES else None
        self.canary = Canary(int(ks[0].shape[0]), layout, self.config, healer=healer)
        self.allocator = alloc
        attns = [m for m in runner.model.modules() if type(m).__name__ == "RadixAttention"]
        backend = type(getattr(runner, "attn_backend", None)).__name__
        if backend != "TorchNativeAttnBackend" and (self.config.write_check or self.config.audit_queries):
            log.warning("kvcanary: SGLang's %s attention is not audited (the write check and read audit wrap the "
                        "torch-native backend)", backend)
            attns = []
        self.audit = SglangAudit(self, attns, layers, NAME, self.canary.backend == "fused")
        log.info("kvcanary: watching SGLang's KV pool: %d slots, %d layers (mode %s)", self.canary.num_slots,
                 len(ks), self.config.mode)

    # ---- the forward ----------------------------------------------------------------------------

    @hook("the before-forward check")
    def before_forward(self, fb: Any) -> None:
        """The step of this forward, every cached slot it reads verified, the audit planned."""
        self.step = None
        c = self.canary
        assert c is not None
        batch = self.batch
        reqs = list(batch.reqs) if batch is not None and batch.reqs is not None else None
        n = int(fb.batch_size)
        self.rids = request_ids(reqs, n)
        self.reqs = reqs if reqs is not None and len(reqs) == n else []
        table = self.runner.req_to_token_pool.req_to_token
        ends = getattr(fb, "seq_lens_cpu", None)
        ends = (ends if ends is not None else fb.seq_lens).tolist()
        rows = book_rows(self.book, self.reqs, ends) if self.reqs else None
        expected = None
        if rows is not None:  # the token book, where the pool is (a CUDA pool's copy gets what changed)
            dev = c.device
            expected = self.book.buf if dev.type == "cpu" else self.book.on(dev)
            rows = rows if dev.type == "cpu" else rows.to(dev)
        step = build_step(fb, table, expected, rows)
        if step is None:
            return
        self.step = step
        self._history[self.forwards] = self.rids
        self._history.pop(self.forwards - self.config.history, None)
        if c.device.type == "cpu":  # elsewhere after the forward (where reading positions back waits for nothing)
            self.verify_new_readers({NAME: step}, self.rids, self.seen)
        c.before_forward(step)
        if self.audit is not None:
            self.audit.begin(step, *host_counts(fb), self.rids, self.forwards)

    def attention(self, attn: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, o: torch.Tensor,
                  wrote: bool) -> None:
        """After one layer's torch-native attention: its write check and audited queries (a failure is
        the audit's: counted, or raised in ``raise`` mode, and this forward's audit is dropped)."""
        if self.audit is not None and self.step is not None:
            self.audit.layer(attn, q, k, v, o, wrote)

    @hook("the after-forward check")
    def after_forward(self) -> None:
        """Stamp the written slots, verify reads of them, run the patrol's share; report, and decide
        what happens to the requests hurt."""
        step, self.step = self.step, None
        c = self.canary
        if step is None or c is None:
            return
        audit = self.audit
        if audit is not None:
            audit.finish()
        c.after_forward(step, patrol=True)
        if c.device.type != "cpu":  # a request's first read of cached KV, byte for byte: the same bytes (the
            self.verify_new_readers({NAME: step}, self.rids, self.seen)  # forward wrote none of them)
        raw = c.drain() + (audit.drain() if audit is not None else [])
        if audit is not None:
            audit.end()
        found = [self._first_reader(v) if v.site == Site.FIRST_READ else named(v, self.rids) for v in raw]
        self.forwards += 1
        if self.config.mode in heal.HEAL_MODES and (found or self.heal.spoiled):
            self.heal.forward(found, step, self.rids)
        self.report(found)
        self.publish_metrics()

    def _first_reader(self, v: Violation) -> Violation:
        rid = self.first_reader(NAME, v)
        return dataclasses.replace(v, request=rid) if rid else v

    def deliver(self, e: BaseException) -> None:
        """``raise`` mode: fail every request of this forward with the canary's error (status 500),
        which SGLang raises in each caller's ``generate``; the engine goes on."""
        self.pending = None
        message = f"kvcanary: {type(e).__name__}: {e}"
        for rid in heal.fail_all(self.reqs, message, 500):
            self.raised[rid] = message

    # ---- the scheduler ---------------------------------------------------------------------------

    def settle(self, sched: Any, batch: Any, process: Callable[[], Any]) -> Any:
        """Around the scheduler's processing of a forward's results: the hurt requests' outputs
        dropped, then each recomputed or failed (:meth:`kvcanary.engines.sglang.heal.Heal.settle`).
        A failure of the canary's own here is counted; SGLang's processing runs once whatever
        happens."""
        if not self.heal.due and not self.heal.poisoned:
            return process()
        ran: list[Any] = []

        def once() -> Any:
            ran.append(process())
            return ran[0]

        self.shielded("healing", self.heal.settle, sched, batch, once)
        return ran[0] if ran else process()

    # ---- the engine's frees ---------------------------------------------------------------------

    @hook("a free of KV slots")
    def on_free(self, allocator: Any, index: torch.Tensor) -> None:
        if allocator is self.allocator and allocator.free_group is None and self.canary is not None:
            self.canary.release(index.long())
            self.heal.freed(index)

    @hook("the KV allocator's reset")
    def on_clear(self, allocator: Any) -> None:
        if allocator is self.allocator and self.canary is not None:
            self.canary.release(torch.arange(1, self.canary.num_slots, device=self.canary.device))
            self.heal.clear()

    @hook("a request leaving its row")
    def on_row_free(self, req: Any) -> None:
        """A request left its ``req_to_token`` row (it finished, was aborted, retracted or repaired)."""
        rid = str(req.rid)
        self.book.forget(rid)
        self.seen.discard(rid)
        if req.finished():
            self.heal.forget(rid)

    def heal_counts(self) -> dict[str, int]:
        return {**Adapter.heal_counts(self), **self.heal.counts}

    def stats(self) -> dict[str, int]:
        out = Adapter.stats(self)
        if self.audit is not None:
            out.update(self.audit.stats())
        out["forwards"] = self.forwards
        out["requests_failed"] = len(self.failed)
        return out

    def recover(self) -> None:
        self.step = None
        self.seen.clear()
        Adapter.recover(self)


# ---- installation -------------------------------------------------------------------------------

_adapter: list[SglangCanary] = []  # this process's adapter, once installed


def current() -> SglangCanary | None:
    """This process's adapter (``None``: not installed)."""
    return _adapter[0] if _adapter else None


def config_from_env() -> CanaryConfig:
    """The canary's configuration from the ``KVCANARY_*`` variables; a mode the SGLang adapter does
    not run is refused by name."""
    config = CanaryConfig.from_env(CanaryConfig(mode="log"))
    if config.mode not in MODES and config.mode != "off":
        raise ConfigError(f"KVCANARY_MODE: expected one of {', '.join(MODES)} or off for SGLang, got {config.mode!r}")
    return config


def install(config: CanaryConfig | None = None) -> SglangCanary | None:
    """Wrap SGLang's methods (once per process, :func:`kvcanary.engines.sglang.hooks.wrap_all`) so
    that this process's forwards are checked; returns the adapter (``None`` in mode ``off``:
    nothing is wrapped)."""
    config = config or config_from_env()
    if config.mode == "off":
        return None
    if _adapter:
        return _adapter[0]
    ad = SglangCanary(config)
    _adapter.append(ad)
    wrap_all(ad)
    return ad
