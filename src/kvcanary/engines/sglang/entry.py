"""Protect SGLang's engine with one environment variable and nothing in the user's code:

    KVCANARY_MODE=log python -m sglang.launch_server --model-path MODEL ...
    KVCANARY_MODE=log python my_script.py          # which makes sgl.Engine(model_path=...)

kvcanary's ``sglang.srt.plugins`` entry point (:func:`kvcanary.engines.sglang.plugin.register`),
which SGLang loads in each of its processes, calls :func:`install` when ``KVCANARY_MODE`` is set
(``log``, ``raise`` or ``quarantine``; the other ``KVCANARY_*`` variables configure the canary as
everywhere). A user who restricts SGLang's plugins with ``SGLANG_PLUGINS`` lists ``kvcanary`` there.

Hook points: class-level wraps of SGLang's own methods, installed once per process, doing work only
in the scheduler process (where, with one tensor-parallel rank, the model runner, the KV pool, the
``req_to_token`` table and the radix cache live):

================================================ =================================================
SGLang method                                    what the canary does there
================================================ =================================================
``TpModelWorker.forward_batch_generation``       takes the forward's ``ScheduleBatch``: its
                                                 requests, in the order of the batch's rows
``ModelRunner.forward`` (the target runner)      before: the step from the ``ForwardBatch`` and
                                                 ``req_to_token`` (:mod:`.steps`), every read slot
                                                 verified (a request's first read of cached KV
                                                 byte for byte); after: the written slots stamped
                                                 and fingerprinted, reads of them verified, the
                                                 patrol's share, then report and heal (:mod:`.heal`)
``TokenToKVPoolAllocator.free`` / ``.clear``     freed slots released (a free group counted once,
                                                 when it ends): a read before a new write is EMPTY
``ReqToTokenPool.free``                          the request left its row: its stream goes
================================================ =================================================

Radix-cache hits, prefix deduplication (a row re-pointed to the tree's slots after a forward),
chunked prefill, ``n > 1``, aborts and retraction all reach the canary through these: the table is
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
from kvcanary.engines.sglang.scheduler import book_rows, request_ids
from kvcanary.engines.sglang.steps import build_step
from kvcanary.errors import ConfigError, UnsupportedError
from kvcanary.geometry.pages import page_major
from kvcanary.layout import KvLayout
from kvcanary.step import Step
from kvcanary.violations import Site, Violation

log = logging.getLogger("kvcanary")
MODES = ("log", "raise", "quarantine")  # what KVCANARY_MODE may say for SGLang ("off": nothing installed)
NAME = "kv"  # the one pool's canary


class SglangCanary(Adapter):
    """kvcanary in SGLang's scheduler process: one canary over the token-to-KV pool."""

    engine = "sglang"

    def __init__(self, config: CanaryConfig) -> None:
        Adapter.__init__(self, config)
        self.runner: Any = None  # the target model runner the canary watches
        self.allocator: Any = None
        self.canary: Canary | None = None
        self.off = False  # the engine's cache is one kvcanary does not describe: nothing is checked
        self.batch: Any = None  # the ScheduleBatch of the running forward
        self.reqs: list[Any] = []
        self.rids: list[str] = []
        self.step: Step | None = None
        self.seen: set[str] = set()  # requests whose first read of cached KV was verified
        self.forwards = 0
        self.failed: dict[str, str] = {}  # requests failed by the canary -> the evidence
        self._history: dict[int, list[str]] = {}  # forward -> its rows' request ids

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
        two halves of one allocation), slot 0 (SGLang's padding slot) reserved."""
        pool, alloc = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
        if type(alloc).__name__ != "TokenToKVPoolAllocator" or int(getattr(pool, "page_size", 1)) != 1:
            raise UnsupportedError(f"SGLang KV allocator {type(alloc).__name__} with page size "
                                   f"{getattr(pool, 'page_size', '?')}: kvcanary describes TokenToKVPoolAllocator "
                                   f"(page size 1) pools")
        ks, vs = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
        if not isinstance(ks, list) or not isinstance(vs, list) or len(ks) != len(vs) or not ks:
            raise UnsupportedError(f"SGLang KV pool {type(pool).__name__}: expected per-layer k_buffer and v_buffer "
                                   f"lists (MHATokenToKVPool); MLA, hybrid SWA and quantized pools are not described")
        if ks[0].device.type != "cpu":
            raise UnsupportedError(f"SGLang KV pool on {ks[0].device}: the SGLang adapter runs on CPU pools")
        layers = [page_major(k.unsqueeze(1), v.unsqueeze(1), i) for i, (k, v) in enumerate(zip(ks, vs))]
        layout = KvLayout(tuple(s for i, g in enumerate(layers) for s in g.sources(f"layer{i}")), reserved=(0,))
        healer = "sglang" if self.config.mode in heal.HEAL_MODES else None
        self.canary = Canary(int(ks[0].shape[0]), layout, self.config, healer=healer)
        self.allocator = alloc
        log.info("kvcanary: watching SGLang's KV pool: %d slots, %d layers (mode %s)", self.canary.num_slots,
                 len(ks), self.config.mode)

    # ---- the forward ----------------------------------------------------------------------------

    @hook("the before-forward check")
    def before_forward(self, fb: Any) -> None:
        """The step of this forward, and every cached slot it reads verified."""
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
        step = build_step(fb, table, self.book.buf if rows is not None else None, rows)
        if step is None:
            return
        self.step = step
        self._history[self.forwards] = self.rids
        self._history.pop(self.forwards - self.config.history, None)
        self.verify_new_readers({NAME: step}, self.rids, self.seen)
        c.before_forward(step)

    @hook("the after-forward check")
    def after_forward(self) -> None:
        """Stamp the written slots, verify reads of them, run the patrol's share; report and heal."""
        step, self.step = self.step, None
        c = self.canary
        if step is None or c is None:
            return
        c.after_forward(step, patrol=True)
        found = [self._first_reader(v) if v.site == Site.FIRST_READ else named(v, self.rids) for v in c.drain()]
        self.forwards += 1
        if found and self.config.mode == "quarantine":
            hurt = heal.hurt(found, step, self.rids)
            evidence = f"kvcanary: {found[0].describe()}"
            for rid in heal.fail(self.reqs, hurt, evidence, None):
                self.failed[rid] = evidence
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
        for rid in heal.fail(self.reqs, None, message, 500):
            self.failed[rid] = message

    # ---- the engine's frees ---------------------------------------------------------------------

    @hook("a free of KV slots")
    def on_free(self, allocator: Any, index: torch.Tensor) -> None:
        if allocator is self.allocator and allocator.free_group is None and self.canary is not None:
            self.canary.release(index.long())

    @hook("the KV allocator's reset")
    def on_clear(self, allocator: Any) -> None:
        if allocator is self.allocator and self.canary is not None:
            self.canary.release(torch.arange(1, self.canary.num_slots))

    def on_row_free(self, req: Any) -> None:
        """A request left its ``req_to_token`` row (it finished, was aborted or retracted)."""
        rid = str(req.rid)
        self.book.forget(rid)
        self.seen.discard(rid)

    def stats(self) -> dict[str, int]:
        out = Adapter.stats(self)
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
        raise ConfigError(f"KVCANARY_MODE: expected one of {', '.join(MODES)} or off for SGLang, got "
                          f"{config.mode!r} (repair, recomputing the requests that read corrupted KV, is not done on "
                          f"SGLang yet)")
    return config


def install(config: CanaryConfig | None = None) -> SglangCanary | None:
    """Wrap SGLang's methods (once per process) so that this process's forwards are checked;
    returns the adapter (``None`` in mode ``off``: nothing is wrapped)."""
    config = config or config_from_env()
    if config.mode == "off":
        return None
    if _adapter:
        return _adapter[0]
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    ad = SglangCanary(config)
    _adapter.append(ad)
    _wrap(TpModelWorker, "forward_batch_generation", _taking_batch(ad))
    _wrap(ModelRunner, "forward", _checking_forward(ad))
    _wrap(TokenToKVPoolAllocator, "free", lambda orig: _after(orig, ad, ad.on_free))
    _wrap(TokenToKVPoolAllocator, "clear", lambda orig: _after(orig, ad, ad.on_clear))
    _wrap(ReqToTokenPool, "free", lambda orig: _before_row_free(orig, ad))
    return ad


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig = getattr(cls, name)
    fn = make(orig)
    fn.__wrapped__ = orig  # type: ignore[attr-defined]
    fn.__name__ = name
    setattr(cls, name, fn)


def _taking_batch(ad: SglangCanary) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward_batch_generation(self: Any, batch: Any = None, *a: Any, **k: Any) -> Any:
            ad.batch = batch
            try:
                return orig(self, batch, *a, **k)
            finally:
                ad.batch = None

        return forward_batch_generation

    return make


def _checking_forward(ad: SglangCanary) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: Any, forward_batch: Any, *a: Any, **k: Any) -> Any:
            if not ad.watches(self):
                return orig(self, forward_batch, *a, **k)
            _delivered(ad, ad.before_forward, forward_batch)
            out = orig(self, forward_batch, *a, **k)
            _delivered(ad, ad.after_forward)
            return out

        return forward

    return make


def _delivered(ad: SglangCanary, fn: Callable[..., Any], *args: Any) -> None:
    """Run a hook; what it raises (``raise`` mode only: the others never raise) goes to the
    forward's callers (:meth:`SglangCanary.deliver`), not into SGLang's scheduler."""
    try:
        fn(*args)
    except Exception as e:
        ad.deliver(e)


def _after(orig: Callable[..., Any], ad: SglangCanary, then: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        _delivered(ad, then, self, *a)
        return out

    return wrapper


def _before_row_free(orig: Callable[..., Any], ad: SglangCanary) -> Callable[..., Any]:
    def free(self: Any, req: Any, *a: Any, **k: Any) -> Any:
        ad.on_row_free(req)
        return orig(self, req, *a, **k)

    return free
