"""vLLM 0.32's GPU KV caches as its allocation lays them out, written independently of kvcanary's
geometry: per layer a logical ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` view whose
last axis holds a token's K (``[:head_dim]``) then its V, the five axes of the allocation
(``L`` layer, ``B`` block, ``H`` head, ``N`` token, ``C`` content) in memory in the order the
layout's name spells them, outermost first (``LBNHC``: NHD, ``LBHNC``: HND; ``BL..``: a block holds
every layer's page). ``tests_vllm/test_gpu_backends.py`` checks these against vLLM's own allocation.
"""

from __future__ import annotations

import torch


def allocate(layout: str, layers: int, nb: int, heads: int, bs: int, dim: int, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], dict[str, int]]:
    """``layers`` layers' views of one zeroed allocation on ``device``, and the allocation's element
    stride of each axis."""
    sizes = {"L": layers, "B": nb, "H": heads, "N": bs, "C": 2 * dim}
    strides, acc = {}, 1
    for axis in reversed(layout):
        strides[axis], acc = acc, acc * sizes[axis]
    raw = torch.zeros(acc, dtype=dtype, device=device)
    shape, st = (nb, heads, bs, 2 * dim), tuple(strides[a] for a in "BHNC")
    return [raw.as_strided(shape, st, layer * strides["L"]) for layer in range(layers)], strides


def element(strides: dict[str, int], bs: int, dim: int, layer: int, half: str, slot: int, head: int, d: int) -> int:
    """The allocation's element index of dim ``d`` of ``head`` of ``slot``'s K or V in ``layer``."""
    b, n = divmod(slot, bs)
    c = d + (dim if half == "v" else 0)
    return layer * strides["L"] + b * strides["B"] + head * strides["H"] + n * strides["N"] + c * strides["C"]


def write_kv(view: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every slot's K and V ``[num_slots, heads, dim]`` into a layer's view, by the backends' split of
    the content axis (K first), through plain indexing by block and token."""
    nb, heads, bs, two_d = view.shape
    dim = two_d // 2
    slots = torch.arange(nb * bs, device=view.device)
    b, n = slots // bs, slots % bs
    view[b, :, n, :dim] = k
    view[b, :, n, dim:] = v
