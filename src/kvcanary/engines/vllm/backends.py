"""Each layer's cache geometry from the attention backend vLLM chose for that layer, at start.

The backend is the layer's own (``static_forward_context[name].get_attn_backend()``, named by its
``get_name()``); the order of its cache in memory is the layout the engine resolved for the model
(``kv_cache_config.kv_cache_layout``); its heads and head sizes come from the group's KV cache
spec. The tensor is then checked against what they say, never read for them:

=================================== =========================================================
backend                             geometry
=================================== =========================================================
``CPU_ATTN``                        :func:`~kvcanary.geometry.vllm_cpu.vllm_cpu` (by its kernels)
``FLASH_ATTN``, ``FLASHINFER``,     :func:`~kvcanary.geometry.vllm_gpu.vllm_gpu` (by the layout)
``TRITON_ATTN``, ``FLEX_ATTENTION``
=================================== =========================================================

Any other backend (MLA's among them: one latent row per token, not a K and a V) is refused by name
when the canary starts, with the known ones listed.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.errors import UnsupportedError
from kvcanary.geometry.base import KvGeometry
from kvcanary.geometry.vllm_cpu import ISAS, vllm_cpu
from kvcanary.geometry.vllm_gpu import BACKENDS, vllm_gpu

CPU = "CPU_ATTN"
KNOWN = (CPU, *BACKENDS)


def backend_of(vllm_config: Any, name: str) -> str:
    """The name (``get_name()``) of the attention backend vLLM chose for layer ``name``."""
    layer = vllm_config.compilation_config.static_forward_context.get(name)
    cls = None
    if layer is not None:
        get = getattr(layer, "get_attn_backend", None)
        cls = get() if callable(get) else getattr(layer, "attn_backend", None)
    if cls is None:
        raise UnsupportedError(f"layer {name!r}: vLLM's forward context names no attention backend for it, so its "
                               f"cache cannot be described (kvcanary knows {', '.join(KNOWN)})")
    return str(cls.get_name())


def resolved_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The KV cache layout the engine resolved (``None``: none recorded)."""
    got = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(vllm_config.cache_config, "kv_cache_layout",
                                                                        None)
    return str(got) if got else None


def geometry(backend: str, tensor: torch.Tensor, block_size: int, spec: Any, layout: str | None,
             layer: int | str) -> KvGeometry:
    """Layer ``layer``'s geometry on ``backend``. ``spec``: its group's KV cache spec (``None``:
    none given; the CPU backend reads its heads off the cache it checks, the others need it)."""
    if backend == CPU:
        return cpu_geometry(tensor, block_size, layer)
    if backend not in BACKENDS:
        raise UnsupportedError(f"vLLM attention backend {backend!r} of layer {layer}: kvcanary describes the KV "
                               f"caches of {', '.join(KNOWN)}, not this one; the canary is off on this worker")
    if spec is None or layout is None:
        raise UnsupportedError(f"layer {layer} on {backend}: expected vLLM's KV cache spec and resolved cache "
                               f"layout, got {'no spec' if spec is None else 'no layout'}")
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    if quant != "NONE" or tensor.dtype in (torch.uint8, torch.int8) or tensor.element_size() == 1:
        raise UnsupportedError(f"layer {layer} on {backend}: a quantized KV cache ({quant}, {tensor.dtype}) is not "
                               f"described; the canary covers unquantized caches")
    return vllm_gpu(tensor, backend, layout, block_size, int(spec.num_kv_heads), int(spec.head_size),
                    getattr(spec, "head_size_v", None), layer)


def cpu_geometry(t: torch.Tensor, block_size: int, layer: int | str) -> KvGeometry:
    """A layer on vLLM's CPU backend, by the kernels vLLM picks for its dtype, block and head size."""
    if t.dim() != 4 or t.device.type != "cpu" or t.shape[2] != block_size:
        raise UnsupportedError(f"vLLM KV cache of layer {layer}: expected the CPU backend's [num_blocks, kv_heads, "
                               f"{block_size}, 2 * head_dim] tensors, got shape {tuple(t.shape)} on {t.device}")
    _, heads, _, two_d = t.shape
    isa = _cpu_isa(t.dtype, block_size, two_d // 2)
    if isa not in ISAS:
        raise UnsupportedError(f"vLLM CPU attention kernels {isa!r}: kvcanary describes the KV layouts of "
                               f"'vec', 'vec16' and 'amx', not this one; the canary is off on this worker")
    return vllm_cpu(t, isa, block_size, heads, two_d // 2, layer)


def layer_spec(spec: Any, name: str) -> Any:
    """The KV cache spec of layer ``name`` in a group whose spec is ``spec`` (one spec per layer
    where the group holds several of one kind)."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict) and name in per_layer:
        return per_layer[name]
    return spec


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The CPU attention kernels vLLM picks for this cache (they fix its byte layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))
