"""The Triton path's before/after-forward never waits on the device: no value of a device tensor
reaches the host, no data-dependent output shape, no host-to-device copy of a Python value.

A CUDA graph would refuse or silently freeze such an op; this test catches it on any machine. It
runs the Triton path (interpreted on a CPU) while every such entry point raises when called from
kvcanary's own code. The interpreter's own calls pass, as do the kernels' bodies (they do not
call torch).
"""

import random

import pytest
import torch

from kvcanary import Canary, CanaryConfig
from kvcanary.faults.host_sync import HostSync, no_host_sync

from factories import paged_layout, prefill_of, random_step, step_to

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _canary(layout, budget):
    return Canary(layout.sources[0].num_slots if layout.sources else 4096, layout,
                  CanaryConfig(mode="raise", backend="triton", validate=False, content_budget_bytes=budget),
                  device=DEV)


@pytest.mark.parametrize("budget,layout_kind", [(None, "content"), (4096, "content"), (None, "metadata")])
def test_triton_forward_path_never_syncs_the_host(budget, layout_kind):
    rng = random.Random(f"sync-{budget}-{layout_kind}")
    nb, bs = 64, 16
    layout = paged_layout(nb, bs, row=32, nsrc=2, device=DEV)
    if layout_kind == "metadata":
        layout = layout.__class__()
    # a long prefill (several scan blocks) and a decode-like step (one block)
    for lens in ([(300, 2), (20, 5), (0, 40)], [(30, 1), (17, 1), (64, 1)]):
        step, stoks = random_step(rng, nb * bs, bs, lens, "block", pad_rows=1, pad_tokens=True)
        step.expected_new_tokens = step.new_tokens.clone()  # a clean step
        step = step_to(step, DEV)
        pre = step_to(prefill_of(step, stoks), DEV)
        canary = _canary(layout, budget)
        canary.after_forward(pre)  # outside: first launches compile
        with no_host_sync():
            canary.before_forward(step)
            canary.after_forward(step)
        assert canary.poll() == []
        assert canary.stats()["slots_verified"] == sum(c for c, _ in lens)


def test_the_guard_catches_a_sync():
    step, _ = random_step(random.Random(1), 256, 16, [(5, 1)], "block")
    with no_host_sync(), pytest.raises(HostSync, match="step.py"):
        step.validate_values(256)  # reads values: fine on the torch path, never on the forward path

