"""A vLLM general plugin for the tests only: in every vLLM process it loads in, it installs the
fault named by KVCANARY_TEST_FAULT (kvcanary.faults.vllm), so a multiprocess engine's worker
injects it. Put this folder on PYTHONPATH to load it."""

import os


def register():
    name = os.environ.get("KVCANARY_TEST_FAULT")
    if name:
        from kvcanary.faults import vllm

        vllm.install(name, int(os.environ.get("KVCANARY_TEST_FAULT_AT", "3")))
