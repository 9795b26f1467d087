"""kvcanary's ``vllm.general_plugins`` entry point: vLLM runs :func:`register` in each of its
processes (driver, engine core, workers), which makes the connector name ``KvCanaryConnector``
resolve there. Importing this module imports nothing of vLLM's or of the connector's.

With ``KVCANARY_EVENTS_FILE`` set (the vLLM tests and the clean fuzz), each process also counts the
engine events a run claims (:mod:`kvcanary.engines.vllm.events`), with the canary on or off."""

from __future__ import annotations

import os

_events: list[str] = []  # the events file this process records to, once


def register() -> None:
    """Register ``KvCanaryConnector`` with vLLM's connector factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KvCanaryConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KvCanaryConnector", "kvcanary.engines.vllm.entry", "KvCanaryConnector")
    path = os.environ.get("KVCANARY_EVENTS_FILE")
    if path and not _events:
        from kvcanary.engines.vllm.events import record_to

        _events.append(path)
        record_to(path)
