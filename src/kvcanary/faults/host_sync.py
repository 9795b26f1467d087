"""A guard that makes kvcanary's own code fail where it would make the host wait on the device: a
device value read on the host, a data-dependent output shape, a host-to-device copy of a Python
value. A CUDA graph would refuse or silently freeze such an op; the guard finds it on any machine,
CPU tensors included (the tests run the forward path under it).

Inside :func:`no_host_sync`, every such entry point of torch raises :class:`HostSync` when it is
called from code under ``scope`` (kvcanary's package, not its tests, by default); calls from
anywhere else (the engine, torch itself, the Triton interpreter) pass.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

SYNCING_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")
SYNCING_FUNCTIONS = ("nonzero", "masked_select", "unique", "tensor")


class HostSync(AssertionError):
    """kvcanary's code under the guard read a device value on the host (or would have made it wait)."""


def _ours(scope: tuple[str, ...], exempt: tuple[str, ...], depth: int = 2) -> str | None:
    f = sys._getframe(depth)
    name = f.f_code.co_filename
    if "/tests/" in name or "/tests_" in name or any(e in name for e in exempt):
        return None
    return f"{name}:{f.f_lineno}" if any(s in name for s in scope) else None


@contextlib.contextmanager
def no_host_sync(scope: tuple[str, ...] = ("/kvcanary/",), exempt: tuple[str, ...] = ()) -> Iterator[None]:
    """Within the block, a syncing torch call from a source file whose path holds one of ``scope``
    (and none of ``exempt``: code whose tensors are host memory by construction) raises
    :class:`HostSync` naming the call and where it was made."""
    saved: list[tuple[Any, str, Any]] = []

    def guard(owner: Any, name: str) -> None:
        orig = getattr(owner, name)
        saved.append((owner, name, orig))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            where = _ours(scope, exempt)
            if where:
                raise HostSync(f"{owner.__name__}.{name} called at {where}")
            return orig(*args, **kwargs)

        setattr(owner, name, wrapper)

    def getitem(self: torch.Tensor, idx: Any) -> Any:
        where = _ours(scope, exempt)
        masks = idx if isinstance(idx, tuple) else (idx,)
        if where and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks):
            raise HostSync(f"boolean-mask indexing at {where}")
        return orig_getitem(self, idx)

    orig_getitem = torch.Tensor.__getitem__
    for m in SYNCING_METHODS:
        guard(torch.Tensor, m)
    for fn in SYNCING_FUNCTIONS:
        guard(torch, fn)
    torch.Tensor.__getitem__ = getitem  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.__getitem__ = orig_getitem  # type: ignore[method-assign]
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)
