"""A randomized clean fuzz of vLLM's CPU build under the canary: configurations that cross vLLM's
features, each run without and with the canary in ``raise`` mode, judged on zero violations, zero
internal errors, an unchanged engine (the same KV cache groups and blocks, the same greedy tokens
wherever vLLM itself is deterministic) and the engine events each configuration claims (drafts,
preemptions, window evictions, aborts).

A crossing draws one of the tiny random-weight architectures of :mod:`kvcanary.faults.vllm_models` or
the trained SmolLM2-135M-Instruct (:data:`REAL`; :mod:`kvcanary.real_model`, its own head size of 64,
real text prompts through its chat template except under ngram drafting, whose prompts are the
repetitive token patterns drafting predicts). vLLM's environment cannot convert the real model (no
``gguf``): :func:`model_path` finds a converted checkpoint or has an interpreter that can convert it
do so (``KVCANARY_REAL_PYTHON``, else the checkout's ``.venv/bin/python``).

``bench/vllm_fuzz.py`` draws and runs many; ``tests_vllm/test_fuzz.py`` runs a few fixed crossings.
Each engine run is its own process (:func:`kvcanary.faults.vllm_runner.run_in_subprocess`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kvcanary.faults import vllm_models
from kvcanary.faults.vllm_runner import run_in_subprocess

WINDOW = 32  # the windowed architectures' sliding window (vllm_models' default)
REAL = "smollm2"  # the trained model: full attention on 30 layers, 3 KV heads of 64
REAL_HEAD_DIM = 64
ARCHS = (*vllm_models.ARCHS, REAL)  # what a crossing draws from
REAL_PYTHON_ENV = "KVCANARY_REAL_PYTHON"  # an interpreter with kvcanary's `real` extra


@dataclass(frozen=True)
class FuzzConfig:
    """One crossing of vLLM's features."""

    arch: str = "llama"
    head_dim: int = 32  # 80 and 112 select the vec16 CPU kernels
    dtype: str = "float32"
    block_size: int = 32
    prefix_caching: bool = True
    prefix: int = 64  # shared-prefix tokens (on or off a block boundary)
    max_batched: int = 2048  # small: chunked prefill
    num_blocks: int | None = None  # None: what vLLM's KV cache space gives; small: preemption
    max_seqs: int = 8
    requests: int = 8
    max_tokens: int = 32
    n: int = 1  # parallel samples (with temperature > 0)
    spec: int = 0  # ngram drafts per step (0: no speculative decoding)
    tensor_parallel: int = 1
    abort: int = 0  # abort every other early request after this many steps (0: none)
    every_byte: bool = False  # content budget none: every read byte verified
    audit: int = 0  # the read audit on every forward with this many queries (0: the default audit)
    # steps built on the device with nothing read back before the forward (the GPU path, on a CPU),
    # the connector's before-forward under the host-sync guard where the engine runs in-process
    device_steps: bool = False
    compiled: bool = False  # vLLM's default model execution (torch.compile), not --enforce-eager
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch: expected one of {list(ARCHS)}, got {self.arch!r}")
        if self.arch == REAL and self.head_dim != REAL_HEAD_DIM:
            raise ValueError(f"head_dim: the real model's is {REAL_HEAD_DIM}, got {self.head_dim}")

    @property
    def name(self) -> str:
        parts = [self.arch, {"float32": "fp32", "bfloat16": "bf16"}.get(self.dtype, self.dtype), f"hd{self.head_dim}",
                 f"bs{self.block_size}", f"pre{self.prefix}" + ("" if self.prefix_caching else "-nocache")]
        parts += [f"chunk{self.max_batched}"] if self.max_batched < 2048 else []
        parts += [f"pool{self.num_blocks}"] if self.num_blocks else []
        parts += [f"n{self.n}"] if self.n > 1 else []
        parts += [f"ngram{self.spec}"] if self.spec else []
        parts += ["tp2"] if self.tensor_parallel > 1 else []
        parts += [f"abort{self.abort}"] if self.abort else []
        parts += [f"max{self.max_tokens}"] + (["every-byte"] if self.every_byte else [])
        parts += ([f"audit{self.audit}"] if self.audit else []) + (["device"] if self.device_steps else [])
        parts += ["compiled"] if self.compiled else []
        parts += [f"s{self.seed}"]
        return "-".join(parts)

    def claims(self) -> list[str]:
        """The engine events this configuration must show."""
        out = []
        if self.spec and self.max_tokens > 8:
            out.append("drafts")
        if self.num_blocks and self.arch != "mistral":  # a window on every layer bounds what a request
            out.append("preemptions")  # holds, and vLLM admits only what fits: such a model is not preempted
        if self.arch in vllm_models.WINDOWED and self.prefix + 3 + self.max_tokens >= WINDOW + 2 * self.block_size:
            out.append("window_freed_blocks")
        if self.abort:
            out.append("aborts")
        return out

    @property
    def deterministic(self) -> bool:
        """Whether two runs of vLLM itself give the same tokens (greedy, no ngram drafts, one rank)."""
        return self.n == 1 and not self.spec and self.tensor_parallel == 1

    def run_cfg(self, model: str) -> dict[str, Any]:
        """The :func:`kvcanary.faults.vllm_runner.run` configuration."""
        cfg: dict[str, Any] = {
            "model": model, "dtype": self.dtype, "block_size": self.block_size, "prefix_caching": self.prefix_caching,
            "prefix": self.prefix, "max_batched": self.max_batched, "num_blocks": self.num_blocks,
            "max_seqs": self.max_seqs, "requests": self.requests, "max_tokens": self.max_tokens, "n": self.n,
            "temperature": 0.8 if self.n > 1 else 0.0, "spec": self.spec, "tensor_parallel": self.tensor_parallel,
            "abort": self.abort, "seed": self.seed, "max_model_len": self.max_model_len,
            "prompts": "repetitive" if self.spec else "text" if self.arch == REAL else "shared",
            "host_sync_guard": self.device_steps, "eager": not self.compiled}
        return cfg

    @property
    def max_model_len(self) -> int:
        return max(256, self.prefix + 40 + self.max_tokens + self.spec + 1)


def pool_for_preemption(arch: str, block_size: int, max_model_len: int) -> int:
    """A pool that holds one request of ``max_model_len`` tokens in every KV cache group, and not
    many more: several long requests at once must preempt."""
    groups = 2 if arch in ("gemma2", "gemma3", "gpt_oss") else 1
    return groups * -(-max_model_len // block_size) + 2


def draw(rng: random.Random, seed: int, archs: tuple[str, ...] = ARCHS) -> FuzzConfig:
    """A random crossing of one of ``archs``; every feature is drawn independently of the others (the
    real model's head size is its own)."""
    arch = rng.choice(archs)
    bs = rng.choice([32, 32, 64, 128])
    prefix = rng.choice([bs, 2 * bs, bs + rng.randrange(1, bs), rng.randrange(8, bs)])
    spec = rng.choice([0, 0, 3, 4])
    n = rng.choice([1, 1, 1, 2, 3])
    max_tokens = rng.choice([1, 24, 48, 96, 160])
    head_dim = rng.choice([32, 64, 80, 112])
    cfg = FuzzConfig(arch=arch, head_dim=REAL_HEAD_DIM if arch == REAL else head_dim, dtype=rng.choice(["float32", "bfloat16"]),
                     block_size=bs, prefix_caching=rng.random() < 0.75, prefix=prefix,
                     max_batched=rng.choice([48, 96, 2048, 2048]), max_seqs=rng.choice([4, 8]),
                     requests=rng.choice([4, 8, 12]), max_tokens=max_tokens, n=n, spec=spec,
                     # the real model's 9 heads do not split over two ranks (vLLM refuses it)
                     tensor_parallel=2 if rng.random() < 0.08 and arch != REAL else 1,
                     abort=rng.choice([0, 0, 0, 4]) if max_tokens >= 24 else 0, every_byte=rng.random() < 0.33,
                     seed=seed)
    if max_tokens > 1 and rng.random() < 0.25:  # a tight pool: preemption (requests outgrow their blocks)
        long = dataclasses.replace(cfg, max_tokens=max(max_tokens, 96), requests=max(cfg.requests, 8), max_seqs=8,
                                   abort=0, block_size=min(bs, 64), prefix=min(cfg.prefix, 96))
        cfg = dataclasses.replace(long, num_blocks=pool_for_preemption(arch, long.block_size, long.max_model_len))
    if cfg.max_batched < 2048:
        cfg = dataclasses.replace(cfg, max_batched=max(cfg.max_batched, cfg.spec + 1 + 16))
    # drawn apart, so that the other features of a seed's crossings stay what they were before they existed
    return dataclasses.replace(cfg, device_steps=random.Random(f"device-{seed}").random() < 0.3,
                               compiled=random.Random(f"compiled-{seed}").random() < 0.2)


def model_path(cfg: FuzzConfig, root: str) -> str:
    """The tiny model of ``cfg``'s architecture and head size under ``root`` (saved once); the real
    model's checkpoint of ``cfg.dtype``: the one in kvcanary's cache where it is converted, else
    converted into ``root`` (as a cache root) by the ``KVCANARY_REAL_PYTHON`` interpreter (default:
    this checkout's ``.venv/bin/python``)."""
    if cfg.arch == REAL:
        from kvcanary import real_model

        cached = real_model.target_dir(cfg.dtype)
        if real_model.is_converted(cached):
            return cached
        src = os.path.dirname(os.path.dirname(os.path.abspath(real_model.__file__)))
        python = os.environ.get(REAL_PYTHON_ENV) or os.path.join(os.path.dirname(src), ".venv", "bin", "python")
        return real_model.model_dir_with(python, cfg.dtype, root=root, say=None)
    path = os.path.join(root, f"{cfg.arch}-hd{cfg.head_dim}")
    if not os.path.exists(os.path.join(path, "config.json")):
        vllm_models.save(path, cfg.arch, head_dim=cfg.head_dim)
    return path


def _env(cfg: FuzzConfig, canary: bool, scratch: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if cfg.tensor_parallel > 1 else "0",
                                  "KVCANARY_VIOLATIONS_LOG": None}
    if cfg.tensor_parallel > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    if canary:
        env.update({"KVCANARY_MODE": "raise", "KVCANARY_CONTENT_BUDGET_BYTES": "none" if cfg.every_byte else "auto",
                    "KVCANARY_VIOLATIONS_LOG": os.path.join(scratch, "violations.jsonl")})
        if cfg.audit:
            env.update({"KVCANARY_AUDIT_QUERIES": str(cfg.audit), "KVCANARY_AUDIT_EVERY": "1",
                        "KVCANARY_AUDIT_BUDGET": "none"})
        if cfg.device_steps:
            env["KVCANARY_DEVICE_STEPS"] = "1"
        if cfg.tensor_parallel > 1:  # the workers' counters come back through the metrics directory
            prom = os.path.join(scratch, "prom")
            os.makedirs(prom, exist_ok=True)
            env.update({"KVCANARY_METRICS": "1", "PROMETHEUS_MULTIPROC_DIR": prom})
    return env


def run_config(cfg: FuzzConfig, root: str, timeout: float = 900) -> dict[str, Any]:
    """Run ``cfg`` without the canary (twice where vLLM may not be deterministic) and with it; return
    the verdict and the figures (``ok``, ``failures``, ``forwards``, ``slots_verified``, drafts,
    preemptions, ...)."""
    model = model_path(cfg, root)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvcanary-fuzz-") as scratch:
        for label, canary in (("off", False), ("off2", False), ("on", True)):
            if label == "off2" and cfg.deterministic:
                continue
            try:
                runs[label] = run_in_subprocess({**cfg.run_cfg(model), "canary": canary}, _env(cfg, canary, scratch),
                                                timeout)
            except RuntimeError as e:
                runs[label] = {"error": str(e)[-1500:]}
        log_path = os.path.join(scratch, "violations.jsonl")
        logged = _read_log(log_path)
        if cfg.tensor_parallel > 1 and "error" not in runs["on"]:
            runs["on"]["stats"] = _prom_stats(os.path.join(scratch, "prom"))
    return judge(cfg, runs, logged)


def judge(cfg: FuzzConfig, runs: dict[str, Any], logged: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict on one configuration's runs."""
    failures: list[str] = []
    on, off = runs["on"], runs["off"]
    for label, r in runs.items():
        if "error" in r:
            failures.append(f"{label} run failed: {r['error'][-600:]}")
    st = on.get("stats", {})
    out: dict[str, Any] = {"config": cfg.name, "cfg": dataclasses.asdict(cfg), "violations": len(logged),
                           "internal_errors": st.get("internal_errors", 0), "forwards": st.get("forwards", 0),
                           "steps": st.get("steps", 0), "slots_verified": st.get("slots_verified", 0),
                           "content_slots_verified": st.get("content_slots_verified", 0),
                           "audit_queries": st.get("audit_queries", 0),
                           "write_slots_checked": st.get("write_slots_checked", 0),
                           "write_slots_unchecked": st.get("write_slots_unchecked", 0),
                           "groups": st.get("kv_cache_groups_covered", 0), "steps_kept": st.get("steps_kept", 0)}
    ev = on.get("events", {})
    out.update({k: ev.get(k, 0) for k in ("drafts", "drafts_accepted", "preemptions", "window_freed_blocks",
                                          "window_reused_blocks")})
    out["drafts_rejected"] = out["drafts"] - out["drafts_accepted"]
    if logged:
        failures.append(f"{len(logged)} violation events; first: {logged[0].get('text') or logged[0]}")
    if out["internal_errors"]:
        failures.append(f"{out['internal_errors']} internal errors")
    if "error" not in on and not out["slots_verified"] and cfg.max_tokens > 1:
        failures.append("the canary verified nothing")
    out["compilation"] = on.get("compilation")
    for label, r in runs.items():  # each run as the crossing says: the model compiled, or eager (NONE)
        got = r.get("compilation")
        if "error" not in r and got not in (None, "unknown") and (got == "NONE") == cfg.compiled:
            failures.append(f"{label} run: vLLM's compilation mode {got}, the crossing says "
                            f"{'compiled' if cfg.compiled else 'eager'}")
    out["device_forwards"] = st.get("device_forwards", 0)
    if "error" not in on and cfg.device_steps and out["device_forwards"] < out["forwards"]:
        failures.append(f"device steps: {out['device_forwards']} of {out['forwards']} forwards built on the device")
    if "error" not in on and "error" not in off:
        failures += _same_engine(cfg, runs)
        failures += _claims(cfg, on)
    out["failures"] = failures
    out["ok"] = not failures
    return out


def _same_engine(cfg: FuzzConfig, runs: dict[str, Any]) -> list[str]:
    on, off = runs["on"], runs["off"]
    out = []
    if on.get("kv_cache") != off.get("kv_cache"):
        out.append(f"KV cache changed: {off.get('kv_cache')} without the canary, {on.get('kv_cache')} with it")
    reproducible = cfg.deterministic or ("off2" in runs and "error" not in runs["off2"]
                                         and runs["off2"]["tokens"] == off["tokens"] and cfg.n == 1)
    if reproducible and cfg.abort == 0 and sorted(on["tokens"].values()) != sorted(off["tokens"].values()):
        out.append("greedy tokens differ with the canary on")
    return out


def _claims(cfg: FuzzConfig, on: dict[str, Any]) -> list[str]:
    ev = on.get("events", {})
    out = []
    for claim in cfg.claims():
        if claim == "aborts":
            if len(on["tokens"]) >= cfg.requests * cfg.n:
                out.append("claimed aborts, but every request finished")
        elif not ev.get(claim):
            out.append(f"claimed {claim}, but the engine showed none")
    return out


def _read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _prom_stats(prom: str) -> dict[str, int]:
    """The canary's counters summed over every worker, from a Prometheus multiprocess directory."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=prom)
    return summed((s.name, s.labels, s.value) for fam in text_string_to_metric_families(generate_latest(reg).decode())
                  for s in fam.samples)


PROM_NAMES = {"kvcanary_slots_verified_total": "slots_verified", "kvcanary_steps_total": "forwards",
              "kvcanary_internal_errors_total": "internal_errors",
              "kvcanary_content_slots_verified_total": "content_slots_verified",
              "kvcanary_device_steps_total": "device_forwards", "kvcanary_audit_queries_total": "audit_queries",
              "kvcanary_write_slots_checked_total": "write_slots_checked"}


def summed(samples: Iterable[tuple[str, dict[str, str], float]]) -> dict[str, int]:
    """The fuzz's counters from metric samples ``(name, labels, value)`` of every rank and KV cache
    group: summed, except the forwards, which each group's canary counts (and the device steps,
    which the connector counts once a forward): a rank's are the most of its groups' counts, summed
    over the ranks."""
    per_forward = {"forwards", "device_forwards"}
    out: dict[str, int] = {}
    ranks: dict[tuple[str, str], int] = {}
    for name, labels, value in samples:
        key = PROM_NAMES.get(name)
        if key is None:
            continue
        if key in per_forward:
            rank = (key, labels.get("tp_rank", ""))
            ranks[rank] = max(ranks.get(rank, 0), int(value))
        else:
            out[key] = out.get(key, 0) + int(value)
    for (key, _), v in ranks.items():
        out[key] = out.get(key, 0) + v
    out["steps"] = out.get("forwards", 0)
    return out


def fuzz(configs: int, seed: int, root: str, progress: Callable[[str], None] = print,
         sink: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Draw and run ``configs`` configurations from ``seed``; report each as it ends."""
    rng = random.Random(seed)
    out = []
    for i in range(configs):
        cfg = draw(rng, seed * 1000 + i)
        progress(f"[{i + 1}/{configs}] {cfg.name} ...")
        res = run_config(cfg, root)
        progress(f"    {'ok' if res['ok'] else 'FAIL'}: {res['forwards']} forwards, {res['slots_verified']} slots "
                 f"verified, drafts {res['drafts_accepted']}/{res['drafts']} accepted, {res['preemptions']} "
                 f"preemptions, {res['window_freed_blocks']} window-freed blocks"
                 + ("" if res["ok"] else f"\n    {res['failures']}"))
        out.append(res)
        if sink is not None:
            sink(res)
    return out
