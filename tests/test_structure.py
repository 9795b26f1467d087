"""The house stands as designed: imports run one way, bottom to top, with no circles; internal modules
import a name from the module that defines it; no module reads another's private attributes.

Every import counts: module-level, inside functions, and under ``TYPE_CHECKING``. Read from the
sources (nothing is imported), so a circle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

import kvcanary

ROOT = Path(kvcanary.__file__).parent

# the layers, bottom to top: a module may import its own layer's modules and those below, never above
LAYERS = [
    ("base", ["kvcanary.errors", "kvcanary.violations", "kvcanary.hashing"]),
    ("model", ["kvcanary.config", "kvcanary.step", "kvcanary.source", "kvcanary._reads", "kvcanary.layout",
               "kvcanary.geometry", "kvcanary.geometry.*", "kvcanary.layouts", "kvcanary.diagnosis",
               "kvcanary.eventlog", "kvcanary.metrics", "kvcanary.stamp_store", "kvcanary.harm",
               "kvcanary.monitoring"]),
    ("checks", ["kvcanary.checks", "kvcanary.audit", "kvcanary.audit.*", "kvcanary.kernels", "kvcanary.kernels.*",
                "kvcanary.fused", "kvcanary.fused.*", "kvcanary.ops"]),
    ("canary", ["kvcanary.canary", "kvcanary.canary_args", "kvcanary.canary_guard", "kvcanary.patrol", "kvcanary.guards", "kvcanary.step_check",
                "kvcanary.reporting", "kvcanary.writers"]),
    ("engines", ["kvcanary.engines", "kvcanary.engines.*", "kvcanary.sim", "kvcanary.sim.*", "kvcanary.real_model"]),
    ("faults", ["kvcanary.faults", "kvcanary.faults.*"]),
    ("cli", ["kvcanary.report", "kvcanary.report.*", "kvcanary.demo", "kvcanary.demo.*", "kvcanary.selftest", "kvcanary.cli", "kvcanary.__main__", "kvcanary"]),
]
# the engine-agnostic core never imports an engine adapter or a fault injector
CORE = ("kvcanary.fused", "kvcanary.kernels", "kvcanary.audit", "kvcanary.geometry", "kvcanary.canary")


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """Every import of a kvcanary module in module ``name``: (module imported, name taken from it or
    None, line)."""
    tree = ast.parse(MODULES[name].read_text())
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package(name).split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base == "kvcanary" or base.startswith("kvcanary."):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "kvcanary"]
    return out


GRAPH = {m: sorted({i for i, _, _ in _imports(m) if i != m and i in MODULES}) for m in MODULES}


def _layer(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    raise AssertionError(f"{name}: in no layer of LAYERS (add it where it belongs)")


def test_every_module_is_in_one_layer():
    for m in MODULES:
        _layer(m)


def circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (its strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    return out


def test_no_import_circles():
    assert not circles(GRAPH), f"import circles: {circles(GRAPH)}"


@pytest.mark.parametrize("loop", [["a", "b"], ["a", "b", "c"]])
def test_the_circle_check_finds_a_circle(loop):
    graph = {f"m.{x}": [f"m.{loop[(i + 1) % len(loop)]}"] for i, x in enumerate(loop)}
    graph["m.z"] = ["m.a"]
    assert circles(graph) == [sorted(graph)[:-1]]


def test_the_private_attribute_check_sees_a_function_level_import_and_an_attribute_read():
    """The checks read imports inside functions and under TYPE_CHECKING as well (what hid the
    circles before); spot-check on this tree's own modules."""
    assert "kvcanary.fused.audit" in GRAPH["kvcanary.engines.audit"]  # a function-level import
    assert "_views" in _private_attributes("kvcanary.geometry.strided")


def test_imports_run_from_a_lower_layer_up():
    bad = [f"{m} ({LAYERS[_layer(m)][0]}) imports {i} ({LAYERS[_layer(i)][0]})"
           for m, deps in GRAPH.items() for i in deps if _layer(i) > _layer(m)]
    assert not bad, "\n".join(bad)


def test_the_core_never_imports_an_engine_or_a_fault():
    bad = [f"{m} imports {i}" for m, deps in GRAPH.items() if m.startswith(CORE) for i in deps
           if i.startswith(("kvcanary.engines", "kvcanary.faults", "kvcanary.sim"))]
    assert not bad, "\n".join(bad)


def _defined(name: str) -> set[str]:
    """The names module ``name`` defines itself (not the ones it imports)."""
    tree = ast.parse(MODULES[name].read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def test_internal_modules_import_a_name_from_the_module_that_defines_it():
    bad = []
    for m in MODULES:
        if m == "kvcanary":
            continue  # the package's face hands the public names on
        for mod, name, line in _imports(m):
            if name is not None and mod in MODULES and name not in _defined(mod):
                bad.append(f"{MODULES[m].relative_to(ROOT.parent)}:{line}: {name} from {mod}, which does not define it")
    assert not bad, "\n".join(bad)


def _private_attributes(name: str) -> set[str]:
    """The private names module ``name`` owns: its top-level ones and the attributes its classes set."""
    tree = ast.parse(MODULES[name].read_text())
    out = {n for n in _defined(name) if n.startswith("_")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    out.add(item.attr)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_attributes():
    owned = {m: _private_attributes(m) for m in MODULES}
    anyone = set().union(*owned.values())
    bad = []
    for m in MODULES:
        tree = ast.parse(MODULES[m].read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            # an engine's own private (vLLM's, transformers') is the engine's business; kvcanary's are not
            if node.attr in anyone and node.attr not in owned[m]:
                bad.append(f"{MODULES[m].relative_to(ROOT.parent)}:{node.lineno}: .{node.attr}")
    assert not bad, "\n".join(bad)
