"""vLLM's GPU attention backends' caches under the canary, against the CPU backend's on the same K/V.

For each backend and layout (:mod:`kvcanary.geometry.vllm_gpu`), two layers are allocated as vLLM
0.32 lays them out (:mod:`vllm_layouts`; ``tests_vllm/test_gpu_backends.py`` checks that against
vLLM's own allocation) and written through the backends' own split of the content axis; the same
K and V go into a CPU-backend (``vec``) cache through its own indexing. Then on each canary backend
(torch, fused, Triton under the interpreter):

- the prefill's stamps' token, position and link equal the CPU-backend cache's, bit for bit, and
  their content fingerprint the torch reference's on the same layout (a fingerprint keys each word
  by where it sits in the layout's runs, so layouts of other runs fingerprint the same K/V apart);
- the next step verifies clean;
- one flipped byte, at an address of the independent writer's, is found at that slot and position.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig, Check
from kvcanary.geometry.vllm_cpu import vllm_cpu
from kvcanary.geometry.vllm_gpu import vllm_gpu
from kvcanary.layout import KvLayout
from kvcanary.source import storage_bytes

from factories import DEV, clone_step, prefill_of, random_step, step_to
from vllm_layouts import allocate, element, write_kv

NB, BS, H, D, LAYERS = 8, 16, 2, 8, 2
DTYPE = torch.float16
GPU = [("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBNHC"), ("FLASHINFER", "LBHNC"), ("FLASHINFER", "BLHNC"),
       ("TRITON_ATTN", "LBHNC"), ("FLEX_ATTENTION", "LBNHC")]
# Triton under the interpreter on one layout of each stride order (it is slow)
CASES = [(gpu, b) for gpu in GPU for b in ("torch", "fused")] + [
    pytest.param(gpu, "triton", marks=pytest.mark.triton) for gpu in (("FLASH_ATTN", "LBNHC"), ("FLASHINFER", "LBHNC"))]


def kv_values(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(NB * BS, H, D, generator=g).to(DTYPE) for _ in range(2)) for _ in range(LAYERS)]


def gpu_cache(backend: str, layout: str, kvs, dev: torch.device | str = "cpu"
              ) -> tuple[KvLayout, list[torch.Tensor], dict[str, int]]:
    views, strides = allocate(layout, LAYERS, NB, H, BS, D, DTYPE, dev)
    for view, (k, v) in zip(views, kvs):
        write_kv(view, k.to(dev), v.to(dev))
    geoms = [vllm_gpu(t, backend, layout, BS, H, D, layer=i) for i, t in enumerate(views)]
    return KvLayout(tuple(s for i, g in enumerate(geoms) for s in g.sources(f"layer{i}"))), views, strides


def cpu_cache(kvs) -> KvLayout:
    """The CPU backend's ``vec`` layout: per block and head K as ``[D, BS]``, then V as ``[BS, D]``."""
    layers = []
    for k, v in kvs:
        t = torch.zeros(NB, H, BS, 2 * D, dtype=DTYPE)
        for s in range(NB * BS):
            b, n = divmod(s, BS)
            cell = t[b].view(H, -1)
            cell[:, torch.arange(D) * BS + n] = k[s]
            cell[:, BS * D + n * D + torch.arange(D)] = v[s]
        layers.append(vllm_cpu(t, "vec", BS, H, D))
    return KvLayout(tuple(s for i, g in enumerate(layers) for s in g.sources(f"layer{i}")))


def canary(layout: KvLayout, backend: str) -> Canary:
    cfg = CanaryConfig(mode="log", backend=backend, content_budget_bytes=None, patrol_budget_bytes=0)
    return Canary(NB * BS, layout, cfg)


def steps(seed: int = 0):
    rng = random.Random(seed)
    step, stoks = random_step(rng, NB * BS, BS, [(20, 3), (33, 1), (1, 5)])
    return prefill_of(step, stoks), step


@pytest.fixture(scope="module")
def reference():
    """The CPU backend's canary after the prefill: its stamps are the reference."""
    kvs = kv_values()
    c = canary(cpu_cache(kvs), "torch")
    pre, _ = steps()
    c.after_forward(pre)
    assert c.drain() == []
    return kvs, c.stamps.clone()


@pytest.mark.parametrize("gpu,backend", CASES, ids=lambda x: "-".join(x) if isinstance(x, tuple) else x)
def test_gpu_layout_stamps_verify_and_faults_agree_with_the_cpu_backend(reference, gpu, backend):
    kvs, want = reference
    dev = DEV if backend == "triton" else torch.device("cpu")  # on a GPU machine: CUDA tensors
    layout, views, strides = gpu_cache(*gpu, kvs, dev)
    c = canary(layout, backend)
    pre, step = steps()
    c.after_forward(step_to(clone_step(pre), dev))
    got = c.stamps.cpu()
    assert torch.equal(got[:, :3], want[:, :3]), "token, position or link differ from the CPU backend's"
    if backend != "torch":
        ref = canary(gpu_cache(*gpu, kvs)[0], "torch")
        ref.after_forward(pre)
        assert torch.equal(got, ref.stamps), f"{backend}: stamps differ from the torch reference's on the same layout"
    written = pre.new_slots
    assert bool((got[written, 3] != 0).all()) and got[written, 3].unique().numel() == written.numel()
    c.before_forward(step_to(clone_step(step), dev))
    c.after_forward(step_to(clone_step(step), dev))
    assert c.drain() == []
    # one flipped byte of a cached token's V in layer 1, where the backend's own indexing puts it
    row, pos = 1, 17
    slot = int(step.lookup(torch.tensor([row]), torch.tensor([pos]))[0])
    at = element(strides, BS, D, 1, "v", slot, 1, 5) * views[1].element_size()
    storage_bytes(views[1])[at] ^= 0x10
    c.before_forward(step_to(_decode_after(step), dev))
    got = [(v.slot, v.position, v.checks) for v in c.drain()]
    assert got and all(x[:2] == (slot, pos) and Check.CONTENT in x[2] for x in got), got


def _decode_after(step):
    """A step that reads every position ``step`` left cached and writes nothing."""
    from kvcanary.step import Step

    cached = step.cached_lens + (step.new_offsets[1:] - step.new_offsets[:-1])
    rows = cached.shape[0]
    empty = torch.empty(0, dtype=torch.int64)
    return Step(cached_lens=cached, new_offsets=torch.zeros(rows + 1, dtype=torch.int64), new_tokens=empty,
                new_positions=empty, new_slots=empty, block_table=step.block_table, block_size=step.block_size,
                row_valid=step.row_valid, expected_tokens=step.expected_tokens, expected_rows=step.expected_rows)


def test_layers_the_audit_cannot_wrap_are_counted_and_said_once(caplog):
    """On a GPU backend the write check and read audit (a wrapper inside the attention call, which a
    full CUDA graph captures) do not run: the layers are counted in stats and named in one warning."""
    from types import SimpleNamespace

    from kvcanary.engines.vllm.audit import VllmAudit

    audit = VllmAudit(SimpleNamespace(config=CanaryConfig(mode="log")), 4)
    with caplog.at_level("WARNING", logger="kvcanary"):
        audit.say_skipped({"model.layers.0.self_attn.attn": "FLASH_ATTN", "model.layers.1.self_attn.attn": "FLASH_ATTN"})
    said = [r.getMessage() for r in caplog.records if "audit_layers_skipped" in r.getMessage()]
    assert len(said) == 1 and "2 layer(s) on FLASH_ATTN" in said[0]
    assert audit.stats()["audit_layers_skipped"] == 2
    caplog.clear()
    cpu_only = VllmAudit(SimpleNamespace(config=CanaryConfig(mode="log")), 4)
    cpu_only.say_skipped({})
    assert cpu_only.stats()["audit_layers_skipped"] == 0 and not caplog.records


def test_layers_the_compiled_loops_cannot_read_are_counted_and_said_once(caplog):
    """A compiled canary's layer whose cache has no descriptor for the compiled loops (or a dtype they
    do not compute in) is checked by the torch path, several times slower: counted, and said once."""
    from types import SimpleNamespace

    from kvcanary.engines.vllm.audit import VllmAudit
    from kvcanary.geometry.vllm_cpu import vllm_cpu

    def audit_over(geometries, backend="fused"):
        audit = VllmAudit(SimpleNamespace(config=CanaryConfig(mode="log")), 4)
        group = SimpleNamespace(canary=SimpleNamespace(backend=backend))
        for i, geo in enumerate(geometries):
            name = f"model.layers.{i}.self_attn.attn"
            audit.groups[name], audit.geometry[name] = group, geo
        audit.say_torch_layers()
        return audit

    def cache(dtype):
        return torch.zeros(4, 2, 32, 2 * 32, dtype=dtype)

    readable = [vllm_cpu(cache(torch.bfloat16), isa, 32, 2, 32) for isa in ("vec", "amx")]
    slow = vllm_cpu(cache(torch.float8_e5m2), "vec", 32, 2, 32)  # an fp8 cache: no compiled loop computes in it
    with caplog.at_level("WARNING", logger="kvcanary"):
        assert audit_over(readable).stats()["audit_layers_torch"] == 0 and not caplog.records
        assert audit_over([*readable, slow]).stats()["audit_layers_torch"] == 1
    said = [r.getMessage() for r in caplog.records if "audit_layers_torch" in r.getMessage()]
    assert len(said) == 1 and "1 layer(s) (StridedKv in torch.float8_e5m2)" in said[0]
    caplog.clear()
    assert audit_over([slow], backend="torch").stats()["audit_layers_torch"] == 0 and not caplog.records
