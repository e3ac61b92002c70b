"""The layers import only downwards (docs/architecture.md): control/ is pure (no torch, no I/O, nothing of
prism_serve but itself and the errors), sim/ drives control/ without the live runtime, workload/
reads traces without the simulator, and the deployment config (config.py) is user input that knows
nothing of the runtime (runtime/build.py turns it into runtime types). And no module or package of
src/ imports itself back through others: no import cycles.

Two checks per module: importing it in a fresh interpreter must not load a forbidden module (what
it really pulls in, transitively), and no import statement in its source may name one, even inside
a function or under ``if TYPE_CHECKING`` (a lazy import that a first check would miss). The cycle
check reads the same import statements, so a cycle hidden under ``TYPE_CHECKING`` counts."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import prism_serve

SRC = Path(prism_serve.__file__).parent

_PACKAGES = ("api", "bench", "cli", "config", "engine", "memory", "ops_cli", "runtime", "sim", "workload")

# package (or module) -> module prefixes it must not import
RULES: dict[str, tuple[str, ...]] = {
    "prism_serve.control": ("torch", "numpy", *(f"prism_serve.{p}" for p in _PACKAGES)),
    "prism_serve.sim": ("prism_serve.runtime", "prism_serve.api"),
    "prism_serve.workload": ("prism_serve.sim", "prism_serve.runtime", "prism_serve.api"),
    "prism_serve.config": ("prism_serve.runtime", "prism_serve.api"),
}

# Checked in the source only (every interpreter has loaded them before any import of ours): the
# standard library's clocks, threads, processes, sockets and randomness, which control/ never uses
# (time and randomness come in as arguments, so the simulator and the runtime decide the same).
STATIC_RULES: dict[str, tuple[str, ...]] = {
    "prism_serve.control": ("time", "os", "threading", "asyncio", "socket", "subprocess", "random"),
}

# Known violations, each to be fixed where it lives (strict: the test fails once it is gone, so
# this entry is removed with it).
KNOWN: dict[tuple[str, str], str] = {}


def modules_of(name: str, root: Path = SRC.parent) -> list[str]:
    """``name`` and, for a package, every module under it."""
    path = root.joinpath(*name.split("."))
    if not path.is_dir():
        return [name]
    found = []
    for f in path.rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(found)


def source_of(module: str, root: Path = SRC.parent) -> Path:
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def forbidden(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def imported_names(module: str, root: Path = SRC.parent) -> list[tuple[int, str]]:
    """(line, module name) of every import in ``module``'s source, wherever it stands; relative
    imports resolved, and ``importlib.import_module`` / ``__import__`` with a literal name too."""
    path = source_of(module, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names)  # from pkg import submodule
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def static_violations(module: str, prefixes: Iterable[str], root: Path = SRC.parent) -> list[str]:
    names = imported_names(module, root)
    return [f"line {line}: {name}" for line, name in names if forbidden(name, prefixes)]


_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(module: str, path: Path = SRC.parent) -> list[str]:
    """Every module a fresh interpreter holds after importing ``module``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, module], capture_output=True, text=True, env=env, timeout=120
    )
    if res.returncode != 0:
        raise AssertionError(f"importing {module} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout)


def dynamic_violations(module: str, prefixes: Iterable[str], path: Path = SRC.parent) -> list[str]:
    return [m for m in loaded_modules(module, path) if forbidden(m, prefixes)]


CASES = [(m, rule) for rule in RULES for m in modules_of(rule)]


def _mark(module: str, check: str):
    reason = KNOWN.get((module, check))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """Every module's fresh-interpreter import, run in parallel (each takes about a second)."""
    names = sorted({m for m, _ in CASES})
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(loaded_modules, names), strict=True))


@pytest.mark.parametrize(
    ("module", "rule"), [pytest.param(m, r, id=m, marks=_mark(m, "import")) for m, r in CASES]
)
def test_importing_loads_no_forbidden_module(module, rule, loaded):
    bad = [m for m in loaded[module] if forbidden(m, RULES[rule])]
    assert not bad, f"importing {module} loads {bad[:10]} (forbidden in {rule})"


@pytest.mark.parametrize(
    ("module", "rule"), [pytest.param(m, r, id=m, marks=_mark(m, "static")) for m, r in CASES]
)
def test_no_import_statement_names_a_forbidden_module(module, rule):
    bad = static_violations(module, RULES[rule] + STATIC_RULES.get(rule, ()))
    assert not bad, f"{source_of(module)} imports what {rule} must not: {bad}"


def import_graph(package: str, root: Path = SRC.parent) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` its import statements name (wherever they stand, under
    ``TYPE_CHECKING`` too); a name resolves to the longest module of the package it starts with."""
    modules = set(modules_of(package, root))

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {
        m: {t for _, name in imported_names(m, root) if (t := resolve(name)) is not None and t != m}
        for m in modules
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]], depth: int = 2) -> dict[str, set[str]]:
    """The module graph with modules grouped by their first ``depth`` name parts (prism_serve.sim,
    prism_serve.config, ...), edges inside a group dropped."""

    def group(m: str) -> str:
        return ".".join(m.split(".")[:depth])

    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(group(m), set()).update(group(t) for t in targets if group(t) != group(m))
    return out


def test_no_import_cycles_between_modules():
    found = cycles(import_graph("prism_serve"))
    assert not found, f"modules that import each other (directly or through others): {found}"


def test_no_import_cycles_between_packages():
    found = cycles(package_graph(import_graph("prism_serve")))
    assert not found, f"packages that import each other (directly or through others): {found}"


def test_the_cycle_check_catches_a_cycle(tmp_path):
    """A throwaway package: a loop of three modules closed by an import under ``TYPE_CHECKING``,
    and two subpackages that import each other through different modules."""
    pkg = tmp_path / "looped"
    for sub in ("", "a", "b"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "one.py").write_text("from looped import two\n")
    (pkg / "two.py").write_text("from .three import x\n")
    (pkg / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from looped.one import y\n"
    )
    (pkg / "a" / "left.py").write_text("from looped.b import right\n")
    (pkg / "b" / "right.py").write_text("import json\n")
    (pkg / "b" / "back.py").write_text("from looped.a.left import z\n")
    (pkg / "a" / "free.py").write_text("import looped.b.back\n")
    graph = import_graph("looped", tmp_path)
    assert cycles(graph) == [["looped.one", "looped.three", "looped.two"]]
    grouped = package_graph(graph)
    assert grouped["looped.a"] == {"looped.b"} and grouped["looped.b"] == {"looped.a"}
    assert sorted(cycles(grouped)) == [["looped.a", "looped.b"], ["looped.one", "looped.three", "looped.two"]]
    (pkg / "three.py").write_text("import json\n")
    assert cycles(import_graph("looped", tmp_path)) == []


def test_the_checks_catch_a_violation(tmp_path):
    """Both checks on a throwaway package: a top-level import of a forbidden module (seen by both)
    and a lazy one inside a function (seen only by the source scan)."""
    pkg = tmp_path / "layered"
    (pkg / "inner").mkdir(parents=True)
    (tmp_path / "banned").mkdir()
    (tmp_path / "banned" / "__init__.py").write_text("")
    (tmp_path / "banned" / "deep.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "clean.py").write_text("import json\n")
    (pkg / "eager.py").write_text("from banned import deep\n")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "inner" / "lazy.py").write_text(
        textwrap.dedent(
            """
            def later():
                from ..clean import json
                from banned.deep import thing
                return thing
            """
        )
    )
    (pkg / "indirect.py").write_text("from .eager import deep\n")
    assert modules_of("layered", tmp_path) == [
        "layered", "layered.clean", "layered.eager", "layered.indirect", "layered.inner",
        "layered.inner.lazy",
    ]  # fmt: skip
    rule = ("banned",)
    assert static_violations("layered.clean", rule, tmp_path) == []
    assert static_violations("layered.eager", rule, tmp_path) == ["line 1: banned", "line 1: banned.deep"]
    assert static_violations("layered.inner.lazy", rule, tmp_path) == [
        "line 4: banned.deep", "line 4: banned.deep.thing",
    ]  # fmt: skip
    assert (3, "layered.clean") in imported_names("layered.inner.lazy", tmp_path)  # relative, resolved
    assert dynamic_violations("layered.clean", rule, tmp_path) == []
    assert dynamic_violations("layered.inner.lazy", rule, tmp_path) == []  # only the scan sees a lazy one
    assert dynamic_violations("layered.indirect", rule, tmp_path) == ["banned", "banned.deep"]  # transitive


# The HTTP layer sees the runtime through its one face (runtime/serving.py); what wires the server
# (server.py builds the controller) and the operator's views (admin routes, dashboard, /metrics'
# memory and activations) take the controller itself, by its public methods.
_API_SEES_THE_CONTROLLER = {"server", "admin", "dashboard", "metrics"}


@pytest.mark.parametrize("module", modules_of("prism_serve.api"))
def test_the_http_layer_sees_the_runtime_through_its_face(module):
    allowed = ["prism_serve.runtime.serving"]
    if module.rpartition(".")[2] in _API_SEES_THE_CONTROLLER:
        allowed += ["prism_serve.runtime.controller", "prism_serve.runtime.build"]
    bad = [
        f"line {line}: {name}"
        for line, name in imported_names(module)
        if forbidden(name, ["prism_serve.runtime"])
        and not forbidden(name, allowed)
        and name != "prism_serve.runtime"
    ]
    assert not bad, f"{source_of(module)} reaches into the runtime past runtime/serving.py: {bad}"
