"""The arguments a :class:`~kvcanary.canary.Canary` is made from, checked before it allocates
anything: its config (a healing mode needs an engine adapter), its slot count, its layout (guard slots
need sources), its device (the layout's), the memory its stamps take, and the slots each forward's
content window covers. Each refusal names the bad value and what was expected."""

from __future__ import annotations

import logging
import os

import torch

from kvcanary.config import CanaryConfig
from kvcanary.errors import ConfigError, LayoutError, UnsupportedError
from kvcanary.layout import KvLayout

log = logging.getLogger("kvcanary")
MAX_SLOTS = 1 << 62  # slot ids and byte offsets are int64


def checked_num_slots(num_slots: object) -> int:
    """``num_slots``, an integer in ``1 .. MAX_SLOTS - 1``."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 0 < num_slots < MAX_SLOTS:
        raise ConfigError(f"num_slots: expected an integer in 1 .. {MAX_SLOTS - 1}, got {num_slots!r}")
    return num_slots


def content_slots(budget: int | None, per_slot: int) -> int | None:
    """Slots whose bytes each forward's verify fingerprints (``None``: all of them)."""
    if budget is not None and 0 < budget < per_slot:
        raise ConfigError(
            f"content_budget_bytes: {budget} is less than one slot's {per_slot} content bytes; "
            f"expected 0 (no per-step content checks) or >= {per_slot}"
        )
    return None if budget is None or not per_slot else budget // per_slot


def checked_config(config: CanaryConfig | None, healer: str | None) -> CanaryConfig:
    """``config`` (``None``: the defaults), refused where its mode heals and no engine adapter does."""
    if config is not None and not isinstance(config, CanaryConfig):
        raise ConfigError(f"config: expected a CanaryConfig, got {type(config).__name__} {config!r}")
    config = config or CanaryConfig()
    if config.mode in ("quarantine", "repair") and healer is None:
        raise ConfigError(
            f"mode: expected 'off', 'log' or 'raise' for a Canary without an engine adapter, got {config.mode!r}: "
            f"healing fails or recomputes requests, which only an engine adapter can (kvcanary.protect(model) for "
            f"transformers continuous batching, the KvCanaryConnector for vLLM); a bare Canary reports, and "
            f"on_violation callbacks can act on what it finds")
    return config


def checked_layout(layout: KvLayout | None, content: str) -> KvLayout:
    """``layout`` (``None``: metadata only), refused where it has guard slots but no sources; said once
    per process where ``content`` is ``none`` and its guard slots go unchecked."""
    if layout is not None and not isinstance(layout, KvLayout):
        raise ConfigError(f"layout: expected a KvLayout or None, got {type(layout).__name__}")
    layout = layout or KvLayout()
    if (layout.reserved or layout.guards) and not layout.sources:
        which = ", ".join(f"{k}={getattr(layout, k)}" for k in ("reserved", "guards") if getattr(layout, k))
        raise LayoutError(f"layout: expected sources whose bytes the guard slots are checked in, got {which} on "
                          "a layout without sources (metadata only: drop the guard slots, or add the sources)")
    if content == "none" and (layout.reserved or layout.guards) and not _said_unguarded:
        _said_unguarded.append(True)  # once per process: every adapter's pool has its null block
        log.warning("kvcanary: content='none' (KVCANARY_CONTENT=none): the layout's guard slots (%s) are not checked, "
                    "since no bytes are fingerprinted; content='all' checks them on every forward",
                    ", ".join(f"{k}: {len(getattr(layout, k))}" for k in ("reserved", "guards") if getattr(layout, k)))
    return layout


_said_unguarded: list[bool] = []


def pool_device(device: torch.device | str | None, layout: KvLayout) -> torch.device:
    """The pool's device: ``device`` (``None``: the layout's, else the CPU), a CPU or a visible CUDA
    device, and the layout's own."""
    if device is None:
        device = layout.sources[0].tensor.device if layout.sources else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device: expected a torch device or its name, got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"device: expected cpu or cuda, got {dev.type}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"device: {dev} was asked for, but this torch build sees no CUDA device")
    if layout.sources and layout.sources[0].tensor.device != dev:
        raise ConfigError(f"layout lives on {layout.sources[0].tensor.device}, the canary on {dev}")
    return dev


def check_stamp_memory(num_slots: int, device: torch.device) -> None:
    """Refuse a stamp pool of ``num_slots`` that cannot fit on ``device``, before allocating it."""
    need = num_slots * 4 * 8
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # all of it: page cache is reclaimable
        except (ValueError, OSError, AttributeError):
            return
    if need > free:
        raise ConfigError(
            f"num_slots: {num_slots} slots need {need / 2**30:.1f} GiB of stamps (32 bytes a slot); "
            f"{device} has {free / 2**30:.1f} GiB {'free' if device.type == 'cuda' else 'in all'}"
        )
