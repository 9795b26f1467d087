"""The shape and behaviour of a scripted engine (:mod:`kvcanary.sim.engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Layout = Literal["flat", "paged", "packed", "head_major", "mla"]

@dataclass(frozen=True)
class EngineSpec:
    """Shape and behaviour of a scripted engine.

    ``layout``: ``flat`` per-layer K and V ``[num_slots, heads, dim]``; ``paged`` per-layer K and V
    ``[num_blocks, block_size, heads, dim]``; ``packed`` one ``[num_blocks, 2, block_size, heads,
    dim]`` tensor per layer; ``head_major`` ``[num_blocks, heads, block_size, dim]``; ``mla`` one
    latent ``[num_slots, heads * dim]`` row per layer. ``table``: ``token`` (token-to-slot table)
    or ``block`` (block table). ``window``: attention reads only the last ``window`` positions.
    """

    num_blocks: int = 48
    block_size: int = 4
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: torch.dtype = torch.float16
    layout: Layout = "paged"
    table: Literal["token", "block"] = "block"
    prefix_cache: bool = True
    chunk_size: int = 16
    max_running: int = 6
    vocab: int = 1000
    window: int | None = None
    pad_rows: int = 0
    offload: bool = False  # preemption copies KV (and stamps) to a host tier and reloads it
    null_block: bool = False  # block 0 is never allocated: tables pad with it, and its slots are reserved
    seed: int = 0
