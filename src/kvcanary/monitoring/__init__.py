"""What an operator needs beside kvcanary's metrics (:mod:`kvcanary.metrics`), shipped with the
package: Prometheus alerting rules (:data:`RULES`) and a Grafana dashboard (:data:`DASHBOARD`).
``kvcanary monitoring`` prints where they are, or copies them (``--copy DIR``).

The rules alert on any violation, on requests repaired or failed, on tokens sampled from corrupted
KV before a report, on a canary that stopped updating, on the canary's own failures, on content
coverage falling, and on cold cache left unverified for longer than one patrol pass. Checked by
``promtool check rules`` and evaluated by a real Prometheus server against a scrape of a real run
in the tests.
"""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "alerts.yml")
DASHBOARD = os.path.join(HERE, "dashboard.json")


def copy(directory: str) -> list[str]:
    """Copy the rules and the dashboard into ``directory`` (created if missing); returns their paths."""
    os.makedirs(directory, exist_ok=True)
    return [shutil.copy(p, os.path.join(directory, os.path.basename(p))) for p in (RULES, DASHBOARD)]
