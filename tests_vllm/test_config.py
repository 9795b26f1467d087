"""The connector's settings from ``--kv-transfer-config``: every CanaryConfig field by name in
``kv_connector_extra_config`` (over the ``KVCANARY_*`` variables), an unknown key or a bad value
refused by name before the engine starts, and metrics that no scrape would show said once."""

import logging
from types import SimpleNamespace

import pytest

from kvcanary import CanaryConfig, ConfigError
from kvcanary.engines.vllm import settings


def ktc(extra=None, policy=None):
    return SimpleNamespace(kv_connector_extra_config=extra or {}, kv_load_failure_policy=policy)


def test_every_field_by_name_over_the_variables(monkeypatch):
    monkeypatch.setenv("KVCANARY_AUDIT_QUERIES", "9")
    monkeypatch.setenv("KVCANARY_SCRUB_SLOTS", "5")
    cfg, store = settings.connector_config(ktc({"mode": "repair", "content_budget_bytes": 4096, "scrub_slots": "11",
                                             "stamp_store": "/tmp/stamps"}, "recompute"))
    assert (cfg.mode, cfg.content_budget_bytes, cfg.scrub_slots, cfg.audit_queries) == ("repair", 4096, 11, 9)
    assert store == "/tmp/stamps"
    monkeypatch.setenv("KVCANARY_STAMP_STORE", "/tmp/env-stamps")
    assert settings.connector_config(ktc())[1] == "/tmp/env-stamps"


@pytest.mark.parametrize("extra, msg", [
    ({"content_budget_bytes": "lots"}, r"kv_connector_extra_config: content_budget_bytes: expected an integer, "
                                       r"'auto' or 'none', got 'lots'"),
    ({"bogus_key": 1}, r"kv_connector_extra_config: unknown key 'bogus_key' \(not a CanaryConfig field\)"),
    ({"stamp_stor": "/x"}, r"unknown key 'stamp_stor' .*did you mean 'stamp_store'\?"),
    ({"mode": "reapir"}, r"kv_connector_extra_config: mode: expected one of \('off', 'log', 'raise', 'quarantine', "
                         r"'repair'\), got 'reapir'"),
])
def test_an_unknown_key_or_a_bad_value_is_refused_by_name(extra, msg):
    with pytest.raises(ConfigError, match=msg):
        settings.connector_config(ktc(extra))


def test_repair_still_needs_the_recompute_policy():
    with pytest.raises(ConfigError, match="mode 'repair' needs kv_load_failure_policy 'recompute'"):
        settings.connector_config(ktc({"mode": "repair"}))


def test_metrics_no_scrape_would_show_are_said_once(monkeypatch, caplog):
    monkeypatch.setattr(settings, "_warned_unscraped", [])
    on = CanaryConfig(metrics=True)
    assert not settings.warn_unscraped(CanaryConfig(), {})
    assert not settings.warn_unscraped(on, {"PROMETHEUS_MULTIPROC_DIR": "/tmp/prom"})
    assert not settings.warn_unscraped(CanaryConfig(metrics=True, metrics_port=9464), {})
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        assert settings.warn_unscraped(on, {})
        assert not settings.warn_unscraped(on, {})  # once per process
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "PROMETHEUS_MULTIPROC_DIR" in said[0] and "KVCANARY_METRICS_PORT" in said[0]
