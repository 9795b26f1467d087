"""Prometheus metrics: the text exposition a scrape returns matches the canary's own counters, by
engine, group and rank; violations are counted by check and site; the exporter serves them on a
port; a process writing to ``PROMETHEUS_MULTIPROC_DIR`` is collected from there."""

import json
import logging
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from kvcanary import CanaryConfig, Check, ConfigError, Site
from kvcanary import metrics
from kvcanary.engines.transformers import cb_configs, protect, tiny_model
from kvcanary.faults.transformers_cb import CbFault

from test_transformers import prompts


@pytest.fixture(scope="module")
def llama():
    return tiny_model(seed=0, layers=2)


def samples(text):
    """{(metric sample name, frozenset of labels): value} of a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(snap, name, **labels):
    return sum(v for (n, ls), v in snap.items() if n == name and set(labels.items()) <= set(ls))


def run(model, cfg, hooks=()):
    gen, cbc = cb_configs(max_new_tokens=8)
    with torch.inference_mode(), protect(model, cfg) as guard:
        guard.hooks.extend(hooks)
        model.generate_batch(prompts(12, seed=6), generation_config=gen, continuous_batching_config=cbc)
    return guard


def test_a_scrape_matches_the_canary_counters_and_counts_violations_by_check(llama):
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    before = samples(metrics.process_metrics().text())
    fault = CbFault("flip_shared_byte", at=3, seed=1)
    guard = run(llama, CanaryConfig(mode="log", content_budget_bytes=None, metrics=True), [fault])
    after = samples(metrics.process_metrics().text())
    assert fault.injected_at is not None and guard.violations
    heal = guard.own_counts()  # the adapter's own counts go out with its first canary's labels
    assert heal["harmful_tokens"] > 0  # log mode: the forwards that read the flipped byte sampled from it
    assert heal["audit_queries"] > 0 and heal["write_slots_checked"] > 0  # the write check's and audit's too
    first = next(iter(guard.named_canaries()))
    for name, c in guard.named_canaries().items():
        st = c.stats()
        labels = dict(engine="transformers", group=name, tp_rank="0", pp_rank="0", dp_rank="0")
        for key, (metric, _) in metrics.COUNTERS.items():
            if key == "internal_errors":
                continue
            want = st.get(key, 0) if key not in heal else heal[key] if name == first else 0
            got = value(after, metric + "_total", **labels) - value(before, metric + "_total", **labels)
            assert got == want, (name, key)
        assert value(after, "kvcanary_content_coverage_ratio", **labels) == pytest.approx(
            st["content_slots_verified"] / st["slots_verified"])
        assert value(after, "kvcanary_last_update_timestamp_seconds", **labels) > 0
        assert value(after, "kvcanary_unverified_age_max_steps", **labels) == st["unverified_age_max_steps"]
        assert st["guard_checks"] > 0
    hits = value(after, "kvcanary_violations_total", engine="transformers", check="content", site="verify") - \
        value(before, "kvcanary_violations_total", engine="transformers", check="content", site="verify")
    want = sum(1 for v in guard.violations if Check.CONTENT in v.checks and v.site == Site.VERIFY)
    assert hits == want > 0


def test_an_adapters_own_counters_go_out_with_its_first_canarys_labels():
    """An engine's own counters (vLLM's forwards whose steps were built on the device) are published
    with its first canary's labels, as its healing counters are, and not with the others'."""
    from kvcanary.engines.base import Adapter

    class Canary:
        def __init__(self):
            self.n = 0

        def stats(self):
            return {"steps": self.n}

    class Engine(Adapter):
        engine = "stub"

        def named_canaries(self):
            return self.canaries

        def own_counts(self):
            return {**self.heal_counts(), "device_forwards": 7}

    m = metrics.Metrics()
    e = Engine(CanaryConfig(mode="log"))
    e.metrics, e.canaries = m, {"g0": Canary(), "g1": Canary()}
    e.publish_metrics(force=True)
    snap = samples(m.text())
    assert value(snap, "kvcanary_device_steps_total", engine="stub", group="g0") == 7
    assert value(snap, "kvcanary_device_steps_total", engine="stub", group="g1") == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_exporter_serves_the_metrics_on_its_port(llama):
    port = _free_port()
    guard = run(llama, CanaryConfig(mode="log", metrics_port=port))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    snap = samples(body)
    assert value(snap, "kvcanary_slots_verified_total", engine="transformers") >= guard.stats()["slots_verified"] > 0
    assert metrics.serve(port) is True  # once per process: a second ask is the same exporter


def test_metrics_written_to_a_multiprocess_dir_are_collected_from_it(tmp_path):
    code = (
        "import torch\n"
        "from kvcanary import CanaryConfig\n"
        "from kvcanary.engines.transformers import cb_configs, protect, tiny_model\n"
        "m = tiny_model(seed=0, layers=1)\n"
        "gen, cbc = cb_configs(max_new_tokens=4)\n"
        "with torch.inference_mode(), protect(m, CanaryConfig(mode='log', metrics=True)) as g:\n"
        "    m.generate_batch([[1, 2, 3, 4, 5]] * 3, generation_config=gen, continuous_batching_config=cbc)\n"
        "import json; print(json.dumps(g.stats()))\n"
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    from prometheus_client import generate_latest

    snap = samples(generate_latest(reg).decode())
    assert value(snap, "kvcanary_slots_verified_total", engine="transformers") == stats["slots_verified"] > 0
    assert value(snap, "kvcanary_slots_stamped_total") == stats["slots_stamped"]


def test_metrics_without_prometheus_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match="prometheus-client is not installed"):
        metrics.Metrics()


@pytest.mark.parametrize("port", [0, 70000, "9000", True])
def test_a_bad_metrics_port_is_refused(port):
    with pytest.raises(ConfigError, match="metrics_port: expected a TCP port in 1 .. 65535 or None"):
        CanaryConfig(metrics_port=port)


def test_metrics_come_from_the_environment():
    cfg = CanaryConfig.from_env(environ={"KVCANARY_METRICS": "1", "KVCANARY_METRICS_PORT": "9464"})
    assert cfg.metrics is True and cfg.metrics_port == 9464
