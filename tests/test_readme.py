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


def test_api_example_runs_clean_and_a_changed_byte_is_caught(capsys):
    import pytest
    import torch

    from kvcanary import Check, KvCorruptionError

    ns = {"__name__": "readme_api_example"}
    exec(compile(python_block("API"), str(README), "exec"), ns)
    canary, step = ns["canary"], ns["step"]
    stats = canary.stats()
    assert stats["violations"] == 0 and stats["internal_errors"] == 0
    assert stats["slots_stamped"] == 7 and stats["slots_verified"] == 6  # the decode read the 6 prompt tokens
    assert "'slots_verified': 6" in capsys.readouterr().out
    k0 = ns["kv_caches"][0][0]
    k0.view(torch.uint8).view(-1)[int(ns["block_table"][0, 0]) * k0[0].numel() * 4] ^= 1  # position 0's K, layer 0
    nxt = ns["Step"](block_table=step.block_table, block_size=step.block_size, cached_lens=torch.tensor([7]),
                     new_offsets=torch.tensor([0, 1]), new_tokens=torch.tensor([18]), new_positions=torch.tensor([7]),
                     new_slots=torch.tensor([23]))
    canary.before_forward(nxt)
    with pytest.raises(KvCorruptionError) as ei:
        canary.poll()
    assert ei.value.first is not None and ei.value.first.checks == Check.CONTENT and ei.value.first.slot == 12


def test_the_contents_and_every_link_inside_the_readme_name_a_section():
    text = README.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) > 15 and set(links) <= anchors, set(links) - anchors
    contents = text.split("**Contents:**", 1)[1].split("\n\n", 1)[0]
    sections = [re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", text, re.M)]
    assert [a for a in sections if f"(#{a})" not in contents] == []  # every section is in the contents
