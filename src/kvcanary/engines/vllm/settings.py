"""The vLLM connector's settings and where it runs: its configuration from ``--kv-transfer-config``
and the ``KVCANARY_*`` variables, and this process's tensor- and pipeline-parallel rank."""

from __future__ import annotations

import logging
import os
from typing import Any

from kvcanary.config import CanaryConfig
from kvcanary.engines.vllm import heal as vllm_heal

log = logging.getLogger("kvcanary")
EXTRA_KEYS = ("stamp_store",)  # kv_connector_extra_config keys the connector reads itself (no CanaryConfig field)


def pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:  # not initialised (scheduler side)
        return 0


def rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (scheduler side)
        return int(os.environ.get("RANK", 0))


def connector_config(kv_transfer_config: Any) -> tuple[CanaryConfig, str | None]:
    """The canary's configuration and stamp directory from vLLM's ``--kv-transfer-config``: every
    :class:`CanaryConfig` field may stand in its ``kv_connector_extra_config`` by name (over the
    ``KVCANARY_*`` variables, validated as they are; an unknown key is refused with the closest
    name), beside ``stamp_store`` (else ``KVCANARY_STAMP_STORE``) and the policy a healing mode needs."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    config = CanaryConfig.from_mapping(extra, CanaryConfig.from_env(CanaryConfig(mode="log")),
                                       where="kv_connector_extra_config", also=EXTRA_KEYS)
    vllm_heal.check_policy(config.mode, kv_transfer_config)
    warn_unscraped(config)
    return config, extra.get("stamp_store") or os.environ.get("KVCANARY_STAMP_STORE")


_warned_unscraped: list[bool] = []


def warn_unscraped(config: CanaryConfig, environ: Any = None) -> bool:
    """Say once per process when ``metrics`` is on but nothing would export it: vLLM runs the
    canary in its engine-core and worker processes, whose registries the API server's ``/metrics``
    shows only through ``PROMETHEUS_MULTIPROC_DIR``. Whether it said so now."""
    env = os.environ if environ is None else environ
    if (not config.metrics or config.metrics_port is not None or env.get("PROMETHEUS_MULTIPROC_DIR")
            or _warned_unscraped):
        return False
    _warned_unscraped.append(True)
    log.warning("kvcanary: metrics are on (KVCANARY_METRICS), but no scrape will show them: the canary runs in "
                "vLLM's engine-core and worker processes, and the API server's /metrics collects other processes' "
                "metrics only through PROMETHEUS_MULTIPROC_DIR; set PROMETHEUS_MULTIPROC_DIR to a directory (as "
                "for vLLM's own multi-process metrics), or KVCANARY_METRICS_PORT for an exporter per process")
    return True
