"""kvcanary's ``sglang.srt.plugins`` entry point: SGLang calls :func:`register` in each of its
processes (the engine's, the scheduler's, the detokenizer's) before it builds its scheduler.

Installing kvcanary changes no SGLang run by itself: with ``KVCANARY_MODE`` unset or ``off`` this
imports nothing and wraps nothing. With ``KVCANARY_MODE`` set, the configuration is read (a bad
``KVCANARY_*`` value fails the engine's start with the variable named, in the caller's process,
before any subprocess starts) and SGLang's methods are wrapped (:mod:`kvcanary.engines.sglang.entry`).
"""

from __future__ import annotations

import os


def register() -> None:
    """Turn the canary on in this SGLang process when ``KVCANARY_MODE`` asks for it."""
    if os.environ.get("KVCANARY_MODE", "").strip().lower() in ("", "off"):
        return
    from kvcanary.engines.sglang.entry import install

    install()
