"""The README's library example runs as written, in a fresh namespace, and reports a clean run."""

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def python_block(heading: str) -> str:
    """The first fenced python block under the README's ``## heading``."""
    text = README.read_text()
    assert f"\n## {heading}\n" in text, f"README has no section '## {heading}'"
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert m, f"no python block under '## {heading}'"
    return m.group(1)


def test_transformers_example_runs_clean(capsys):
    ns = {"__name__": "readme_example"}
    exec(compile(python_block("Protecting transformers continuous batching"), str(README), "exec"), ns)
    guard, out, prompts = ns["guard"], ns["out"], ns["prompts"]
    stats = guard.stats()
    assert guard.violations == []
    assert stats["violations"] == 0 and stats["internal_errors"] == 0
    assert stats["slots_verified"] > 0 and stats["slots_stamped"] > 0
    assert len(out) == len(prompts)
    printed = capsys.readouterr().out
    assert f"{len(prompts)} requests, {stats['slots_verified']} slots verified, violations: []" in printed
