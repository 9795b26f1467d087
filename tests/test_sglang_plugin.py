"""The SGLang plugin's switch, without SGLang: nothing is wrapped or imported unless
``KVCANARY_MODE`` asks for the canary, and a mode the adapter does not run is refused by name."""

import sys

import pytest

from kvcanary.engines.sglang import plugin
from kvcanary.errors import ConfigError


@pytest.mark.parametrize("mode", [None, "", "off", " OFF "])
def test_without_a_mode_the_plugin_does_nothing(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("KVCANARY_MODE", raising=False)
    else:
        monkeypatch.setenv("KVCANARY_MODE", mode)
    monkeypatch.delitem(sys.modules, "kvcanary.engines.sglang.entry", raising=False)
    plugin.register()
    assert "kvcanary.engines.sglang.entry" not in sys.modules


def test_the_configuration_comes_from_the_environment_and_a_bad_mode_is_refused(monkeypatch):
    from kvcanary.engines.sglang.entry import config_from_env

    monkeypatch.setenv("KVCANARY_MODE", "quarantine")
    monkeypatch.setenv("KVCANARY_PATROL_BUDGET_BYTES", "0")
    c = config_from_env()
    assert c.mode == "quarantine" and c.patrol_budget_bytes == 0
    monkeypatch.setenv("KVCANARY_MODE", "repair")
    monkeypatch.setenv("KVCANARY_REPAIR_LIMIT", "3")
    c = config_from_env()
    assert c.mode == "repair" and c.repair_limit == 3
    monkeypatch.setenv("KVCANARY_MODE", "lgo")
    with pytest.raises(ConfigError, match="KVCANARY_MODE"):
        config_from_env()
