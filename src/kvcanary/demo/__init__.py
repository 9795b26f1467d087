"""``kvcanary demo``: requests with shared prefixes through an engine with the canary on, and a
summary. By default on a trained model (:mod:`kvcanary.demo.chat`); ``--model tiny`` on a random
one (:mod:`kvcanary.demo.tiny`); ``--engine vllm`` the trained model through vLLM's engine
(:mod:`kvcanary.demo.vllm`); ``--engine scripted`` on the simulator (:mod:`kvcanary.demo.scripted`).
Importing this package imports no torch."""

from __future__ import annotations

import argparse

from kvcanary.config import CanaryConfig


def run(args: argparse.Namespace) -> int:
    """Run the demo ``args`` asks for; the exit status (see :mod:`kvcanary.cli`)."""
    from kvcanary.demo import chat, scripted, tiny

    config = CanaryConfig.from_env(CanaryConfig(mode="log"))  # a bad KVCANARY_* value: a usage error, up front
    real = args.engine == "transformers" and args.model != "tiny"
    # vLLM: each question asked twice, so that the second ask reads the first's prompt block from the prefix cache
    asks = 2 * len(chat.QUESTIONS) if args.engine == "vllm" else len(chat.QUESTIONS)
    for name, small, answers in (("requests", 32, asks), ("max_new_tokens", 16, 48), ("blocks", 96, 128)):
        if getattr(args, name) is None:  # each kind of run's own default
            setattr(args, name, answers if real or args.engine == "vllm" else small)
    if args.engine == "scripted":
        return scripted.run(args, config)
    if args.engine == "vllm":
        from kvcanary.demo import vllm

        return vllm.run(args, config)
    return chat.run(args, config) if real else tiny.run(args, config)
