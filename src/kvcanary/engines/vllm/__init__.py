"""Protect a vLLM V1 engine with one flag: a KV connector that stamps and verifies every worker's cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvCanaryConnector","kv_role":"kv_both"}'

================ ==================================================================================
module           what it holds
================ ==================================================================================
``entry``        :class:`KvCanaryConnector`, the connector (its worker side)
``scheduler``    the connector's scheduler side: what each step ships to the workers
``steps``        a forward's rows and each KV cache group's step, from vLLM's attention metadata
``compiled``     the same built by compiled loops on CPU metadata
``device_steps`` the same built on the metadata's device, without a host sync
``backends``     each layer's cache geometry, by the attention backend vLLM chose for it
``heal``         ``quarantine`` and ``repair`` through vLLM's own path for KV that failed to load
``audit``        the write check and read audit inside each attention layer
``groups``       vLLM's KV cache groups as the canary covers them
``transfer``     beside another connector that stores and loads KV
``plugin``       the ``vllm.general_plugins`` entry point that makes the connector's name resolve
``events``       counts of engine events a run claims to exercise (the tests and the clean fuzz)
================ ==================================================================================

The connector's names are imported from :mod:`~kvcanary.engines.vllm.entry` on first access, so the
plugin loads in every vLLM process without importing vLLM's connector base.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvCanaryConnector", "CanaryMeta", "ReqStep", "NAME"]
_HOME = {"KvCanaryConnector": "kvcanary.engines.vllm.entry", "NAME": "kvcanary.engines.vllm.entry",
         "CanaryMeta": "kvcanary.engines.vllm.scheduler", "ReqStep": "kvcanary.engines.vllm.steps"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvcanary.engines.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
