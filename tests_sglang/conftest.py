"""SGLang's CPU engine for kvcanary's SGLang tests: run in .venv-sglang (scripts/setup-sglang, or
scripts/test-sglang, which sets it up and runs these tests).

A tiny random-weight Llama is saved to a temporary folder (nothing is downloaded) and one engine
serves the whole session (it takes tens of seconds to start). The engine's scheduler runs in a
spawned subprocess; it finds the sgl_kernel and torchvision stand-ins (tests_sglang/stubs/)
through the .pth file scripts/setup-sglang writes into .venv-sglang, not through this file."""

import os
import sys

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny_model

pytest.importorskip("sglang", reason="SGLang is not installed here: run scripts/test-sglang (.venv-sglang)")

ENGINE_ARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                   disable_overlap_schedule=True, max_total_tokens=4096, random_seed=0, log_level="error")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engine(tiny_llama):
    import sglang as sgl

    eng = sgl.Engine(model_path=tiny_llama, **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def pytest_configure(config):
    # SGLang warns at import that CUDA-only quantization and Triton kernels are off on a CPU
    config.addinivalue_line("filterwarnings", r"ignore::UserWarning:sglang(\..*)?")
    # and what its imports say about SWIG types and torch.jit (nothing the tests use)
    config.addinivalue_line("filterwarnings", "ignore:builtin type Swig:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
