"""Where the fused CPU loops are compiled to: a directory of kvcanary's own.

numba compiles each loop on its first call and, with ``cache=True``, keeps the machine code on
disk; by default beside the source, in the package's ``__pycache__``: read-only in many installs,
and shared by every environment that imports one checkout (whose numba versions then overwrite
each other's files). kvcanary's loops go to :func:`directory`: ``$KVCANARY_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvcanary/numba-<numba version>-py<major.minor>`` (``~/.cache`` without
``XDG_CACHE_HOME``).

numba picks a function's cache directory when its ``@njit(cache=True)`` decorator runs, from
``numba.config.CACHE_DIR``. :func:`njit` sets that value only while it decorates one of kvcanary's
loops and restores it at once, so other libraries' numba code (vLLM's) keeps numba's own setting.
Where the directory cannot be created or written, numba's default takes over, with one warning.

A cache file that cannot be read back (emptied, cut short or overwritten by a crash, a full disk or
a copy) costs one loop a compile, never the fast path: numba's loader raises on such a file
(``EOFError: Ran out of input``, ``UnpicklingError: pickle data was truncated``) where it would
otherwise compile, so each loop's cache is wrapped (:func:`njit`): a load that fails discards that
loop's files, says so in one warning line, and numba compiles the loop again and caches it afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ENV_VAR = "KVCANARY_CACHE_DIR"
MARKER = "kvcanary-warm"  # in the directory: what the last complete warm-up compiled from
log = logging.getLogger("kvcanary")
_lock = threading.Lock()
_PRUNE_AFTER_S = 7 * 24 * 3600
_usable: list[str | None] = []  # memo of usable_directory(): one check and one warning per process
_discarded: list[str] = []  # loops whose damaged cache files were discarded in this process (discarded())
_checked: list[type] = []  # the cache class of kvcanary's loops, made on first use (numba imported then)


def numba_version() -> str:
    """The installed numba's version, read without importing numba ("" where it is missing)."""
    from importlib import metadata

    try:
        return metadata.version("numba")
    except metadata.PackageNotFoundError:
        return ""


def default_directory(environ: Any = None) -> str:
    """``$XDG_CACHE_HOME/kvcanary/numba-<numba version>-py<major.minor>`` (``~/.cache`` without
    ``XDG_CACHE_HOME``): one directory per numba and Python version, so environments sharing one
    checkout never overwrite each other's compiled loops."""
    env = os.environ if environ is None else environ
    root = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return os.path.join(root, "kvcanary", f"numba-{numba_version()}-py{py}")


def directory(environ: Any = None) -> str:
    """Where kvcanary's compiled loops are cached: ``$KVCANARY_CACHE_DIR`` when set, else
    :func:`default_directory`."""
    env = os.environ if environ is None else environ
    return os.path.abspath(os.path.expanduser(env.get(ENV_VAR) or default_directory(env)))


def usable_directory() -> str | None:
    """:func:`directory`, created and checked writable once per process; ``None`` (numba's default
    then) with one warning where it cannot be."""
    if not _usable:
        path = directory()
        try:
            os.makedirs(path, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
            _usable.append(path)
        except OSError as e:
            log.warning("kvcanary: cannot write the compiled-loop cache %s (%s); numba's default cache is used "
                        "(set %s to a writable directory)", path, e, ENV_VAR)
            _usable.append(None)
    return _usable[0]


@contextlib.contextmanager
def _numba_cache_dir(path: str | None) -> Iterator[None]:
    """``numba.config.CACHE_DIR`` set to ``path`` inside the block, restored after it."""
    if path is None:
        yield
        return
    from numba.core import config

    with _lock:
        before = config.CACHE_DIR
        config.CACHE_DIR = path
        try:
            yield
        finally:
            config.CACHE_DIR = before


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(**options)`` (a decorator giving a numba dispatcher); with ``cache=True`` the
    compiled code is cached in :func:`usable_directory`, numba's setting for every other library is
    left as it was, and a damaged cache file is discarded and the loop compiled again
    (:func:`checked_cache`)."""
    import numba

    def deco(fn: Callable[..., Any]) -> Any:
        with _numba_cache_dir(loops_directory() if options.get("cache") else None):
            disp = numba.njit(**options)(fn)
            if options.get("cache"):  # the cache's directory is fixed here, while CACHE_DIR is ours
                disp._cache = checked_cache()(disp.py_func)
            return disp

    return deco


def discarded() -> list[str]:
    """The loops (``module.function``) whose damaged cache files were discarded in this process."""
    return list(_discarded)


def checked_cache() -> type:
    """numba's per-function disk cache (``FunctionCache``), with loading made safe: where a loop's
    index (``.nbi``) or compiled code (``.nbc``) cannot be read back (cut short, emptied, not
    numba's), that loop's files are removed, one warning line says which loop and why, and the load
    reports a miss, so numba compiles the loop and caches it again. A save that fails on a damaged
    index is tried once more after discarding it; one that fails again leaves the loop compiled in
    memory only, with a warning."""
    if _checked:
        return _checked[0]
    from numba.core.caching import FunctionCache

    class CheckedCache(FunctionCache):  # type: ignore[misc]
        def load_overload(self, sig: Any, target_context: Any) -> Any:
            try:
                return super().load_overload(sig, target_context)
            except Exception as e:  # a file that does not read back: compile instead
                self.discard(e)
                return None

        def save_overload(self, sig: Any, data: Any) -> None:
            try:
                super().save_overload(sig, data)
                return
            except Exception as e:  # the index it adds to may itself be damaged
                self.discard(e)
            try:
                super().save_overload(sig, data)
            except Exception as e:
                log.warning("kvcanary: the compiled loop %s could not be cached in %s (%s: %s); it is compiled "
                            "again in the next process", self.loop_name(), self.cache_path, type(e).__name__, e)

        def loop_name(self) -> str:
            return self._impl.filename_base.split("-", 1)[0]

        def discard(self, e: BaseException) -> None:
            """Remove this loop's index and data files (every signature's), and say so once."""
            base = self._impl.filename_base
            removed = 0
            with contextlib.suppress(OSError):
                for name in os.listdir(self.cache_path):
                    if name == base + ".nbi" or (name.startswith(base + ".") and name.endswith(".nbc")):
                        with contextlib.suppress(OSError):
                            os.remove(os.path.join(self.cache_path, name))
                            removed += 1
            _discarded.append(self.loop_name())
            log.warning("kvcanary: the compiled-loop cache of %s in %s is damaged (%s: %s); discarded its %d "
                        "file(s), compiling it again", self.loop_name(), self.cache_path, type(e).__name__,
                        e, removed)

    _checked.append(CheckedCache)
    return CheckedCache


# modules outside the fused package whose values the loops inline as constants (the hashing
# constants, sentinel positions, counter and check numbers, slot limits) or that hold loops
_INLINED = ("hashing.py", "step.py", "checks.py", "violations.py", "audit/reference.py", "audit/tables.py")
_digest: list[str] = []


def sources_digest() -> str:
    """A digest of what the compiled loops are made from: the fused package's sources, the modules
    whose values they inline (:data:`_INLINED`), numba's and Python's versions, and where the
    sources are (numba keys its cache files by the sources' directory too). Once per process."""
    if not _digest:
        here = Path(__file__).parent
        h = hashlib.sha256(f"{numba_version()} {sys.version} {here.resolve()}".encode())
        for p in sorted(here.glob("*.py")) + [here.parent / name for name in _INLINED]:
            h.update(p.name.encode() + p.read_bytes())
        _digest.append(h.hexdigest())
    return _digest[0]


def loops_directory() -> str | None:
    """Where numba caches the loops: a subdirectory of :func:`usable_directory` named by
    :func:`sources_digest` (``None`` where that is not writable). numba checks a cached loop only
    against its own source file's time stamp, so a changed constant in a module the loop imports
    (a descriptor's field offset) would load stale machine code; a new digest starts afresh."""
    base = usable_directory()
    return None if base is None else os.path.join(base, "loops-" + sources_digest()[:16])


def is_warm() -> bool:
    """Whether the last complete warm-up in :func:`directory` compiled these very sources (a
    forecast: numba itself decides, per loop, whether its cached code is current)."""
    try:
        return (Path(directory()) / MARKER).read_text().strip() == sources_digest()
    except OSError:
        return False


def mark_warm() -> None:
    """Record that every loop is compiled into :func:`directory` from the current sources."""
    path = usable_directory()
    if path is not None:
        with contextlib.suppress(OSError):
            (Path(path) / MARKER).write_text(sources_digest() + "\n")
        # loops compiled from other sources and unchanged for a week (another checkout may still
        # be using a recent one: it would only compile again)
        current, stale = loops_directory(), time.time() - _PRUNE_AFTER_S
        for old in Path(path).glob("loops-*"):
            with contextlib.suppress(OSError):
                if str(old) != current and old.stat().st_mtime < stale:
                    shutil.rmtree(old, ignore_errors=True)
