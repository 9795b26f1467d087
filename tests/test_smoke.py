"""The package imports and the demo's summary reports a clean run."""

import json

from kvcanary.cli import main


def test_demo_clean(capsys):
    assert main(["demo", "--engine", "scripted", "--requests", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["violations"] == 0 and out["slots_verified"] > 0 and out["content_bytes_stamped"] > 0
