"""A canary's own failures: the decorator that keeps them out of the engine (:func:`guarded`), and
what each guarded op recovers when it fails, so that a failure of the canary's own never turns into
false reports later: the slots it should have stamped become unknown."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

from kvcanary.step import Step

F = TypeVar("F", bound=Callable[..., Any])


def guarded(recover: Callable[..., None] | None = None) -> Callable[[F], F]:
    """Skip in ``off`` mode; in ``log`` and ``quarantine`` mode count and log internal errors
    instead of raising, then run ``recover(canary, *args)`` (every slot unknown where that fails
    too); ``raise`` mode raises."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.config.mode == "off" or self.disabled:
                return None
            if self.config.mode == "raise":
                return fn(self, *args, **kwargs)
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # log mode never raises into the engine
                self.note_internal_error(fn.__name__, e)
                if recover is not None:
                    try:
                        recover(self, *args)
                    except Exception:
                        self.forget_all()
                return None

        return wrapper  # type: ignore[return-value]

    return deco


def forget_slots(canary: Any, slots: torch.Tensor, *_: Any) -> None:
    """The recovery of an op on ``slots``: those in the pool become unknown."""
    slots = slots.long()
    canary.forget_known(slots[(slots >= 0) & (slots < canary.num_slots)])


def forget_written(canary: Any, step: Step, *_: Any) -> None:
    """The recovery of a stamp: the slots ``step`` wrote become unknown (every slot where the step is
    not one: which slots the forward wrote is unknown)."""
    if not isinstance(step, Step):
        canary.forget_all()
        return
    forget_slots(canary, step.new_slots)


def forget_blocks(canary: Any, blocks: Any, block_size: Any, *_: Any) -> None:
    """The recovery of a release of ``blocks``: their slots become unknown."""
    from kvcanary.geometry.base import block_slots

    if isinstance(block_size, int) and block_size > 0:
        forget_slots(canary, block_slots([b for b in blocks if isinstance(b, int)], block_size))
