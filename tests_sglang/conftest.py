"""SGLang's CPU engine for kvcanary's SGLang tests: run in .venv-sglang (scripts/setup-sglang, or
scripts/test-sglang, which sets it up and runs these tests).

A tiny random-weight Llama is saved to a temporary folder (nothing is downloaded). Three engines serve
the session, one after the other (at most one engine process at a time; each takes tens of seconds
to start): a plain one (``engine``: the smoke tests in test_engine.py, which run first, and the
reference run of the fixed workload), then one with kvcanary turned on the way a user turns it on,
``KVCANARY_MODE=log`` in the environment and nothing else (``canary``: every other test), then a
tiny Gemma2 with the canary (``gemma2``: sliding-window layers; its tests run last). The
engines' schedulers run in spawned subprocesses; they find the sgl_kernel and torchvision stand-ins
(tests_sglang/stubs/) through the .pth file scripts/setup-sglang writes into .venv-sglang, and the
tests' control plugin (tests_sglang/control/: fault injection, mode, stats) through PYTHONPATH."""

import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# admit more than fits, so that memory pressure retracts decodes (workload.PRESSURE)
os.environ.setdefault("SGLANG_INIT_NEW_TOKEN_RATIO", "0.01")
sys.path.insert(0, HERE)  # tiny_model, workload
# the control plugin: spawned schedulers take this process's sys.path, where SGLang looks for plugins
sys.path.insert(0, os.path.join(HERE, "control"))

pytest.importorskip("sglang", reason="SGLang is not installed here: run scripts/test-sglang (.venv-sglang)")

ENGINE_ARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                   disable_overlap_schedule=True, max_total_tokens=1024, chunked_prefill_size=64, random_seed=0,
                   log_level="error")
CANARY_ENV = ("KVCANARY_MODE", "KVCANARY_VIOLATIONS_LOG", "KVCANARY_TEST_CONTROL")


def pytest_collection_modifyitems(items):
    # the plain engine's tests first: it gives way to the canary's engine afterwards, and that to the
    # Gemma2 engine's tests at the end
    items.sort(key=lambda it: 0 if it.path.name == "test_engine.py" else 2 if "gemma2" in it.fixturenames else 1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class _Plain:
    """The plain engine, started on first use and shut down before the canary's starts."""

    def __init__(self, model):
        self.model, self.engine = model, None

    def get(self):
        if self.engine is None:
            import sglang as sgl

            for var in CANARY_ENV:
                assert var not in os.environ, f"{var} is set: the plain engine would run the canary"
            self.engine = sgl.Engine(model_path=self.model, **ENGINE_ARGS)
        return self.engine

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


@pytest.fixture(scope="session")
def plain(tiny_llama):
    p = _Plain(tiny_llama)
    yield p
    p.close()


@pytest.fixture(scope="session")
def engine(plain):
    return plain.get()


@pytest.fixture(scope="session")
def reference(plain):
    """The fixed workload's outputs on the plain engine (which then shuts down)."""
    import workload

    out = workload.run(plain.get())
    plain.close()
    return out


class Canary:
    """The engine with kvcanary on, and the tests' hands in its scheduler (tests_sglang/control/)."""

    def __init__(self, engine, where):
        self.engine, self.where = engine, where
        self.log = os.path.join(where, "violations.jsonl")
        self.commands = 0

    def command(self, mode=None, fault=None, **more):
        """Switch the canary's mode and/or arm a fault for the next batch it matches (``break``:
        make a piece of kvcanary fail, or mend it with ``None``; tests_sglang/control/)."""
        self.commands += 1
        cmd = {"id": self.commands, "mode": mode, "fault": fault, **more}
        tmp = os.path.join(self.where, "command.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(cmd, fh)
        os.replace(tmp, os.path.join(self.where, "command.json"))
        time.sleep(0.01)  # a distinct mtime for the plugin's next look

    def state(self):
        with open(os.path.join(self.where, "state.json")) as fh:
            return json.load(fh)

    def events(self):
        """Every violation event kvcanary wrote so far (its JSONL log)."""
        if not os.path.exists(self.log):
            return []
        with open(self.log) as fh:
            return [json.loads(line) for line in fh if line.strip()]


def _canary_engine(model, where, plain):
    """An engine with kvcanary turned on the way a user turns it on (``KVCANARY_MODE=log`` in the
    environment), the tests' control plugin in its scheduler."""
    from engine_env import start

    plain.close()
    env = {"KVCANARY_MODE": "log", "KVCANARY_VIOLATIONS_LOG": os.path.join(where, "violations.jsonl"),
           "KVCANARY_TEST_CONTROL": where,
           "PYTHONPATH": os.path.join(HERE, "control") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    eng = start(model, env, **ENGINE_ARGS)
    c = Canary(eng, where)
    # one request, so that the scheduler's first forward binds the canary to the pool (state.json)
    eng.generate(input_ids=[[5, 6, 7]], sampling_params={"temperature": 0, "max_new_tokens": 2})
    assert c.state()["stats"]["forwards"] >= 2, c.state()
    return c


class _Running:
    """The canary engine of the session that is running (one engine process at a time)."""

    engine = None


@pytest.fixture(scope="session")
def canary(reference, plain, tiny_llama, tmp_path_factory):
    c = _canary_engine(tiny_llama, str(tmp_path_factory.mktemp("canary")), plain)
    _Running.engine = c.engine
    yield c
    if _Running.engine is c.engine:
        c.engine.shutdown()
        _Running.engine = None


@pytest.fixture(scope="session")
def gemma2(plain, tmp_path_factory):
    """A tiny Gemma2 (its even layers attend through a sliding window of 8) with the canary on,
    started after the Llama's canary engine shut down (its tests run last)."""
    from tiny_model import make_tiny_model

    if _Running.engine is not None:
        _Running.engine.shutdown()
        _Running.engine = None
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2")
    c = _canary_engine(model, str(tmp_path_factory.mktemp("gemma2")), plain)
    yield c
    c.engine.shutdown()


def pytest_addoption(parser):
    parser.addoption("--fuzz", type=int, default=int(os.environ.get("KVCANARY_SGLANG_FUZZ", "0")),
                     help="rounds of the randomized clean fuzz (test_fuzz.py; default KVCANARY_SGLANG_FUZZ or 0: off)")


def pytest_configure(config):
    # SGLang warns at import that CUDA-only quantization and Triton kernels are off on a CPU
    config.addinivalue_line("filterwarnings", r"ignore::UserWarning:sglang(\..*)?")
    # and what its imports say about SWIG types and torch.jit (nothing the tests use)
    config.addinivalue_line("filterwarnings", "ignore:builtin type Swig:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
