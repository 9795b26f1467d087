"""The operator kit (kvcanary.monitoring): the alerting rules pass ``promtool check rules``; a real
Prometheus server scraping a real run (transformers continuous batching with a flipped byte in a
shared block, repair mode) fires exactly the alerts that run earns, and every rule's expression
evaluates as expected against that scrape; the dashboard queries only metrics kvcanary exports.

promtool and prometheus come from Debian's ``prometheus`` package (``scripts/test`` installs it
where it is missing and apt-get can).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from kvcanary import metrics, monitoring

NEED = "install Debian's prometheus package (apt-get install prometheus): it brings promtool and prometheus"

WORKLOAD = """
import logging, random, time, torch, transformers
from kvcanary import CanaryConfig
from kvcanary.engines.transformers import cb_configs, protect, tiny_model
from kvcanary.faults.transformers_cb import CbFault
logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
model = tiny_model(seed=0, layers=2)
rng = random.Random(6)
prefix = [rng.randrange(1000) for _ in range(32)]
prompts = [prefix + [rng.randrange(1000) for _ in range(rng.randint(2, 9))] for _ in range(24)]
gen, cbc = cb_configs(max_new_tokens=8)
def run(hooks):
    cfg = CanaryConfig.from_env(CanaryConfig(mode="repair", content_budget_bytes=None))  # KVCANARY_METRICS_PORT
    with torch.inference_mode(), protect(model, cfg) as g:
        g.hooks.extend(hooks)
        model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
    return g
run([])  # the counters appear, at 0
print("CLEAN", flush=True)
time.sleep(4)  # Prometheus scrapes them at 0
g = run([CbFault("flip_shared_byte", at=3, seed=1)])
print("FAULTED", g.stats()["repairs"], flush=True)
time.sleep(120)
"""

FIRES = {"KvCanaryViolation", "KvCanaryRequestsRepaired"}  # what the faulted repair run earns


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def rules() -> list[dict]:
    with open(monitoring.RULES, encoding="utf-8") as fh:
        return [r for g in yaml.safe_load(fh)["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules():
    promtool = shutil.which("promtool")
    assert promtool, NEED
    p = subprocess.run([promtool, "check", "rules", monitoring.RULES], capture_output=True, text=True)
    assert p.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in p.stdout, p.stdout + p.stderr


def exported_names() -> set[str]:
    m = metrics.Metrics()
    names = {name + "_total" for name, _ in metrics.COUNTERS.values()} | {"kvcanary_violations_total"}
    return names | {f.name for f in m.registry.collect() if not f.name.endswith("_total") and f.type == "gauge"}


def test_the_rules_and_the_dashboard_query_only_exported_metrics():
    with open(monitoring.DASHBOARD, encoding="utf-8") as fh:
        dash = json.load(fh)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]] + [r["expr"] for r in rules()]
    used = {n for e in exprs for n in re.findall(r"\bkvcanary_\w+", e)}
    assert used and used <= exported_names(), used - exported_names()
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, NEED
    target, port = free_port(), free_port()
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [monitoring.RULES],
           "scrape_configs": [{"job_name": "kvcanary", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'db'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(60):
            try:
                urllib.request.urlopen(base + "/-/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield base, target
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_prometheus_fires_what_a_faulted_repair_run_earns_and_nothing_else(prometheus):
    base, target = prometheus
    env = {**os.environ, "KVCANARY_METRICS_PORT": str(target)}
    work = subprocess.Popen([sys.executable, "-c", WORKLOAD], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        assert work.stdout is not None
        lines = [work.stdout.readline(), work.stdout.readline()]
        assert lines[0].startswith("CLEAN") and lines[1].startswith("FAULTED") and int(lines[1].split()[1]) > 0, lines
        firing: set[str] = set()
        for _ in range(60):  # the rules are evaluated every second
            alerts = get(base + "/api/v1/alerts")["data"]["alerts"]
            firing = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
            if FIRES <= firing:
                break
            time.sleep(1)
        assert firing == FIRES, firing
        violation = [a["labels"] for a in alerts if a["labels"]["alertname"] == "KvCanaryViolation"]
        assert {(lb["check"], lb["site"], lb["engine"]) for lb in violation} >= {("content", "verify", "transformers")}
        for rule in rules():  # every expression, evaluated on the scrape: results exactly where alerts fire
            q = get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": rule["expr"]}))["data"]["result"]
            assert bool(q) == (rule["alert"] in FIRES), (rule["alert"], q)
    finally:
        work.kill()
        work.wait(timeout=30)
