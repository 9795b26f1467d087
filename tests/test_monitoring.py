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


def dashboard_results(base: str) -> dict[str, list[tuple[dict, float]]]:
    """Every dashboard panel's first query evaluated now, its variables at "All" and the range 10 minutes:
    title -> [(labels, value)]."""
    with open(monitoring.DASHBOARD, encoding="utf-8") as fh:
        dash = json.load(fh)
    out = {}
    for p in dash["panels"]:
        expr = p["targets"][0]["expr"].replace("$__range", "10m")
        for var in ("$engine", "$instance", "$group"):
            expr = expr.replace(var, ".*")
        res = get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]
        out[p["title"]] = [(r["metric"], float(r["value"][1])) for r in res]
    return out


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
        assert all(lb["instance"] == f"127.0.0.1:{target}" and lb["group"] and lb["tp_rank"] for lb in violation)
        for rule in rules():  # every expression, evaluated on the scrape: results exactly where alerts fire
            q = get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": rule["expr"]}))["data"]["result"]
            assert bool(q) == (rule["alert"] in FIRES), (rule["alert"], q)
        # the dashboard's queries on the same scrape: the one-off incident shows in its stat and its panel
        panels = dashboard_results(base)
        assert panels["Violations (range)"][0][1] > 0 and panels["Requests repaired (range)"][0][1] > 0, panels
        by_check = panels["Violations by check, site and instance (records per 5 min)"]
        assert any(lb.get("check") == "content" and lb.get("site") == "verify" and v > 0 for lb, v in by_check), by_check
        checked = panels["Write check and read audit per second"]  # the runs' write checks, by worker
        assert any(lb.get("engine") == "transformers" and lb.get("tp_rank") == "0" and v > 0 for lb, v in checked), checked
    finally:
        work.kill()
        work.wait(timeout=30)


# ---- the rules, unit-tested on synthetic series (promtool test rules) ---------------------------

WHERE = {"job": "vllm", "engine": "vllm", "group": "full_attention", "tp_rank": "1", "pp_rank": "0", "dp_rank": "0"}


def series(name: str, values: str, **labels: str) -> dict:
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


def firing(alert: str, *label_sets: dict) -> list[dict]:
    """promtool expected samples: the ALERTS series of ``alert`` firing with each label set."""
    def text(lb):
        every = {"alertname": alert, "alertstate": "firing", **lb}
        return "ALERTS{" + ", ".join(f'{k}="{v}"' for k, v in sorted(every.items())) + "}"

    return [{"labels": text(lb), "value": 1} for lb in label_sets]


def promtool_test(tmp_path, tests: list[dict]) -> None:
    promtool = shutil.which("promtool")
    assert promtool, NEED
    spec = {"rule_files": [monitoring.RULES], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    p = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


def alerts_at(minutes: int, alert: str, *label_sets: dict) -> dict:
    return {"expr": f'ALERTS{{alertname="{alert}", alertstate="firing"}}', "eval_time": f"{minutes}m",
            "exp_samples": firing(alert, *label_sets)}


def test_not_running_means_a_serving_engine_whose_canary_stopped(tmp_path):
    tokens, steps, up = "vllm:generation_tokens_total", "kvcanary_steps_total", "up"
    node = {n: {"job": "vllm", "instance": f"{n}:8000"} for n in
            ("stopped", "idle", "gone", "restarted", "never", "healthy")}
    canary = {k: v for k, v in WHERE.items() if k != "job"}
    inputs = [
        # the canary's counter stops at minute 20 while the engine goes on generating tokens
        series(tokens, "0+100x60", **node["stopped"]), series(steps, "0+50x20 1000x40", **node["stopped"], **canary),
        # an idle engine: neither moves
        series(tokens, "500x60", **node["idle"]), series(steps, "100x60", **node["idle"], **canary),
        # the process is gone at minute 20: the target is down, its series go stale
        series(up, "1x20 0x40", **node["gone"]), series(tokens, "0+100x20 stale", **node["gone"]),
        series(steps, "0+50x20 stale", **node["gone"], **canary),
        # restarted at minute 20 without the canary: the engine serves, kvcanary's series are gone
        series(tokens, "0+100x60", **node["restarted"]), series(steps, "0+50x20 stale", **node["restarted"], **canary),
        # an engine that never ran the canary is not this alert's business
        series(tokens, "0+100x60", **node["never"]),
        series(tokens, "0+100x60", **node["healthy"]), series(steps, "0+50x60", **node["healthy"], **canary),
    ]
    inputs += [series(up, "1x60", **node[n]) for n in node if n != "gone"]
    sev = {"severity": "warning"}
    promtool_test(tmp_path, [{"interval": "1m", "input_series": inputs, "promql_expr_test": [
        alerts_at(22, "KvCanaryNotRunning"),  # pending: for 5m
        alerts_at(40, "KvCanaryNotRunning", *({**node[n], **sev} for n in ("gone", "restarted", "stopped"))),
    ]}])


def test_alerts_say_which_machine_group_and_rank_and_see_one_off_incidents(tmp_path):
    one_off = {**WHERE, "instance": "node-1:8000"}  # a series born at its first violation, never rising again
    rising = {**WHERE, "instance": "node-2:8000", "group": "sliding_attention", "tp_rank": "3"}
    chk = {"check": "content", "site": "verify"}
    inputs = [series("kvcanary_violations_total", "_x10 3x30", **one_off, **chk),
              series("kvcanary_violations_total", "0x10 2x30", **rising, **chk),
              series("kvcanary_repairs_total", "_x10 1x30", **one_off),  # healing counters born after a repair
              series("kvcanary_repairs_total", "0x40", **rising)]
    crit, warn = {"severity": "critical"}, {"severity": "warning"}
    promtool_test(tmp_path, [{"interval": "1m", "input_series": inputs, "promql_expr_test": [
        alerts_at(12, "KvCanaryViolation", {**one_off, **chk, **crit}, {**rising, **chk, **crit}),
        alerts_at(20, "KvCanaryViolation"),  # 10 minutes on, nothing new
        alerts_at(12, "KvCanaryRequestsRepaired", {**one_off, **warn}),
    ]}])


def test_reads_of_unverifiable_slots_alert_when_they_keep_coming(tmp_path):
    many = {**WHERE, "instance": "node-1:8000"}  # 2% of reads, for an hour
    few = {**WHERE, "instance": "node-2:8000"}  # 0.5%
    warm = {**WHERE, "instance": "node-3:8000"}  # attached to a warm engine: they stop as blocks are rewritten
    inputs = [series("kvcanary_slots_verified_total", "0+1000x90", **lb) for lb in (many, few, warm)]
    inputs += [series("kvcanary_unverifiable_slots_total", "0+20x90", **many),
               series("kvcanary_unverifiable_slots_total", "0+5x90", **few),
               series("kvcanary_unverifiable_slots_total", "0+300x10 3000x80", **warm)]
    promtool_test(tmp_path, [{"interval": "1m", "input_series": inputs, "promql_expr_test": [
        alerts_at(30, "KvCanaryUnverifiableReads"),  # pending: for 30m
        alerts_at(60, "KvCanaryUnverifiableReads", {**many, "severity": "warning"}),
    ]}])


def test_every_rule_links_its_runbook_section_and_keeps_the_machine_and_ranks():
    with open(monitoring.RUNBOOK, encoding="utf-8") as fh:
        runbook = fh.read()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", runbook, re.M)}
    for rule in rules():
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"RUNBOOK.md#{name.lower()}" and name.lower() in anchors, name
        assert f"## {name}\n\n**Means:**" in runbook and "**Do:**" in runbook.split(f"## {name}\n", 1)[1], name
        if "sum by" in rule["expr"]:
            for by in re.findall(r"by \(([^)]*)\)", rule["expr"]):
                kept = {lb.strip() for lb in by.split(",")}
                assert {"job", "instance"} <= kept, (name, by)
                if name != "KvCanaryNotRunning":  # per machine only: its engine side has no canary labels
                    assert {"engine", "group", "tp_rank", "pp_rank", "dp_rank"} <= kept, (name, by)
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as fh:
        data = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["kvcanary"]
    assert "monitoring/*.md" in data  # the runbook ships with the package


def test_the_dashboard_filters_by_instance_and_group():
    with open(monitoring.DASHBOARD, encoding="utf-8") as fh:
        dash = json.load(fh)
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "engine", "instance", "group"]
    for p in dash["panels"]:
        for t in p["targets"]:
            assert all(f'{lb}=~"${lb}"' in t["expr"] for lb in ("engine", "instance", "group")), (p["title"], t["expr"])


def test_copy_keeps_files_edited_in_place_unless_forced(tmp_path, capsys):
    from kvcanary import cli

    where = tmp_path / "kit"
    assert cli.main(["monitoring", "--copy", str(where)]) == 0
    assert capsys.readouterr().out.count("copied ") == 3
    rules_there = where / "alerts.yml"
    rules_there.write_text(rules_there.read_text() + "# our own receiver routing\n")
    assert cli.main(["monitoring", "--copy", str(where)]) == 0
    out = capsys.readouterr().out
    assert f"kept {rules_there}: edited there since kvcanary copied it (--force replaces it with kvcanary's)" in out
    assert rules_there.read_text().endswith("# our own receiver routing\n")
    assert f"up to date: {where / 'dashboard.json'}" in out
    # an earlier copy that nobody edited is brought up to date: here, its runbook links
    assert cli.main(["monitoring", "--copy", str(where), "--force", "--runbook-url", "https://wiki/k/RUNBOOK.md"]) == 0
    assert f"copied {rules_there}" in capsys.readouterr().out
    assert 'runbook_url: "https://wiki/k/RUNBOOK.md#kvcanaryviolation"' in rules_there.read_text()
    assert cli.main(["monitoring", "--copy", str(where)]) == 0  # unedited since: replaced by the shipped file
    assert f"copied {rules_there}" in capsys.readouterr().out
    assert rules_there.read_text() == open(monitoring.RULES, encoding="utf-8").read()
    assert cli.main(["monitoring", "--force"]) == 2
