"""vLLM: the positions the model is given, checked against the positions the canary stamps.

The model runner hands every forward's token positions to the model (``_model_forward``'s
``positions``, which the rotary embedding of every layer reads). One class-level patch of
``GPUModelRunner._model_forward`` (the CPU runner inherits it), installed by the worker-side
connector, gives them to each connector of the process before the model runs: they become the
forward's expected new positions (:attr:`kvcanary.step.Step.expected_new_positions`), which the
stamp check compares with each new token's position from the step (its row's cached length plus its
offset), so a position shifted for one request (a draft's position off by one, positions lost at a
restore) is reported in the forward it strikes (``WRITE_INPUT_POSITION``). M-RoPE positions (a
``[3, T]`` tensor) are not checked, said once.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

CONNECTORS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # this process's worker-side connectors
# fault injection only (kvcanary.faults.vllm): wraps the model forward as
# tap(original, runner, **kwargs), the check inside ``original`` (it sees what the model sees)
TAPS: dict[str, Callable[..., Any]] = {}
_ORIGINAL: dict[str, Callable[..., Any]] = {}


def install(conn: Any) -> None:
    """Patch ``GPUModelRunner._model_forward`` once per process and check ``conn``'s positions."""
    CONNECTORS.add(conn)
    if _ORIGINAL:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _ORIGINAL["forward"] = GPUModelRunner._model_forward

    def checked(runner: Any, *args: Any, **kwargs: Any) -> Any:
        positions = kwargs.get("positions")
        for c in list(CONNECTORS):
            c.model_positions(positions)
        return _ORIGINAL["forward"](runner, *args, **kwargs)

    def model_forward(runner: Any, *args: Any, **kwargs: Any) -> Any:
        tap = TAPS.get("forward")
        if tap is not None:
            return tap(checked, runner, *args, **kwargs)
        return checked(runner, *args, **kwargs)

    functools.update_wrapper(model_forward, _ORIGINAL["forward"])
    GPUModelRunner._model_forward = model_forward

