"""The scripted engine's KV tensors in each layout kind, and the layout that describes them."""

from __future__ import annotations

import torch

from kvcanary.layout import KvLayout
from kvcanary.source import ByteSource
from kvcanary.sim.spec import EngineSpec


def make_kv(spec: EngineSpec) -> tuple[list[list[torch.Tensor]], KvLayout]:
    """Per-layer KV tensors, int16 row views indexed by slot, and the layout describing them."""
    nb, bs, h, d = spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim
    n = nb * bs
    views: list[list[torch.Tensor]] = []
    sources: list[ByteSource] = []
    for li in range(spec.num_layers):
        pair: list[torch.Tensor] = []
        if spec.layout == "mla":
            t = torch.zeros(n, h * d, dtype=spec.dtype)
            pair.append(t.view(torch.int16))
            sources.append(ByteSource.from_tensor(f"layer{li}.latent", t))
        for hi, half in enumerate("kv" if spec.layout != "mla" else ""):
            name = f"layer{li}.{half}"
            if spec.layout == "flat":
                t = torch.zeros(n, h, d, dtype=spec.dtype)
                sources.append(ByteSource.from_tensor(name, t))
                pair.append(t.view(torch.int16).view(n, h * d))
            elif spec.layout == "paged":
                t = torch.zeros(nb, bs, h, d, dtype=spec.dtype)
                sources.append(ByteSource.from_tensor(name, t, page_size=bs))
                pair.append(t.view(torch.int16).view(n, h * d))
            elif spec.layout == "packed":
                if hi == 0:
                    packed = torch.zeros(nb, 2, bs, h, d, dtype=spec.dtype)
                sources.append(ByteSource.from_tensor(name, packed[:, hi], page_size=bs))
                pair.append(_SlotView(packed.view(torch.int16)[:, hi], bs))  # type: ignore[arg-type]
            else:  # head_major
                t = torch.zeros(nb, h, bs, d, dtype=spec.dtype)
                sources.append(ByteSource.from_tensor(name, t.permute(0, 2, 1, 3), page_size=bs))
                pair.append(_SlotView(t.view(torch.int16).permute(0, 2, 1, 3), bs))  # type: ignore[arg-type]
        views.append(pair)
    return views, KvLayout(tuple(sources))


class _SlotView:
    """Slot-indexed rows of a ``[num_blocks, block_size, heads, dim]`` view that is not flat."""

    def __init__(self, t: torch.Tensor, block_size: int) -> None:
        self.t, self.bs = t, block_size
        self.shape = (t.shape[0] * block_size, t.shape[2] * t.shape[3])

    def _idx(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(slots, self.bs, rounding_mode="floor"), slots % self.bs

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        b, o = self._idx(slots)
        return self.t[b, o].reshape(slots.shape[0], -1)

    def __setitem__(self, slots: torch.Tensor, value: torch.Tensor) -> None:
        b, o = self._idx(slots)
        self.t[b, o] = value.reshape(slots.shape[0], self.t.shape[2], self.t.shape[3])
