"""What an operator needs beside kvcanary's metrics (:mod:`kvcanary.metrics`), shipped with the
package: Prometheus alerting rules (:data:`RULES`), a Grafana dashboard (:data:`DASHBOARD`) and the
runbook the rules link to (:data:`RUNBOOK`). ``kvcanary monitoring`` prints where they are, or
copies them (``--copy DIR``).

The rules alert on any violation, on requests repaired or failed, on tokens sampled from corrupted
KV before a report, on a serving engine whose canary stopped, on the canary's own failures, on
reads of unverifiable slots, on content coverage falling, on cold cache left unverified for longer
than one patrol pass and on records lost; each keeps the machine (``instance``), the KV cache group
and the ranks in its labels. Checked by ``promtool check rules`` and ``promtool test rules``, and
evaluated by a real Prometheus server against a scrape of a real run in the tests.

:func:`copy` keeps a copied file that was edited where it was copied to (a recorded digest of what
it wrote, ``.kvcanary-monitoring.json`` in the directory, tells an edit from an older copy), unless
forced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "alerts.yml")
DASHBOARD = os.path.join(HERE, "dashboard.json")
RUNBOOK = os.path.join(HERE, "RUNBOOK.md")
FILES = (RULES, DASHBOARD, RUNBOOK)
MANIFEST = ".kvcanary-monitoring.json"  # in a copy's directory: the digest of each file as copied


@dataclass
class Copied:
    """What :func:`copy` did with each file (paths in the target directory)."""

    written: list[str] = field(default_factory=list)  # new, replaced (an earlier copy, unedited), or forced
    unchanged: list[str] = field(default_factory=list)  # already the same bytes
    kept: list[str] = field(default_factory=list)  # edited there since it was copied: left as it was

    @property
    def paths(self) -> list[str]:
        """Every file's path in the target directory, in :data:`FILES` order."""
        every = set(self.written) | set(self.unchanged) | set(self.kept)
        return sorted(every, key=lambda p: [os.path.basename(f) for f in FILES].index(os.path.basename(p)))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rules_text(runbook_url: str | None = None) -> str:
    """The alerting rules, their ``runbook_url`` annotations pointing at ``runbook_url`` (the
    address where the runbook is published; each rule's section anchor appended) where given."""
    with open(RULES, encoding="utf-8") as fh:
        text = fh.read()
    if runbook_url:
        base = runbook_url.split("#", 1)[0]
        text = re.sub(r'runbook_url: "RUNBOOK\.md(#[a-z0-9-]+)"', lambda m: f'runbook_url: "{base}{m.group(1)}"', text)
    return text


def copy(directory: str, force: bool = False, runbook_url: str | None = None) -> Copied:
    """Copy the rules, the dashboard and the runbook into ``directory`` (created if missing).

    A file already there is replaced only when it is what an earlier copy wrote (an older version,
    unedited) or when ``force``; one edited there since (or not written by a copy at all) is kept
    and listed in :attr:`Copied.kept`. ``runbook_url``: where the runbook is published, for the
    rules' ``runbook_url`` annotations (default: ``RUNBOOK.md#...``, beside the rules)."""
    os.makedirs(directory, exist_ok=True)
    manifest_path = os.path.join(directory, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            recorded = dict(json.load(fh))
    except (OSError, ValueError, TypeError):
        recorded = {}
    done = Copied()
    for src in FILES:
        name = os.path.basename(src)
        if src == RULES:
            data = rules_text(runbook_url).encode()
        else:
            with open(src, "rb") as fh:
                data = fh.read()
        dest = os.path.join(directory, name)
        try:
            with open(dest, "rb") as fh:
                there: bytes | None = fh.read()
        except FileNotFoundError:
            there = None
        if there == data:
            done.unchanged.append(dest)
        elif there is not None and not force and recorded.get(name) != _digest(there):
            done.kept.append(dest)
            continue
        else:
            tmp = dest + ".tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
            done.written.append(dest)
        recorded[name] = _digest(data)
    with open(manifest_path, "w", encoding="utf-8") as fh:
        json.dump(recorded, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return done
