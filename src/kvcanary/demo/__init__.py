"""``kvcanary demo``: requests with shared prefixes through an engine with the canary on, and a
summary. By default on a trained model (:mod:`kvcanary.demo.chat`); ``--model tiny`` on a random
one (:mod:`kvcanary.demo.tiny`); ``--engine scripted`` on the simulator (:mod:`kvcanary.demo.scripted`).
Importing this package imports no torch."""

from __future__ import annotations

import argparse

from kvcanary.config import CanaryConfig


def run(args: argparse.Namespace) -> int:
    """Run the demo ``args`` asks for; the exit status (see :mod:`kvcanary.cli`)."""
    from kvcanary.demo import chat, scripted, tiny

    config = CanaryConfig.from_env(CanaryConfig(mode="log"))  # a bad KVCANARY_* value: a usage error, up front
    real = args.engine == "transformers" and args.model != "tiny"
    for name, small, answers in (("requests", 32, len(chat.QUESTIONS)), ("max_new_tokens", 16, 48),
                                 ("blocks", 96, 128)):
        if getattr(args, name) is None:  # each kind of run's own default
            setattr(args, name, answers if real else small)
    if args.engine == "scripted":
        return scripted.run(args, config)
    return chat.run(args, config) if real else tiny.run(args, config)
