"""Run a tiny vLLM CPU engine once, optionally under the canary and with one fault injected in the
worker, and print one JSON line: every request's tokens, the canary's stats and violations.

    python engine_run.py '{"model": DIR, "canary": true, "fault": "flip_v", "num_blocks": 24, ...}'

The run itself is :func:`kvcanary.faults.vllm_runner.run` (its docstring lists the keys), which the
selftest and the benchmark use too. A process per run: vLLM keeps per-process globals (the KV
connector agent) that a second engine in the same process would inherit.
"""

from kvcanary.faults.vllm_runner import main

if __name__ == "__main__":
    main()
