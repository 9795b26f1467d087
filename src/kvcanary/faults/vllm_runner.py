"""Run a tiny vLLM CPU engine once per process, and the vLLM rows of ``kvcanary selftest``.

:func:`run` runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager) on a local model,
optionally under the canary (the ``KvCanaryConnector`` flag) and with one fault of
:mod:`kvcanary.faults.vllm` injected in the worker. :func:`run_in_subprocess` runs it in a fresh
interpreter::

    python -m kvcanary.faults.vllm_runner '{"model": DIR, "canary": true, "fault": "flip_v", ...}'

which prints one line, ``RESULT {json}``. A process per run: vLLM keeps per-process globals (the KV
connector agent) that a second engine in the same process would inherit. :func:`selftest` runs every
fault of :data:`FAULTS` once per seed on a tiny random Llama and says whether, how and how fast the
canary caught it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvcanary.faults.catalog import BY_NAME
from kvcanary.faults.runner import FaultResult
from kvcanary.violations import Check

RESULT = "RESULT "
# stats that are levels, not counts: reported as they are after the run, not as a difference
LEVELS = frozenset({"num_slots", "patrol_pass_steps", "unverified_age_max_steps", "guard_slots", "scrub_position",
                    "kv_cache_groups", "kv_cache_groups_covered", "audit_queries_per_forward"})
# set (unless already set) before vLLM is imported: one in-process engine, a 1 GiB KV space
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
# the selftest's runs: in-process engines (the canary and the fault in reach), the canary in log mode
# with every read byte verified, so a flipped byte is found on its next read
SELFTEST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVCANARY_MODE": "log", "KVCANARY_CONTENT": "all",
                "KVCANARY_CONTENT_BUDGET_BYTES": "none"}


@dataclass(frozen=True)
class FaultSpec:
    """One fault of :mod:`kvcanary.faults.vllm` as the selftest runs it."""

    name: str  # a key of kvcanary.faults.vllm.INJECTORS
    reproduces: str  # the catalog class it is an instance of ("" when none is)
    checks: Check  # any of these firing at or after the injection counts as its detection
    max_forwards: int  # forwards within which it must be detected (1: the forward it lands in)
    env: tuple[tuple[str, str], ...] = ()  # configuration over the selftest's (KVCANARY_* variables)
    run: tuple[tuple[str, Any], ...] = ()  # engine run keys over the selftest's (see :func:`run`)
    audit: bool = False  # needs the write check or read audit: run again without them, where nothing is found

    @property
    def zoo(self) -> tuple[str, ...]:
        return BY_NAME[self.reproduces].zoo if self.reproduces else ()


def _spec(name: str, reproduces: str, also: Check = Check(0)) -> FaultSpec:
    fc = BY_NAME[reproduces]
    return FaultSpec(name, reproduces, fc.checks | also, fc.max_forwards)


FAULTS: tuple[FaultSpec, ...] = (
    _spec("flip_v", "bit_flip"),
    _spec("redirect", "table_redirect"),
    # the writer's row no longer starts at the slot the scheduler sent, so its write lands unstamped:
    # its readers see changed bytes as well as foreign stamps
    _spec("reuse", "slot_reused_while_referenced", also=Check.CONTENT),
    FaultSpec("zero", "", Check.CONTENT, 1),  # a live block zeroed (vLLM zeroes blocks it believes free)
    _spec("flip_k", "bit_flip"),
    # no content window and no patrol: only the first-read check can find it, before the read
    FaultSpec("flip_first_read", "cold_bytes_then_prefix_hit", Check.CONTENT, 1,
              (("KVCANARY_CONTENT_BUDGET_BYTES", "0"), ("KVCANARY_PATROL_BUDGET_BYTES", "0"))),
    _spec("write_null_block", "padding_write_into_reserved"),
    # speculative decoding (ngram drafts on a repetitive prompt): the forward after a rejection reads
    # rejected drafts' KV as context, all of it or one slot of it; their slots were released at the
    # rollback and this forward's writes land on them for other positions
    FaultSpec("keep_rejected_drafts", "", Check.EMPTY | Check.POSITION | Check.LINK | Check.TOKEN, 1,
              run=(("spec", 3), ("prompts", "repetitive"), ("max_tokens", 48))),
    FaultSpec("rollback_one_short", "", Check.EMPTY | Check.POSITION | Check.LINK | Check.TOKEN, 1,
              run=(("spec", 3), ("prompts", "repetitive"), ("max_tokens", 48))),
    # the positions the model forward is given, one request's shifted for one forward (default config)
    _spec("position_shift", "position_shift"),
    # inside the first layer's forward (kvcanary.audit), every request and layer audited each forward
    *(FaultSpec(name, cls, BY_NAME[cls].checks, 1, (("KVCANARY_AUDIT_QUERIES", "64"), ("KVCANARY_AUDIT_EVERY", "1"),
                                                            ("KVCANARY_AUDIT_BUDGET", "none")),
                audit=True)
      for name, cls in (("kernel_read_next_page", "attention_read_bug"), ("kernel_write_zeros", "write_lands_zeros"),
                        ("kernel_scale_of_one", "wrong_softmax_scale"))),
)
NO_AUDIT = {"KVCANARY_AUDIT_QUERIES": "0", "KVCANARY_WRITE_CHECK": "0"}


def save_tiny_llama(path: str, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                    intermediate: int | None = None, vocab: int = 512, seed: int = 0) -> str:
    """Save a Llama with random weights from ``seed`` to ``path`` (nothing is downloaded); returns ``path``.

    The defaults are the vLLM tests' model: 2 layers, hidden 128, 4 heads of 32, 2 KV heads, vocab 512.
    """
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=1024)
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    return path


def prompts(n: int, seed: int, prefix: int = 64, vocab: int = 512, shape: str = "shared") -> list[list[int]]:
    """``n`` prompts: one of 3 random ``prefix``-token prefixes plus a random tail of 3 to 30 tokens.
    ``shape="repetitive"``: every prefix and tail a short random pattern repeated (ngram drafting
    finds its continuations in the prompt)."""
    if shape not in ("shared", "repetitive"):
        raise ValueError(f"prompts: expected 'shared' or 'repetitive', got {shape!r}")
    rng = random.Random(seed)

    def draw(k: int) -> list[int]:
        if shape == "shared":
            return [rng.randrange(vocab) for _ in range(k)]
        pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
        return (pattern * (k // len(pattern) + 1))[:k]

    prefixes = [draw(prefix) for _ in range(3)]
    return [rng.choice(prefixes) + draw(rng.randint(3, 30)) for _ in range(n)]


def guard_before_forward() -> None:
    """Run the connector's before-forward (the steps built and verified before the forward starts)
    under :func:`kvcanary.faults.host_sync.no_host_sync`, scoped to the engine adapters' code (the
    token book's buffer is host memory by construction; its device copies are written, never read):
    a device value they read back there is a :class:`~kvcanary.faults.host_sync.HostSync`, counted as
    an internal error (raised in ``raise`` mode). With ``device_steps`` on a CPU pool this proves the
    GPU path reads nothing back; the canary's own ops are proven so on the Triton path by
    ``tests/test_no_host_sync.py``."""
    from kvcanary.engines.vllm.entry import KvCanaryConnector
    from kvcanary.faults.host_sync import no_host_sync

    orig = KvCanaryConnector.before_forward

    def before_forward(self: Any, meta: Any) -> None:
        with no_host_sync(scope=("/kvcanary/engines/",), exempt=("/kvcanary/engines/token_book.py",)):
            orig(self, meta)

    KvCanaryConnector.before_forward = before_forward  # type: ignore[method-assign]


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one engine in this process (once per process) and return what it did.

    ``cfg`` keys: ``model`` (a local folder, required); ``canary`` (turn the connector on);
    ``kv_transfer_config`` (instead of the plain connector flag); ``fault``, ``fault_at`` (a fault of
    :mod:`kvcanary.faults.vllm`, injected at that forward or the first later one with a target);
    ``seed`` (prompts and fault); ``requests``, ``prefix`` (shared prefix tokens), ``max_tokens``,
    ``prompts`` (``"shared"``: shared prefixes and random tails; ``"repetitive"``: the same, each
    made of a short repeated pattern, which ngram drafting predicts; ``"text"``: real text through
    the model's own tokenizer and chat template, :func:`kvcanary.real_model.text_prompts`); ``prompt_ids``
    (the timed run's prompts as token ids instead, e.g. a trained model's chat prompts); ``warmup`` (requests of a
    first, untimed generate on other prompts; the stats returned leave it out); sampling ``n``
    (parallel samples per request) and ``temperature``; ``spec`` (ngram speculative decoding with
    this many drafts); engine sizes ``num_blocks`` (``None``: what the KV cache space holds),
    ``block_size``, ``max_batched``, ``max_seqs``, ``max_model_len``, ``dtype``, ``tensor_parallel``,
    ``prefix_caching``; ``abort`` (a step count: half the requests start, every other one of them is
    aborted after that many steps, then the rest join); ``full_scrub`` (after the run, every slot's
    bytes compared with its stamp: :func:`full_scrub`, returned as ``full_scrub``);
    ``host_sync_guard`` (the connector's before-forward under :func:`guard_before_forward`).

    Returns ``tokens`` (request id, with ``/j`` for the j-th of ``n`` samples -> generated ids),
    ``finish`` (the same keys -> vLLM's finish reason: ``length``, ``stop``, ``error``...),
    ``events`` (:data:`kvcanary.engines.vllm.events.EVENTS` counted during the run; ``preemptions``
    is also at the top level), ``kv_cache`` (the engine's KV cache groups and blocks, in-process
    engines), ``generate_s`` (the timed generate call) and ``generate_cpu_s`` (its CPU seconds, every
    thread of the process: on a shared machine, what another tenant's load does not add),
    ``tokens_generated``, ``threads`` (torch's intra-op threads after the run), ``compilation``
    (vLLM's compilation mode, ``NONE``: eager) and, under the canary of an in-process engine,
    ``stats`` and ``violations`` (the first 200, with ``text``), the compiled-loop signatures the run
    added to the warm-up's (``loop_signatures_added``, by name), and the injected fault's ``fault``
    detail (``step``: the canary step it landed in). A multiprocess engine
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment) keeps its canaries and faults in its
    worker processes: read them from ``KVCANARY_VIOLATIONS_LOG`` and the metrics.
    """
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcanary.faults import vllm as faults_vllm
    from kvcanary.engines.vllm import events as vllm_events

    kvc = None
    if cfg.get("canary"):
        kvc = cfg.get("kv_transfer_config") or {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"}
    events_file = None
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":  # the scheduler runs in another process
        events_file = os.environ.setdefault("KVCANARY_EVENTS_FILE",
                                            os.path.join(tempfile.mkdtemp(prefix="kvcanary-events-"), "events"))
    events = vllm_events.watch() if events_file is None else {}
    seed = cfg.get("seed", 0)
    fault = faults_vllm.install(cfg["fault"], cfg.get("fault_at", 3), seed) if cfg.get("fault") else None
    if cfg.get("host_sync_guard") and kvc is not None:
        guard_before_forward()
    llm = _engine(cfg, kvc)
    sp = SamplingParams(max_tokens=cfg.get("max_tokens", 16), temperature=cfg.get("temperature", 0.0),
                        n=cfg.get("n", 1), ignore_eos=True)
    shape = cfg.get("prompts", "shared")
    draw = _prompt_source(cfg["model"], shape)

    def generate(n: int, seed: int) -> tuple[list[Any], float]:
        given = cfg.get("prompt_ids") if seed == cfg.get("seed", 0) else None  # the warm-up draws its own
        ps = [TokensPrompt(prompt_token_ids=p) for p in given or draw(n, seed, cfg.get("prefix", 64))]
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        return outs, time.perf_counter() - t0

    if cfg.get("warmup"):
        generate(cfg["warmup"], seed + 1000)
    canary = process_canary() if kvc is not None else None
    before = canary.stats() if canary is not None else {}
    cpu0 = time.process_time()  # the timed run's CPU seconds, every thread of this process
    if cfg.get("abort"):
        outs, wall = _with_aborts(llm, draw(cfg.get("requests", 12), seed, cfg.get("prefix", 64)), sp, cfg["abort"])
    else:
        outs, wall = generate(cfg.get("requests", 12), seed)
    cpu = time.process_time() - cpu0
    tokens = {o.request_id if len(o.outputs) == 1 else f"{o.request_id}/{j}": list(c.token_ids)
              for o in outs for j, c in enumerate(o.outputs)}
    finish = {o.request_id if len(o.outputs) == 1 else f"{o.request_id}/{j}": c.finish_reason
              for o in outs for j, c in enumerate(o.outputs)}
    if events_file is not None:
        events = vllm_events.collect(events_file)
    out: dict[str, Any] = {"tokens": tokens, "finish": finish, "events": dict(events), "preemptions": events["preemptions"],
                           "kv_cache": vllm_events.kv_cache_layout(llm), "generate_s": wall, "generate_cpu_s": cpu,
                           "tokens_generated": sum(len(t) for t in tokens.values()),
                           "threads": torch.get_num_threads(), "compilation": vllm_events.compilation(llm)}
    if canary is not None:
        out["stats"] = {k: v if k in LEVELS else v - before.get(k, 0) for k, v in canary.stats().items()}
        out["violations"] = [{**v.to_dict(), "text": v.describe()} for v in canary.violations[:200]]
        from kvcanary import fused  # imported by the connector already (numba before the engine breaks its start)

        # compiled-loop signatures the run needed beyond the warm-up's (kvcanary warmup compiles those)
        out["loop_signatures_added"] = fused.added_since_warm_up()
        if cfg.get("full_scrub"):
            out["full_scrub"] = full_scrub(canary)
    if fault is not None and canary is not None:
        out["fault"] = fault.detail
    return out


def _prompt_source(model: str, shape: str) -> Callable[[int, int, int], list[list[int]]]:
    """``draw(n, seed, prefix)``: the prompts of ``shape`` (see :func:`run`)."""
    if shape != "text":
        return lambda n, seed, prefix: prompts(n, seed, prefix, shape=shape)
    import transformers

    from kvcanary.real_model import text_prompts

    tok = transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    return lambda n, seed, prefix: text_prompts(tok, n, seed, prefix)


def _with_aborts(llm: Any, ps: list[list[int]], sp: Any, after: int) -> tuple[list[Any], float]:
    """Drive the engine step by step: the first half of ``ps`` starts, every other one of them is
    aborted after ``after`` steps, then the second half joins (and reuses the freed blocks)."""
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    half = len(ps) // 2
    t0 = time.perf_counter()
    for i, p in enumerate(ps[:half]):
        eng.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    done: list[Any] = []
    for k in range(10_000):
        if k == after:
            eng.abort_request([str(i) for i in range(0, half, 2)])
            for i, p in enumerate(ps[half:], start=half):
                eng.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
        done += [o for o in eng.step() if o.finished]
        if k > after and not eng.has_unfinished_requests():
            break
    return done, time.perf_counter() - t0


def _engine(cfg: dict[str, Any], kv_transfer_config: dict[str, Any] | None) -> Any:
    """The ``vllm.LLM`` of ``cfg``: eager (``cfg["eager"]`` False: vLLM's default, the model compiled
    by torch.compile), block size 32 and prefix caching unless ``cfg`` says otherwise,
    greedy-reproducible (seed 0)."""
    from vllm import LLM

    spec = None
    if cfg.get("spec"):
        spec = {"method": "ngram", "num_speculative_tokens": int(cfg["spec"]), "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    return LLM(model=cfg["model"], skip_tokenizer_init=True, enforce_eager=cfg.get("eager", True),
               dtype=cfg.get("dtype", "float32"),
               block_size=cfg.get("block_size", 32), enable_prefix_caching=cfg.get("prefix_caching", True),
               num_gpu_blocks_override=cfg.get("num_blocks", 64), speculative_config=spec,
               max_num_batched_tokens=cfg.get("max_batched", 2048), max_num_seqs=cfg.get("max_seqs", 16),
               max_model_len=cfg.get("max_model_len", 512), tensor_parallel_size=cfg.get("tensor_parallel", 1),
               kv_transfer_config=kv_transfer_config, seed=0)


def full_scrub(conn: Any) -> dict[str, Any]:
    """After a run: every slot of every group's pool fingerprinted again and compared with its stamp
    (``slots``: the stamped slots compared; ``violations``: what differed, as text)."""
    import torch

    slots, found = 0, []
    for g in conn.groups:
        c = g.canary
        before = c.stats().get("slots_scrubbed", 0)
        c.scrub(torch.arange(c.num_slots, device=c.device))
        slots += c.stats().get("slots_scrubbed", 0) - before
        found += [v.describe() for v in c.drain()]
    return {"slots": slots, "violations": found}


def process_canary() -> Any:
    """This process's KvCanaryConnector (also when listed under a MultiConnector); None when the engine's
    worker is another process, or the connector is another one (:mod:`kvcanary.faults.null_connector`)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return next((c for c in getattr(conn, "_connectors", [conn]) if hasattr(c, "violations")), None)


def run_in_subprocess(cfg: dict[str, Any], env: dict[str, str | None] | None = None,
                      timeout: float = 600, module: str = "kvcanary.faults.vllm_runner") -> dict[str, Any]:
    """:func:`run` (or another ``module``'s ``CFG_JSON`` -> ``RESULT`` line entry) in a fresh
    interpreter (this one's), with ``env`` over this environment (``None`` removes a variable).
    Raises ``RuntimeError`` with the end of its stderr when it fails."""
    full = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    try:
        p = subprocess.run([sys.executable, "-m", module, json.dumps(cfg)],
                           capture_output=True, text=True, timeout=timeout, env=full)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the vLLM engine run did not finish within {timeout:.0f} s") from None
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"the vLLM engine run failed (exit {p.returncode}): {p.stderr[-3000:]}")
    return dict(json.loads(line[len(RESULT):]))


def run_fault(spec: FaultSpec, seed: int, model: str) -> FaultResult:
    """Inject ``spec`` once into a tiny vLLM engine under the canary and judge the detection; a
    fault that needs the audit runs again without it, where nothing may be found."""
    res = _run_fault(spec, seed, model)
    if spec.audit:
        cfg = {"model": model, "canary": True, "fault": spec.name, "seed": seed, "max_seqs": 4, **dict(spec.run)}
        try:
            out = run_in_subprocess(cfg, env={**SELFTEST_ENV, **dict(spec.env), **NO_AUDIT, "KVCANARY_VIOLATIONS_LOG": None})
            injected = (out.get("fault") or {}).get("step") is not None
            res.missed_without_audit = injected and not out["violations"] and not out["stats"]["internal_errors"]
            if out["violations"]:
                res.detail["found_without_audit"] = out["violations"][0]["text"]
        except RuntimeError as e:
            res.missed_without_audit = False
            res.detail["error_without_audit"] = str(e)[-500:]
        res.ok = res.ok and bool(res.missed_without_audit)
    return res


def _run_fault(spec: FaultSpec, seed: int, model: str) -> FaultResult:
    cfg = {"model": model, "canary": True, "fault": spec.name, "seed": seed, "max_seqs": 4, **dict(spec.run)}
    try:
        out = run_in_subprocess(cfg, env={**SELFTEST_ENV, **dict(spec.env), "KVCANARY_VIOLATIONS_LOG": None})
    except RuntimeError as e:
        return _result(spec, seed, {"error": str(e)})
    detail = out.get("fault") or {}
    at = detail.get("step")
    if at is None:
        return _result(spec, seed, {"error": "no target for the fault appeared"})
    errors = out["stats"]["internal_errors"]
    found = out["violations"]
    early = [v for v in found if v["step"] < at]
    if early or errors:
        why = {"false_positive": early[0]["text"]} if early else {"internal_errors": errors}
        return _result(spec, seed, {**detail, **why}, at=at)
    want = {c.name for c in Check if c in spec.checks}
    hits = [v for v in found if want & set(v["checks"])]
    if not hits:
        return _result(spec, seed, detail, at=at)
    first = hits[0]
    fired = sorted({c for v in hits if v["step"] == first["step"] for c in v["checks"]})
    # whom the reports name, and where: the requests the fault hurt, the slots it hit
    detail = {**detail, "hurt": sorted({v["request"] for v in hits if v["request"]}),
              "hit_slots": sorted({v["slot"] for v in hits})[:64]}
    # a corruption present when forward k's checks run is found by forward k: 1 forward
    res = _result(spec, seed, detail, fired, first["step"] - at + 1, first["text"], at)
    res.harmful_tokens = int(out["stats"].get("harmful_tokens", 0))
    return res


def _result(spec: FaultSpec, seed: int, detail: dict[str, Any], fired: list[str] | None = None,
            forwards: int | None = None, first: str | None = None, at: int | None = None) -> FaultResult:
    ok = forwards is not None and forwards <= spec.max_forwards
    return FaultResult(spec.name, "vllm", seed, list(spec.zoo), "detect", forwards is not None, fired or [], forwards,
                       spec.max_forwards, ok, detail, first, at)


def selftest(seeds: int, progress: Callable[[str], None] = lambda s: None) -> list[tuple[FaultSpec, list[FaultResult]]]:
    """Every fault of :data:`FAULTS` run once per seed (a vLLM process each) on a tiny random Llama."""
    with tempfile.TemporaryDirectory(prefix="kvcanary-vllm-") as d:
        progress("  saving a tiny random Llama for vLLM ...")
        model = save_tiny_llama(d)
        out = []
        for spec in FAULTS:
            results = []
            for seed in range(seeds):
                progress(f"  {spec.name} on vllm, seed {seed} ...")
                results.append(run_fault(spec, seed, model))
            out.append((spec, results))
        return out


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcanary.faults.vllm_runner CFG_JSON``: :func:`run`, then one ``RESULT`` line."""
    args = sys.argv[1:] if argv is None else argv
    print(RESULT + json.dumps(run(json.loads(args[0]))), flush=True)


if __name__ == "__main__":  # vLLM starts its helper processes by spawn
    main()
