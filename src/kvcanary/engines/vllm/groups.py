"""vLLM's KV cache groups as the canary covers them: one canary per group, each with the group's own
block size, layers and read window. Imports nothing of vLLM's (groups are read by their specs'
class names and fields), so the tests can describe groups without it.

vLLM puts layers with the same kind of attention in one group (``kv_cache_config.kv_cache_groups``);
a model mixing sliding-window and full layers gets several groups under the hybrid KV cache manager.
Block ids come from one pool shared by every group, and the groups' layers overlay the same memory
(a block belongs to one group at a time).

Covered: full attention (every position is read) and sliding windows (the last ``window`` positions
before each query token). Not covered, and said so once when the canary starts: state that is not
per-token KV (Mamba and linear attention), chunked local attention in a group of its own (vLLM's
kernel reads each chunk through a rebuilt, per-chunk batch), and any other kind of group.

Draft-model speculative decoding (EAGLE, MTP, a draft model) writes its layers' KV in a forward of
its own after the target model's: those layers' bytes are left out of the content fingerprints
(their positions are still checked through the group's table). Only ngram drafting runs on vLLM's
CPU build, so this part has not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FULL = ("FullAttentionSpec",)  # the spec classes (exact) whose kernel reads every cached position
SLIDING = ("SlidingWindowSpec",)


@dataclass(frozen=True)
class GroupPlan:
    """How the canary covers one KV cache group."""

    index: int  # the group's index in kv_cache_config.kv_cache_groups
    kind: str  # "full", "sliding", or the spec's class name when not covered
    block_size: int
    window: int | None  # a sliding window's tokens; None: every position is read
    layers: tuple[str, ...]  # layers whose bytes are fingerprinted
    draft_layers: tuple[str, ...] = ()  # layers written by a draft model's own forward (positions only)
    why_not: str | None = None  # not covered: why
    spec: Any = field(default=None, compare=False, repr=False)  # vLLM's KV cache spec of the group (None: none)

    @property
    def covered(self) -> bool:
        return self.why_not is None

    def describe(self) -> str:
        win = f", window {self.window}" if self.window is not None else ""
        return f"group {self.index} ({self.kind}, {len(self.layers) + len(self.draft_layers)} layers{win})"


def plan_groups(kv_cache_config: Any, vllm_config: Any) -> list[GroupPlan]:
    """One plan per KV cache group of ``kv_cache_config`` (vLLM's ``KVCacheConfig``)."""
    drafts = draft_layer_names(vllm_config, [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names])
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = whole = g.kv_cache_spec
        spec = getattr(spec, "first_spec", spec)  # several same-kind specs in one group: the kind is shared
        name = type(spec).__name__
        names = list(g.layer_names)
        layers = tuple(n for n in names if n not in drafts)
        dl = tuple(n for n in names if n in drafts)
        bs = int(getattr(spec, "block_size", 0) or 0)
        if name in FULL:
            out.append(GroupPlan(i, "full", bs, None, layers, dl, spec=whole))
        elif name in SLIDING:
            out.append(GroupPlan(i, "sliding", bs, int(spec.sliding_window), layers, dl, spec=whole))
        else:
            out.append(GroupPlan(i, name, bs, None, layers, dl, why_not=_why_not(name)))
    return out


def _why_not(spec_name: str) -> str:
    if "Mamba" in spec_name:
        return "Mamba / linear-attention state is not per-token KV"
    if "ChunkedLocal" in spec_name:
        return "chunked local attention in a group of its own (its kernel reads a rebuilt per-chunk batch)"
    return f"the canary does not know which positions a {spec_name} group's kernel reads"


def draft_layer_names(vllm_config: Any, names: list[str]) -> set[str]:
    """The layers a draft model writes (EAGLE, MTP): layers numbered past the target model's last
    layer, as vLLM names an EAGLE or MTP head's layers. Empty without a draft model (ngram drafting
    has no layers). A draft model whose layers are named otherwise is not told apart (untested:
    vLLM's CPU build runs ngram drafting only)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) in (None, "ngram", "suffix", "ngram_gpu"):
        return set()
    try:
        target = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
    except Exception:  # no layer count to tell them apart: keep every layer's content
        return set()
    out = set()
    for n in names:
        m = re.search(r"layers\.(\d+)\.", n)
        if m is not None and int(m.group(1)) >= target:
            out.add(n)
    return out


def single_group(block_size: int, layers: list[str]) -> list[GroupPlan]:
    """The plan of an engine that passes no KV cache config: one full-attention group."""
    return [GroupPlan(0, "full", block_size, None, tuple(layers))]
