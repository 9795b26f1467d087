"""A vLLM KV connector that does nothing, for measuring what vLLM's connector path costs by itself:
``bench/vllm_cpu.py --modes off,null,on`` runs the engine without a connector, with this one, and
with kvcanary's, so the difference between ``null`` and ``off`` is vLLM's, and ``on`` over
``null`` the canary's. Loaded by module path (``kv_connector_module_path``), never by default.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

NAME = "NullConnector"
CONFIG = {"kv_connector": NAME, "kv_role": "kv_both", "kv_connector_module_path": __name__}


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Loads and saves nothing, keeps the hybrid KV cache manager on (as kvcanary's connector does)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None
