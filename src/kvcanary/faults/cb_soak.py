"""A randomized clean soak of transformers continuous batching under the canary in raise mode.

Each configuration crosses the engine's features: a model (:data:`MODELS`: a tiny random-weight
architecture of :data:`kvcanary.engines.transformers.models.ARCHS`, full attention, all-sliding,
hybrid sliding + full groups, eager and sdpa attention, a mixture of experts; or the trained
SmolLM2-135M-Instruct of :mod:`kvcanary.real_model`, :data:`REAL`, in bfloat16 unless the
configuration says float32, prompted with real text through its chat template), forks (``num_return_sequences`` 1-3, sampled),
sampling, tight memory (evictions and soft resets), CPU offloading, a warm persistent manager whose
prefix cache already holds blocks written before protection, shared-prefix prompts and chunked
prefill, and the canary's configuration (:data:`CANARY`). :func:`run_cb_config` runs one configuration once
without and once with
``protect(model, CanaryConfig(mode="raise", content_budget_bytes=None, audit_every=1, audit_queries=16,
                                                                                     audit_budget=None))``
(every read byte verified, every forward audited), or, in a third of them, with the defaults in raise
mode (the content window, the patrol, the time budget's query counts and cadence); a clean engine must
give no violation, no internal error, no failed request, no exception and the same tokens.
Violations are read from the protection and from each canary's history (a raise-mode error may die
in the engine's worker thread, leaving only ``error`` strings on the requests: those count too).
:func:`count_events` proves each feature happened. Two features depend on the layer groups: CB
shares prefixes (and so serves a warm manager's cached blocks) only when every layer is full
attention, and an all-sliding model never starves a running request (its need stops at the window),
so tight memory there queues requests instead of soft-resetting them.

Reproducibility of sampling (so sampled runs are compared too): transformers 5.24 seeds torch's
global generator with ``ContinuousBatchingConfig.seed`` when the batch processor is built (every
fresh manager; a persistent manager keeps its processor, so its second session continues the
stream the first one left, the same in both runs), and draws every batch's tokens with one
``torch.multinomial`` over the batch's rows in scheduled order. The canary draws no random
numbers and does not change the schedule, so with the same seed the tokens are the same, forks
included. The one race is the worker thread draining the request queue while ``generate_batch``
still fills it; when the tokens differ the baseline is run again, and if the baseline does not
reproduce itself the comparison is reported as ``None`` (not comparable), never as a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from kvcanary.config import CanaryConfig
from kvcanary.engines.transformers.models import ARCHS, WINDOW, cb_configs, full_layers, tiny_arch

REAL = "smollm2"  # the trained model (kvcanary.real_model), full attention on all of its 30 layers
REAL_LAYERS = 30
MODELS = (*sorted(ARCHS), REAL)  # what a configuration draws from
DTYPES = ("float32", "bfloat16")

MEMORY = ("ample", "tight", "offload")  # offload: tight memory with a CPU tier
CANARY = ("full", "default")  # the canary's configuration in a crossing (CbConfig.canary)
TIGHT_TOKENS = 112  # KV tokens each full-attention layer of a tight pool holds: one or two requests
TIGHT_WINDOWS = 3  # request windows each sliding layer of a tight pool holds


@contextlib.contextmanager
def cpu_offload_shim() -> Iterator[None]:
    """CPU builds of torch cannot pin memory: let the offloading manager allocate its swap pool plainly."""
    from transformers.generation.continuous_batching import offloading_manager

    if torch.cuda.is_available():
        yield
        return

    def empty(*a: Any, pin_memory: bool = False, **k: Any) -> torch.Tensor:
        return torch.empty(*a, **k)

    real = getattr(offloading_manager, "torch")
    setattr(offloading_manager, "torch", types.SimpleNamespace(**{**vars(torch), "empty": empty}))
    try:
        yield
    finally:
        setattr(offloading_manager, "torch", real)


@contextlib.contextmanager
def count_events() -> Iterator[dict[str, int]]:
    """Count what the engine did while the context is open: the proof that a feature was exercised.

    ``forks``: children forked from a parent's cache; ``copied_blocks``: blocks copied inside the
    pool (forks); ``soft_resets``: requests re-queued to prefill from scratch; ``offloaded`` and
    ``restored``: requests moved to and from the CPU tier; ``cache_evictions``: prefix-cache blocks
    evicted under pressure; ``prefix_hit_tokens``: prompt tokens served from the prefix cache;
    ``prefill_chunks``: scheduled prefills split by the token budget.
    """
    from transformers.generation.continuous_batching import cache, offloading_manager, requests
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    ev = dict.fromkeys(("forks", "copied_blocks", "soft_resets", "offloaded", "restored", "cache_evictions",
                        "prefix_hit_tokens", "prefill_chunks"), 0)
    patches: list[tuple[Any, str, Callable[..., Any]]] = []

    def wrap(owner: Any, name: str, count: Callable[[tuple[Any, ...], Any], None], before: bool = False) -> None:
        orig = getattr(owner, name)

        def patched(*a: Any, **k: Any) -> Any:
            if before:  # what the call consumes (a restore clears the offloaded flags)
                count(a, None)
            out = orig(*a, **k)
            if not before:
                count(a, out)
            return out

        patches.append((owner, name, orig))
        setattr(owner, name, patched)

    def add(key: str, n: int) -> None:
        ev[key] += n

    om = offloading_manager.OffloadingManager
    wrap(requests.RequestState, "fork", lambda a, out: add("forks", 1))
    wrap(requests.RequestState, "create_equivalent_initial_request", lambda a, out: add("soft_resets", 1))
    wrap(cache_allocator.CacheAllocator, "copy_blocks", lambda a, out: add("copied_blocks", len(a[1])))
    wrap(om, "_offload_to_cpu", lambda a, out: add("offloaded", len(out)))
    wrap(om, "restore_scheduled_requests",
         lambda a, out: add("restored", sum(fs.state.is_cpu_offloaded for fs in a[1])), before=True)
    wrap(cache.PagedAttentionCache, "evict_cached_blocks", lambda a, out: add("cache_evictions", int(bool(out))))
    wrap(cache.PagedAttentionCache, "search_prefix_match", lambda a, out: add("prefix_hit_tokens", int(out)))
    wrap(requests.FutureRequestState, "__init__", lambda a, out: add("prefill_chunks", int(not a[2])))
    try:
        yield ev
    finally:
        for owner, name, orig in reversed(patches):
            setattr(owner, name, orig)


@dataclass(frozen=True)
class CbConfig:
    """One crossed configuration of the soak (every field is drawn by :func:`random_cb_config`)."""

    seed: int
    arch: str = "llama"  # one of MODELS
    layers: int = 2  # the real model's own (30) whatever is given
    requests: int = 8
    prefix: int = 24  # length of the shared prefixes (0: unrelated prompts)
    prefixes: int = 3
    max_new_tokens: int = 10
    forks: int = 1  # num_return_sequences
    sample: bool = False
    memory: str = "ample"  # one of MEMORY
    warm: bool = False  # a persistent manager served an unprotected session first
    page_size: int = 8
    max_batch_tokens: int = 128  # below the prompt lengths: chunked prefill
    dtype: str | None = None  # None: float32 for the tiny models, bfloat16 for the real one
    # the canary's configuration: "full" (every read byte verified, the write check and 16 queries on every
    # forward) or "default" (the defaults in raise mode: the content window, the patrol, and the time budget's
    # query count and cadence, forwards without queries among them)
    canary: str = "full"

    def __post_init__(self) -> None:
        if self.arch not in MODELS:
            raise ValueError(f"arch: expected one of {list(MODELS)}, got {self.arch!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected None or one of {DTYPES}, got {self.dtype!r}")
        if self.arch == REAL:
            object.__setattr__(self, "layers", REAL_LAYERS)
        if self.memory not in MEMORY:
            raise ValueError(f"memory: expected one of {MEMORY}, got {self.memory!r}")
        if self.forks > 1 and not self.sample:
            raise ValueError(f"forks: expected sample=True with forks > 1, got forks={self.forks}, sample=False")
        if self.canary not in CANARY:
            raise ValueError(f"canary: expected one of {CANARY}, got {self.canary!r}")

    def label(self) -> str:
        feats = [f"forks={self.forks}" if self.forks > 1 else "", "sample" if self.sample else "greedy",
                 self.memory if self.memory != "ample" else "", "warm" if self.warm else "",
                 f"prefix={self.prefix}x{self.prefixes}" if self.prefix else "no-prefix",
                 f"chunk={self.max_batch_tokens}" if self.max_batch_tokens < 64 else "",
                 "default-canary" if self.canary == "default" else ""]
        dtype = {"float32": " fp32", "bfloat16": " bf16"}[self.model_dtype] if self.dtype or self.arch == REAL else ""
        return (f"seed={self.seed} {self.arch}{dtype} L{self.layers} page={self.page_size} "
                + " ".join(f for f in feats if f))

    @property
    def model_dtype(self) -> str:
        """The dtype the model computes in."""
        return self.dtype or ("bfloat16" if self.arch == REAL else "float32")


def random_cb_config(rng: random.Random, seed: int | None = None, models: Sequence[str] = MODELS) -> CbConfig:
    """Draw one crossed configuration from ``models``; ``seed`` (default: drawn) seeds the model and the prompts."""
    forks = rng.choice([1, 1, 2, 3])
    cfg = CbConfig(
        seed=rng.randrange(1 << 30) if seed is None else seed, arch=rng.choice(list(models)),
        layers=rng.choice([2, 2, 4]), requests=rng.randint(4, 12), prefix=rng.choice([0, 16, 24, 40]),
        prefixes=rng.randint(1, 3), max_new_tokens=rng.randint(4, 20), forks=forks,
        sample=forks > 1 or rng.random() < 0.3, memory=rng.choice(MEMORY), warm=rng.random() < 0.3,
        page_size=rng.choice([4, 8, 8, 16]), max_batch_tokens=rng.choice([128, 128, 48, 24]),
    )
    if cfg.arch == REAL and rng.random() < 0.25:  # the real model in float32 too, bfloat16 mostly
        cfg = dataclasses.replace(cfg, dtype="float32")
    # the default canary in a third, drawn apart (from the model's seed) so the other fields' draws stay as they were
    if random.Random(cfg.seed * 7919 + 1).random() < 1 / 3:
        cfg = dataclasses.replace(cfg, canary="default")
    return cfg


def prompts(cfg: CbConfig, tokenizer: Any = None) -> tuple[list[list[int]], list[list[int]]]:
    """The warm session's prompts and the measured session's: the same prefixes, some prompts repeated.
    The real model's are real text (:func:`kvcanary.real_model.text_prompts`, with its ``tokenizer``):
    ``cfg.prefix`` tokens of one of ``cfg.prefixes`` system turns, then a question."""
    n_warm = max(2, cfg.requests // 2)
    n = n_warm + cfg.requests - n_warm // 2
    if cfg.arch == REAL:
        from kvcanary.real_model import text_prompts

        drawn = text_prompts(tokenizer, n, cfg.seed, cfg.prefix, cfg.prefixes)
    else:
        rng = random.Random(cfg.seed)
        heads = [[rng.randrange(1000) for _ in range(cfg.prefix)] for _ in range(cfg.prefixes)]
        drawn = [rng.choice(heads) + [rng.randrange(1000) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    warm = drawn[:n_warm]
    return warm, warm[: n_warm // 2] + drawn[n_warm:]


_REAL_MODELS: dict[str, tuple[Any, Any]] = {}  # dtype -> (model, tokenizer), loaded once per process


def build_model(cfg: CbConfig) -> tuple[Any, Any]:
    """``cfg``'s model and its tokenizer (``None`` for the tiny models, whose prompts are token ids).
    The real model is loaded once per process and dtype (a run leaves it as it was)."""
    if cfg.arch == REAL:
        if cfg.model_dtype not in _REAL_MODELS:
            from kvcanary.real_model import load

            _REAL_MODELS[cfg.model_dtype] = load(cfg.model_dtype, say=None)
        return _REAL_MODELS[cfg.model_dtype]
    model = tiny_arch(cfg.arch, seed=cfg.seed % 1000, layers=cfg.layers)
    return (model if cfg.dtype is None else model.to(getattr(torch, cfg.dtype))), None


def pool_blocks(cfg: CbConfig) -> int:
    """The CB pool size in blocks (a block is one page of every layer). Tight memory holds
    :data:`TIGHT_TOKENS` tokens in each full-attention layer and :data:`TIGHT_WINDOWS` requests' windows
    in each sliding one, so evictions happen whatever the mix of layer groups; ample memory never evicts."""
    if cfg.memory == "ample":
        return 4096 // cfg.page_size
    full = cfg.layers if cfg.arch == REAL else full_layers(cfg.arch, cfg.layers)
    pages = -(-TIGHT_TOKENS // cfg.page_size) * full + TIGHT_WINDOWS * -(-WINDOW // cfg.page_size) * (cfg.layers - full)
    return -(-pages // cfg.layers)


def _engine_configs(cfg: CbConfig) -> tuple[Any, Any]:
    cb: dict[str, Any] = dict(page_size=cfg.page_size, max_batch_tokens=cfg.max_batch_tokens, seed=cfg.seed % 1000)
    cb["num_blocks"] = pool_blocks(cfg)
    if cfg.memory == "offload":
        cb["cpu_offload_space"] = 0.01  # GiB: room for every victim
    gen, cbc = cb_configs(max_new_tokens=cfg.max_new_tokens, **cb)
    gen.do_sample, gen.num_return_sequences = cfg.sample, cfg.forks
    return gen, cbc


@dataclass
class Session:
    """One measured ``generate_batch``: its outputs, the protection (``None`` unprotected), what the
    engine did (:func:`count_events`), the exception it raised and its wall time."""

    out: dict[str, Any]
    guard: Any
    events: dict[str, int]
    error: dict[str, str] | None
    seconds: float


def session(model: Any, cfg: CbConfig, guard_config: CanaryConfig | None = None, hooks: Sequence[Any] = (),
            tokenizer: Any = None) -> Session:
    """One run of ``cfg`` (the warm session unprotected; the measured one under ``guard_config``,
    with ``hooks`` run before each forward's checks; ``tokenizer``: the real model's)."""
    from kvcanary.engines.transformers.entry import protect

    gen, cb = _engine_configs(cfg)
    warm_ps, ps = prompts(cfg, tokenizer)
    out: dict[str, Any] = {}
    error = None
    guard = protect(model, guard_config) if guard_config is not None else None
    if guard is not None:
        guard.hooks.extend(hooks)
    events: dict[str, int] = {}
    with torch.inference_mode(), cpu_offload_shim():
        try:
            if cfg.warm:
                model.generate_batch(warm_ps, generation_config=gen, continuous_batching_config=cb,
                                     persistent_manager=True)
            t0 = time.perf_counter()
            try:
                with count_events() as events, guard if guard is not None else contextlib.nullcontext():
                    out = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb,
                                               persistent_manager=cfg.warm)
            except Exception as e:  # a KvCorruptionError here, in a clean run, is a false positive
                error = {"type": type(e).__name__, "message": str(e)[:500]}
            seconds = time.perf_counter() - t0
        finally:
            if cfg.warm:
                model.destroy_cached_continuous_batching_manager()
    return Session(out, guard, events, error, seconds)


def tokens(out: dict[str, Any]) -> dict[str, list[int]]:
    return {k: list(v.generated_tokens) for k, v in out.items()}


def _guard_report(guard: Any) -> dict[str, Any]:
    st = guard.stats()
    # a canary's history also holds what a raise-mode poll drained and raised in the engine's thread
    seen = list(guard.violations) or [v for g in guard.groups.values() for v in g.canary.history]
    return {
        "forwards": st["forwards"], "slots_verified": st.get("slots_verified", 0),
        "slots_stamped": st.get("slots_stamped", 0), "slots_scrubbed": st.get("slots_scrubbed", 0),
        "guard_checks": st.get("guard_checks", 0),
        "content_bytes": sum(st.get(k, 0) for k in ("content_bytes_verified", "content_bytes_stamped",
                                                     "content_bytes_scrubbed")),
        "slots_unverifiable": st.get("slots_unverifiable", 0),
        "violations": max(st.get("violations", 0), len(seen)),
        "first_violations": [guard.describe(v) for v in seen[:3]],
        "internal_errors": st.get("internal_errors", 0),
        # the read audit's queries, and the forwards the time budget audited none of (the default canary)
        "audit_queries": st.get("audit_queries", 0),
        "audit_forwards_without_queries": st.get("audit_forwards_without_queries", 0),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The engine's and the canary's loggers down to critical: everything that matters is in the result."""
    loggers = [logging.getLogger(n) for n in ("ContinuousBatchingLogger", "kvcanary", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def run_cb_config(cfg: CbConfig, hooks: Sequence[Any] = ()) -> dict[str, Any]:
    """Run ``cfg`` without and with the canary (raise mode, every read slot's bytes, or the defaults in raise
    mode: ``cfg.canary``) and report.

    ``ok`` is true when the protected run had no violation, internal error, failed or missing request
    or exception, and its tokens equal the baseline's (or the baseline is not reproducible: ``None``);
    a baseline with failed requests is not ok either (the configuration does not run).
    ``hooks`` go to the protection (fault injectors: a harness that must see them fail).
    """
    t0 = time.perf_counter()
    model, tok = build_model(cfg)
    with _quiet():
        base = session(model, cfg, None, tokenizer=tok)
        # every read byte verified, and the write check and read audit on every forward; or the defaults
        full = CanaryConfig(mode="raise", content_budget_bytes=None, audit_every=1, audit_queries=16, audit_budget=None)
        run = session(model, cfg, full if cfg.canary == "full" else CanaryConfig(mode="raise"), hooks, tok)
        same: bool | None = tokens(run.out) == tokens(base.out)
        if not same and not run.error:
            again = session(model, cfg, None, tokenizer=tok)
            same = None if tokens(again.out) != tokens(base.out) else False
    failed = {k: v.error for k, v in run.out.items() if v.error is not None}
    expected = cfg.requests * cfg.forks
    res: dict[str, Any] = {"config": asdict(cfg), "label": cfg.label(), **_guard_report(run.guard)}
    res.update({
        "requests": expected, "request_errors": len(failed), "first_request_error": next(iter(failed.values()), None),
        "missing_requests": expected - len(run.out),
        "baseline_errors": sum(v.error is not None for v in base.out.values()),
        "exception": run.error, "outputs_identical": same, "events": run.events,
        "wall_s_off": round(base.seconds, 3), "wall_s_on": round(run.seconds, 3),
        "wall_s": round(time.perf_counter() - t0, 3),
    })
    res["ok"] = (res["violations"] == 0 and res["internal_errors"] == 0 and not failed and res["missing_requests"] == 0
                 and run.error is None and same is not False and res["baseline_errors"] == 0)
    return res


SUMMED = ("forwards", "slots_verified", "slots_stamped", "guard_checks", "content_bytes", "internal_errors",
          "request_errors")


def draw_configs(n: int, seed: int, models: Sequence[str] = MODELS) -> list[CbConfig]:
    """The first ``n`` configurations of the soak with ``seed``, drawn from ``models``; the k-th has
    model seed ``seed * 1000 + k``."""
    rng = random.Random(seed)
    return [random_cb_config(rng, seed * 1000 + k, models) for k in range(n)]


def failure(res: dict[str, Any]) -> str | None:
    """Why a :func:`run_cb_config` result is not clean, in one line (``None`` when it is)."""
    if res["ok"]:
        return None
    if res["first_violations"]:
        return f"{res['violations']} violation(s), first: {res['first_violations'][0]}"
    if res["exception"] is not None:
        return f"{res['exception']['type']}: {res['exception']['message']}"
    if res["internal_errors"]:
        return f"{res['internal_errors']} internal error(s)"
    if res["request_errors"] or res["missing_requests"]:
        return (f"{res['request_errors']} failed, {res['missing_requests']} missing request(s): "
                f"{res['first_request_error']}")
    if res["baseline_errors"]:
        return f"{res['baseline_errors']} request(s) failed without the canary: the configuration does not run"
    return "generated tokens differ from the run without the canary"


def soak(n: int, seed: int, progress: Callable[[int, dict[str, Any]], None] | None = None,
         configs: Sequence[CbConfig] | None = None) -> dict[str, Any]:
    """Run ``n`` drawn configurations (or ``configs``); ``progress(k, result)`` after each. Returns the aggregate."""
    agg: dict[str, Any] = dict(configurations=0, forwards=0, slots_verified=0, slots_stamped=0, guard_checks=0,
                               content_bytes=0, false_positives=0, internal_errors=0, request_errors=0, exceptions=0,
                               outputs_different=0, outputs_not_comparable=0, failed=[])
    for k, cfg in enumerate(draw_configs(n, seed) if configs is None else configs):
        res = run_cb_config(cfg)
        agg["configurations"] += 1
        for key in SUMMED:
            agg[key] += res[key]
        agg["false_positives"] += res["violations"]
        agg["exceptions"] += res["exception"] is not None
        agg["outputs_different"] += res["outputs_identical"] is False
        agg["outputs_not_comparable"] += res["outputs_identical"] is None
        if not res["ok"]:
            agg["failed"].append(res["label"])
        if progress is not None:
            progress(k, res)
    return agg
