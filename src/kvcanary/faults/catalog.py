"""The fault classes kvcanary is tested against, with the real bugs each reproduces.

Zoo references (``Z..``) point at the catalogue of real KV-corruption bugs in the project's
landscape notes; each names the engine issue or pull request that shipped or fixed the bug.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcanary.violations import Check


class Outcome(enum.Enum):
    DETECT = "detect"
    MISS = "documented miss"


class Point(enum.Enum):
    """Where an injector acts."""

    BEFORE_FORWARD = "before_forward"  # after the step is built, before the canary verifies it
    AFTER_FORWARD = "after_forward"  # after the forward wrote KV, before the canary stamps it
    COLD = "cold"  # between steps, on cached slots no request is reading
    TABLE = "table"  # in a request's slot or block table
    ALLOCATOR = "allocator"  # in the allocator or the prefix cache
    TRANSFER = "transfer"  # in a tier transfer (offload and reload)
    KERNEL = "kernel"  # inside a forward: the cache-write op or the attention kernel (an engine's only)


@dataclass(frozen=True)
class FaultClass:
    """One class of corruption: what it is, where it is injected, what should catch it."""

    name: str
    point: Point
    outcome: Outcome
    checks: Check  # any of these bits firing counts as the expected detection
    max_forwards: int  # forwards after injection within which it must be detected
    zoo: tuple[str, ...]
    summary: str
    why_missed: str = ""
    # "full": every read and the whole pool re-fingerprinted each forward (proves the check);
    # "default": the default content budget and patrol, a pool larger than they cover per forward
    # (proves the priorities: first reads, the patrol, the guards)
    budget: str = "full"
    # needs the write check or the read audit (kvcanary.audit): it is run with and without them, and
    # must be detected with them and missed without
    audit: bool = False
    # run at the default write check and read audit (the time budget), not with every query audited
    at_default: bool = False


META = Check.POSITION | Check.LINK | Check.TOKEN | Check.EMPTY  # what a foreign or stale slot trips
CATALOG: tuple[FaultClass, ...] = (
    FaultClass("bit_flip", Point.COLD, Outcome.DETECT, Check.CONTENT, 1, ("Z16", "Z37", "Z05"),
               "one bit of a cached slot's K or V flips (any layer, any offset)"),
    FaultClass("multi_bit_flip", Point.COLD, Outcome.DETECT, Check.CONTENT, 1, ("Z16", "Z37"),
               "several bits of one cached slot flip"),
    FaultClass("byte_smash", Point.COLD, Outcome.DETECT, Check.CONTENT, 1, ("Z16", "Z05"),
               "a whole byte of a cached slot is overwritten (XOR 0xFF)"),
    FaultClass("burst_16b", Point.COLD, Outcome.DETECT, Check.CONTENT, 1, ("Z16", "Z37"),
               "a 16-byte-aligned burst of a cached slot is zeroed"),
    FaultClass("late_write_after_free", Point.AFTER_FORWARD, Outcome.DETECT, Check.CONTENT | META, 1,
               ("Z01", "Z13"),
               "an aborted request's in-flight write lands in a slot already handed to another request"),
    FaultClass("slot_reused_while_referenced", Point.ALLOCATOR, Outcome.DETECT, META, 3, ("Z02", "Z10", "Z27"),
               "a block still read by a request is freed and given to another request"),
    FaultClass("table_redirect", Point.TABLE, Outcome.DETECT, META, 1, ("Z07", "Z23"),
               "a table entry points at another request's slot"),
    FaultClass("table_shift", Point.TABLE, Outcome.DETECT, META, 1, ("Z14",),
               "a request's table is shifted by one slot from a block boundary on"),
    FaultClass("wrong_position", Point.AFTER_FORWARD, Outcome.DETECT, Check.WRITE_POSITION | Check.POSITION, 1,
               ("Z14",), "engine and kernel disagree on the cached length: a token is written at the wrong position"),
    FaultClass("wrong_input_token", Point.BEFORE_FORWARD, Outcome.DETECT, Check.WRITE_INPUT_TOKEN | Check.TOKEN, 1,
               ("Z39",), "the token fed to the model differs from the request's real token"),
    FaultClass("transfer_lands_nothing", Point.TRANSFER, Outcome.DETECT, Check.CONTENT, 1, ("Z12",),
               "a reload reports success but never writes the destination slots"),
    FaultClass("torn_offload", Point.TRANSFER, Outcome.DETECT, Check.CONTENT, 1, ("Z17", "Z34", "Z04"),
               "a block is restored from a half-finished copy"),
    FaultClass("prefix_cache_recycled_block", Point.ALLOCATOR, Outcome.DETECT, META, 1, ("Z03", "Z35", "Z02"),
               "a prefix-cache entry points at a block that was recycled for other tokens"),
    FaultClass("padding_write_into_real_slot", Point.AFTER_FORWARD, Outcome.DETECT, Check.CONTENT, 2, ("Z19",),
               "a padding token's write lands in a real, cached slot"),
    FaultClass("padding_write_into_reserved", Point.AFTER_FORWARD, Outcome.DETECT, Check.CONTENT, 1, ("Z19",),
               "a padding (or dummy-run) write lands in a reserved slot: the null block padding reads come from",
               budget="default"),
    FaultClass("padding_slot_wraps_to_live_kv", Point.AFTER_FORWARD, Outcome.DETECT, Check.CONTENT, 1, ("Z19",),
               "a padding slot id of -1 wraps to the pool's last slot, which holds a live sequence's KV",
               budget="default"),
    FaultClass("padding_token_writes_live_slot", Point.BEFORE_FORWARD, Outcome.DETECT, Check.PADDING_WRITE, 1,
               ("Z19",), "the batch sends a padding token's write to a stale slot that holds a live sequence's KV",
               budget="default"),
    FaultClass("cold_bytes_then_prefix_hit", Point.COLD, Outcome.DETECT, Check.CONTENT, 1, ("Z16", "Z05"),
               "a byte of a cached block no request reads changes; a new request then hits it in the prefix cache "
               "(forwards counted from that first read; no patrol, so only the first-read check can find it)",
               budget="default_no_patrol"),
    FaultClass("cold_bytes_never_read", Point.COLD, Outcome.DETECT, Check.CONTENT, 12, ("Z16", "Z37"),
               "a byte of a cached block that no request reads again changes (found by the patrol within its pass)",
               budget="default"),
    FaultClass("attention_read_bug", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z29", "Z23"),
               "the attention kernel computes one request's page addresses one page too far, although its table "
               "is right (FlashInfer #3716, #4450; flash-attention #2368)", audit=True),
    FaultClass("kernel_ignores_prefix", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z29",),
               "the attention kernel attends to a request's new tokens only, leaving its cached prefix out "
               "(FlashInfer's zeros for non-contiguous kv_indices)",
               audit=True),
    FaultClass("layout_disagreement", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z28",),
               "writer and reader disagree on the layout: the reader takes the KV heads in another order "
               "(vLLM ROCm #52109's flat vs tiled; LMCache #4463, #4247 after a KV layout change)", audit=True),
    FaultClass("quant_scale_mixup", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z11", "Z20"),
               "V is read back with another scale than it was written with: a dequantization scale reset, "
               "shared, missing or ignored (vLLM #51091, #48412, #34863; SGLang #18818)", audit=True),
    FaultClass("write_lands_zeros", Point.KERNEL, Outcome.DETECT, Check.WRITE_CONTENT, 1, (),
               "the cache write of a layer lands zeros instead of the computed K and V, and the stamp "
               "fingerprints the zeros (mlx-rs #338)", audit=True),
    FaultClass("window_off_by_one", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z29",),
               "the sliding-window mask is off by one: the oldest position inside each query's window is left "
               "out (kernel mask arithmetic, as in the FlashInfer and flash-attention read bugs)", audit=True),
    FaultClass("wrong_softmax_scale", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, ("Z29",),
               "the attention kernel applies a softmax scale of 1 instead of the model's", audit=True),
    # brief faults, at the default configuration: seen in the forward they strike
    FaultClass("transient_scale_error", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, (),
               "V is read back with a wrong scale on the first two forwards after start only (vLLM #51091)",
               audit=True, at_default=True),
    FaultClass("one_off_v_zeros", Point.KERNEL, Outcome.DETECT, Check.WRITE_CONTENT, 1, (),
               "once, the cache write of one layer lands zeros for one token's V", audit=True, at_default=True),
    FaultClass("intermittent_kernel", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 1, (),
               "the attention kernel misreads V's scale on 1 forward in 20", audit=True, at_default=True),
    # confined to one (layer, head): found within the rotation's bound of L * H queries with at least H
    # rows (kvcanary.audit.budget): 8 forwards on the selftest's 2-layer, 4-head model and 20 requests,
    # at one query a forward (where it is injected there, forwards audit a new shape class's full count or
    # a request's own queries at its first decode; at the cadence's least, one in 8 forwards, the bound
    # is 8 times it)
    FaultClass("head_zeroed_one_layer", Point.KERNEL, Outcome.DETECT, Check.ATTENTION, 8, (),
               "in one layer the attention kernel drops one query head's output (FlashInfer #4450)",
               audit=True, at_default=True),
    FaultClass("position_shift", Point.KERNEL, Outcome.DETECT, Check.WRITE_INPUT_POSITION | Check.WRITE_POSITION, 1,
               (), "one request's tokens are given positions one too far in one forward (SGLang #25015: draft "
               "positions off by one)", at_default=True),
)

BY_NAME = {f.name: f for f in CATALOG}
