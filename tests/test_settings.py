"""Every setting honoured or refused by name: ``protect(model)`` applies the ``KVCANARY_*`` variables,
a mapping of field names is read as the variables are (unknown keys refused with the closest name),
healing modes need an engine adapter, and guard slots a metadata-only canary cannot check are said."""

import logging

import pytest
import torch

from kvcanary import ByteSource, Canary, CanaryConfig, ConfigError, KvLayout
from kvcanary.engines.transformers.entry import Protection, protect
from kvcanary.engines.transformers.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0, layers=1)


def test_protect_without_a_config_applies_every_kvcanary_variable(model, monkeypatch):
    monkeypatch.setenv("KVCANARY_MODE", "repair")
    monkeypatch.setenv("KVCANARY_AUDIT_QUERIES", "7")
    monkeypatch.setenv("KVCANARY_CONTENT_BUDGET_BYTES", "none")
    cfg = Protection(model).config
    assert (cfg.mode, cfg.audit_queries, cfg.content_budget_bytes) == ("repair", 7, None)
    monkeypatch.setenv("KVCANARY_REPAIR_LIMIT", "many")
    with pytest.raises(ConfigError, match="KVCANARY_REPAIR_LIMIT: expected an integer, got 'many'"):
        protect(model)


def test_an_explicit_config_is_used_as_it_is(model, monkeypatch):
    monkeypatch.setenv("KVCANARY_MODE", "repair")
    assert Protection(model, CanaryConfig(mode="raise")).config.mode == "raise"


def test_protect_takes_a_mapping_of_field_names_over_the_variables(model, monkeypatch):
    monkeypatch.setenv("KVCANARY_AUDIT_EVERY", "3")
    cfg = Protection(model, {"mode": "repair", "content_budget_bytes": "auto", "write_check": "off"}).config
    assert (cfg.mode, cfg.audit_every, cfg.content_budget_bytes, cfg.write_check) == ("repair", 3, "auto", False)
    with pytest.raises(ConfigError, match=r"config: unknown key 'mdoe' \(not a CanaryConfig field\); "
                                          r"did you mean 'mode'\?"):
        protect(model, {"mdoe": "repair"})
    with pytest.raises(ConfigError, match=r"config: expected a CanaryConfig, a mapping of its field names to values "
                                          r"or None \(e.g. CanaryConfig\(mode='repair'\) or \{'mode': 'repair'\}\), "
                                          r"got str 'repair'"):
        protect(model, "repair")


@pytest.mark.parametrize("key, value, msg", [
    ("content_budget_bytes", "lots", "content_budget_bytes: expected an integer, 'auto' or 'none', got 'lots'"),
    ("content_budget_bytes", -1, "content_budget_bytes: expected an integer >= 0, 'auto' or None, got int -1"),
    ("ring_capacity", "10**12", "ring_capacity: expected an integer, got '10\\*\\*12'"),
    ("metrics", "maybe", "metrics: expected one of 1/0/true/false/yes/no/on/off, got 'maybe'"),
    ("mode", "reapir", "mode: expected one of"),
    ("audit_tolerance", 5, r"audit_tolerance: expected a number in \(0, 2\) or None, got 5"),
])
def test_a_mapping_value_is_checked_as_its_variable_is_and_named_with_where_it_stood(key, value, msg):
    with pytest.raises(ConfigError, match=rf"^kv_connector_extra_config: {msg}"):
        CanaryConfig.from_mapping({key: value}, where="kv_connector_extra_config")


def test_a_mapping_reads_strings_and_native_values_alike_and_skips_the_callers_own_keys():
    a = CanaryConfig.from_mapping({"ring_capacity": "64", "validate": "1", "audit_tolerance": "auto",
                                   "violations_log": None, "stamp_store": "/x"}, also=("stamp_store",))
    b = CanaryConfig.from_mapping({"ring_capacity": 64, "validate": True, "audit_tolerance": None})
    assert a == b and a.ring_capacity == 64 and a.validate is True
    with pytest.raises(ConfigError, match=r"unknown key 'bogus_key' \(not a CanaryConfig field\); expected one of "
                                          r"mode, content, .*, stamp_store"):
        CanaryConfig.from_mapping({"bogus_key": 1}, also=("stamp_store",))
    with pytest.raises(ConfigError, match=r"config: expected a mapping of CanaryConfig field names to values, got "
                                          r"list \['mode'\]"):
        CanaryConfig.from_mapping(["mode"])  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["quarantine", "repair"])
def test_a_bare_canary_refuses_healing_modes_and_names_the_adapters(mode):
    with pytest.raises(ConfigError, match=rf"mode: expected 'off', 'log' or 'raise' for a Canary without an engine "
                                          rf"adapter, got '{mode}': healing .*kvcanary.protect\(model\) .* "
                                          rf"KvCanaryConnector"):
        Canary(64, config=CanaryConfig(mode=mode))
    assert Canary(64, config=CanaryConfig(mode=mode), healer="test").config.mode == mode


def test_guard_slots_of_a_metadata_only_canary_are_said_once(caplog, monkeypatch):
    from kvcanary import canary_args

    monkeypatch.setattr(canary_args, "_said_unguarded", [])
    kv = torch.zeros(16, 8)
    layout = KvLayout((ByteSource.from_tensor("kv", kv),), reserved=(3,))
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        c = Canary(16, layout, CanaryConfig(content="none"))
        Canary(16, layout, CanaryConfig(content="none"))
    said = [r.getMessage() for r in caplog.records if "guard slots" in r.getMessage()]
    assert said == ["kvcanary: content='none' (KVCANARY_CONTENT=none): the layout's guard slots (reserved: 1) are "
                    "not checked, since no bytes are fingerprinted; content='all' checks them on every forward"]
    assert c.guards.count == 0  # what the warning says: nothing is checked there
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        assert Canary(16, layout, CanaryConfig(content="all")).guards.count >= 1
    assert not [r for r in caplog.records if "guard slots" in r.getMessage()]
