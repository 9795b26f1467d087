"""kvcanary's ``vllm.general_plugins`` entry point: vLLM runs :func:`register` in each of its
processes (driver, engine core, workers), which makes the connector name ``KvCanaryConnector``
resolve there. Importing this module imports nothing of vLLM's or of the connector's."""

from __future__ import annotations


def register() -> None:
    """Register ``KvCanaryConnector`` with vLLM's connector factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KvCanaryConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KvCanaryConnector", "kvcanary.engines.vllm", "KvCanaryConnector")
