"""``kvcanary warmup``: the fused CPU loops compiled once into kvcanary's own cache directory, loaded
by later processes without compiling (the demo's engine included), numba's global setting untouched;
a damaged cache file costs its loop a compile, never the fast path."""

import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from kvcanary.fused import cache


def _run(code_or_argv, env, timeout=300):
    argv = ["-m", "kvcanary", *code_or_argv] if isinstance(code_or_argv, list) else ["-c", code_or_argv]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


# a fresh process: load every loop, then run the transformers demo; what got compiled where, and how long
# loading took (torch imported first: its import is not the loops')
_LOAD = """
import json, time
import numba, torch
t0 = time.perf_counter()
from kvcanary import fused
assert fused.available() is None
took = time.perf_counter() - t0
loaded, compiled = fused.loaded(), fused.compiled()
import os
files = lambda: {os.path.join(d, f) for d, _, fs in os.walk(os.environ["KVCANARY_CACHE_DIR"]) for f in fs}
before = files()
from kvcanary.cli import main
assert main(["demo", "--model", "tiny", "--requests", "4", "--max-new-tokens", "4", "--json"]) == 0
paths = sorted({d.stats.cache_path for d in fused.loops().values()})
print(json.dumps({"took": took, "loaded": loaded, "compiled": compiled, "after_demo": fused.compiled(),
                  "loops": len(fused.loops()), "signatures": sum(len(d.signatures) for d in fused.loops().values()),
                  "paths": paths, "numba_cache_dir": numba.config.CACHE_DIR, "added": sorted(files() - before)}))
"""


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache directory ``kvcanary warmup`` compiled every loop into, and what it printed."""
    where = str(tmp_path_factory.mktemp("warm") / "loops")
    return where, _run(["warmup"], {"KVCANARY_CACHE_DIR": where}).stdout.splitlines()


def test_warmup_compiles_into_the_cache_dir_and_a_later_process_only_loads(warmed):
    where, first = warmed
    env = {"KVCANARY_CACHE_DIR": where}
    assert first[0] == f"compiling the fused CPU loops (once per machine, ~20-60 s) into {where} ..."
    assert first[1].startswith(f"cached in {where} (") and "compiled" in first[1]
    assert any(f.endswith(".nbi") for _, _, files in os.walk(where) for f in files)
    again = _run(["warmup"], env).stdout.splitlines()
    assert len(again) == 1 and again[0].startswith(f"already cached in {where}: ")
    got = json.loads(_run(_LOAD, env).stdout.splitlines()[-1])
    # every loop from the cache (a loop the adapters call with two argument types has two signatures)
    assert got["compiled"] == 0 and got["loaded"] == got["signatures"] >= got["loops"] > 0
    assert got["after_demo"] == 0, "the demo's engine compiled a signature the warm-up did not"
    assert got["added"] == [], got["added"]  # the demo added no file to the cache (its audit loop included)
    assert "kvcanary.fused.audit.check_forward" in fused_loop_names()
    assert all(p.startswith(where + os.sep) for p in got["paths"])
    assert got["numba_cache_dir"] == os.environ.get("NUMBA_CACHE_DIR", "")  # numba's own setting as it was
    assert got["took"] < 5, got  # a generous bound: loading takes about a second (warmup prints it)


def fused_loop_names():
    from kvcanary import fused

    return set(fused.loops())


def test_the_warm_up_counts_every_loop_the_package_calls_from_python():
    """``fused.loops()`` (what the warm-up counts and checks an engine's forwards against) names every
    compiled loop the package defines, but those only other loops call; a module of loops added
    or split off without being listed there fails here."""
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    from kvcanary import fused

    only_from_loops = {"kvcanary.fused.rows.dot"}  # called by the read audit's loop only
    defined = set()
    for info in pkgutil.iter_modules(fused.__path__):
        module = importlib.import_module(f"kvcanary.fused.{info.name}")
        defined |= {f"{module.__name__}.{k}" for k, v in vars(module).items()
                    if isinstance(v, Dispatcher) and v.targetoptions.get("inline") != "always"
                    and v.py_func.__module__ == module.__name__}
    assert "kvcanary.fused.scrub._guard" in defined and "kvcanary.fused.ops._verify" in defined
    assert defined - only_from_loops == set(fused.loops())


def test_an_unwritable_cache_dir_falls_back_with_one_warning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = """
import logging
logging.basicConfig(level=logging.WARNING)
from kvcanary.fused import cache
assert cache.usable_directory() is None and cache.usable_directory() is None
from kvcanary.fused import ops  # decorated with numba's default cache; nothing compiles here
print(ops._verify.stats.cache_path)
"""
    done = _run(code, {"KVCANARY_CACHE_DIR": str(blocker / "loops")})
    assert done.stderr.count("cannot write the compiled-loop cache") == 1
    assert not done.stdout.strip().startswith(str(blocker))


def test_the_cache_dir_is_per_numba_and_python_version_and_overridable():
    py = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    want = os.path.join("/x", "kvcanary", f"numba-{cache.numba_version()}-{py}")
    assert cache.directory({"XDG_CACHE_HOME": "/x"}) == want
    assert cache.directory({"XDG_CACHE_HOME": "/x", "KVCANARY_CACHE_DIR": "/y/z"}) == "/y/z"
    assert cache.directory({}).startswith(os.path.join(os.path.expanduser("~"), ".cache", "kvcanary", "numba-"))


def test_loops_are_cached_per_digest_of_their_sources_and_of_the_modules_whose_values_they_inline():
    # numba checks a cached loop only against its own file's time stamp: a descriptor offset changed
    # in kvcanary.fused._step, or a counter number in kvcanary.violations, must not load old code
    where = cache.loops_directory()
    assert where is not None and os.path.basename(where) == "loops-" + cache.sources_digest()[:16]
    assert os.path.dirname(where) == cache.usable_directory()
    from kvcanary.fused import ops

    assert ops._verify.stats.cache_path.startswith(where + os.sep)
    import kvcanary
    root = os.path.dirname(kvcanary.__file__)
    for module in ("step", "checks", "violations", "hashing"):
        assert f"{module}.py" in cache._INLINED and os.path.exists(os.path.join(root, f"{module}.py"))
    assert all(os.path.exists(os.path.join(root, name)) for name in cache._INLINED)


def test_warmup_discards_a_damaged_cache_file_and_compiles_that_loop_again(warmed, tmp_path):
    where = str(tmp_path / "loops")
    shutil.copytree(warmed[0], where)  # the loops-<digest> directory travels: numba keys by the sources
    env = {"KVCANARY_CACHE_DIR": where}
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(where) for f in fs)
    index = next(f for f in files if os.path.basename(f).startswith("scrub._scrub-") and f.endswith(".nbi"))
    data = next(f for f in files if os.path.basename(f).startswith("ops._verify-") and f.endswith(".nbc"))
    open(index, "wb").close()  # emptied: EOFError: Ran out of input
    with open(data, "r+b") as fh:
        fh.truncate(100)  # cut: UnpicklingError: pickle data was truncated
    done = _run(["warmup"], env)
    out = done.stdout.splitlines()
    assert out[0] == "discarded the damaged cache of 2 loop(s) (ops._verify, scrub._scrub) and compiled them again"
    assert out[1].startswith(f"cached in {where} (") and ": 2 loops compiled, " in out[1], out
    warned = [line for line in done.stderr.splitlines() if "is damaged" in line]
    assert len(warned) == 2 and all(line.startswith("kvcanary: the compiled-loop cache of ") for line in warned)
    assert any("EOFError: Ran out of input" in line for line in warned)
    assert any("UnpicklingError: pickle data was truncated" in line for line in warned)
    again = _run(["warmup"], env).stdout.splitlines()
    assert len(again) == 1 and again[0].startswith(f"already cached in {where}: "), again  # cached afresh


TINY = """
from kvcanary.fused.cache import njit


@njit(cache=True)
def add_one(x):
    return x + 1
"""


def _damage(path, how):
    if how == "empty":
        open(path, "wb").close()
    elif how == "cut":
        with open(path, "r+b") as fh:
            fh.truncate(max(1, os.path.getsize(path) // 2))
    else:  # bytes that are not numba's
        with open(path, "wb") as fh:
            fh.write(b"\x80\x05not a pickle at all" * 8)


@pytest.mark.parametrize("suffix", [".nbi", ".nbc"])
@pytest.mark.parametrize("how", ["empty", "cut", "garbage"])
def test_a_loop_whose_cache_file_is_damaged_is_compiled_again_and_cached_afresh(suffix, how, tmp_path, monkeypatch,
                                                                                  caplog):
    src = tmp_path / "src" / "tiny_loop.py"
    src.parent.mkdir()
    src.write_text(TINY)
    monkeypatch.setattr(cache, "_usable", [str(tmp_path / "cache")])  # this process's cache directory
    spec = importlib.util.spec_from_file_location("tiny_loop", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def fresh():  # a new dispatcher of the same loop: what the next process gets
        d = cache.njit(cache=True)(mod.add_one.py_func)
        assert d(41) == 42
        return sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()), d.stats.cache_path

    assert mod.add_one(1) == 2 and fresh()[:2] == (1, 0)  # compiled and cached, then loaded
    where = fresh()[2]
    target = next(os.path.join(where, f) for f in os.listdir(where) if f.endswith(suffix))
    _damage(target, how)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        hits, misses, _ = fresh()
    assert (hits, misses) == (0, 1)  # compiled again: the fast path stays
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    if how == "garbage" and suffix == ".nbi":
        assert len(said) <= 1  # numba may read such an index as another version's and start afresh itself
    else:
        assert len(said) == 1 and said[0].startswith(f"kvcanary: the compiled-loop cache of tiny_loop.add_one in "
                                                     f"{where} is damaged (")
    assert fresh()[:2] == (1, 0)  # and cached afresh
