"""What the three suites (tests/, tests_vllm/, tests_sglang/) share: under pytest-xdist (the scripts
run two workers), each worker on its own share of the cores, set before any test imports torch or
starts an engine, so two workers' thread pools never contend for one core (an OpenMP pool that shares
its cores with another spins instead of working: slower than one worker alone)."""

import os


def _own_cores() -> None:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; unset outside xdist
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not name.startswith("gw") or workers < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return  # fewer cores than workers: sharing them is all there is
    i = int(name[2:]) % workers
    os.sched_setaffinity(0, cores[i::workers])


_own_cores()
