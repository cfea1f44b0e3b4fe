"""The layers stay layers: every import in mpipipe/, stannis/ and native/ points down, and none is a cycle.

The layers, lowest first (docs/internals.md):

- ``native``: the data store; imports neither mpipipe nor stannis.
- ``mpipipe.core``: what both systems share, what every rank imports (its sub-packages
  ``mpi``, ``state``, ``logs``, ``run``); imports native only.
- ``mpipipe.tools``: what no rank imports (the testbed emulator, the chaos campaign runner,
  the MPI launcher, the log plots); imports core (and native).
- ``mpipipe.pipeline``: the engine and plain training; imports core (and native), not the tools.
- ``mpipipe.respipe``: ResPipe; imports pipeline, core, tools (its chaos plugin) (and native).
- ``stannis``: beside the pipeline and ResPipe; imports ``mpipipe.core``, ``mpipipe.tools``
  (its chaos plugin and plots) and native only.
- the commands (``mpipipe/__init__.py``, ``__main__.py``, ``train_command.py``, ``report.py``,
  ``linkprobe_command.py``, the aliases ``testbed.py`` and ``linkprobe.py``): on top, import anything.

That respipe and stannis may import the tools does not let a rank import them:
:func:`test_no_rank_imports_the_tools` imports each trainer in a fresh interpreter and
looks at what it loaded.

The modules are read with ``ast``, never imported (importing would start MPI, and a
module that fails to import would hide its arrows). Every import counts: module level,
inside a function, under ``if TYPE_CHECKING:``, ``from . import x``, and
``importlib.import_module("literal")``: an upward arrow is an upward arrow however late it
runs. Importing ``mpipipe.core.x`` is an arrow to ``mpipipe.core.x`` only, not to the
package ``mpipipe`` it lives in (Python runs that package's ``__init__`` first, but the
importer names no name of it).

Cycles: the test fails on any cycle of imports that run: module-level ones and those
inside functions. Only imports under ``if TYPE_CHECKING:`` are left out of the cycle check
(they never run, and with ``from __future__ import annotations`` a type may name a module
that uses it). Why the function-local ones count: a local import is the usual way to hide a
cycle from the interpreter, not to remove it; ``mpipipe/train_command.py`` and
``mpipipe/resilience.py`` importing each other (issue 15) was such a pair, and the two
could not be understood, tested or moved one without the other. A deferred import that
only keeps a heavy dependency (torch, h5py, matplotlib, MPI) off the import path is
still fine: it points at a module that does not import back.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mpipipe", "stannis", "native")
COMMANDS = frozenset({"mpipipe", "mpipipe.__main__", "mpipipe.train_command", "mpipipe.api", "mpipipe.cost",
                      "mpipipe.report", "mpipipe.report_command", "mpipipe.plan_command", "mpipipe.linkprobe_command",
                      "mpipipe.testbed", "mpipipe.linkprobe"})
# What each layer may import (its own layer included); the commands import anything.
ALLOWED = {
    "native": ("native",),
    "mpipipe.core": ("mpipipe.core", "native"),
    "mpipipe.tools": ("mpipipe.tools", "mpipipe.core", "native"),
    "mpipipe.pipeline": ("mpipipe.pipeline", "mpipipe.core", "native"),
    "mpipipe.respipe": ("mpipipe.respipe", "mpipipe.pipeline", "mpipipe.tools", "mpipipe.core", "native"),
    "stannis": ("stannis", "mpipipe.tools", "mpipipe.core", "native"),
}
RULES = {
    "native": "native imports neither mpipipe nor stannis",
    **{layer: f"{layer} imports only {', '.join(may)}" for layer, may in ALLOWED.items() if layer != "native"},
    "commands": "commands may import anything",
}
# The modules a rank runs (a trainer, and the commands that start one): their imports, run in a
# fresh interpreter, hold no module of the tools.
RANK_MODULES = ("mpipipe.pipeline.train", "mpipipe.respipe.trainer", "mpipipe.respipe.command",
                "mpipipe.train_command", "mpipipe.api", "stannis.trainer", "stannis.api")


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int
    where: str  # "module" (runs on import), "function" (runs when called), "type_checking" (never runs)

    @property
    def runs(self) -> bool:
        return self.where != "type_checking"


def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name: the Python ones, and the compiled
    ones by their Cython source (``native/_shard.pyx``: imported as ``native._shard``, read
    for no arrows; it cimports C only)."""
    out = {}
    for package in PACKAGES:
        for path in sorted([*(ROOT / package).rglob("*.py"), *(ROOT / package).rglob("*.pyx")]):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def layer_of(module: str) -> str:
    """The layer of a module of ours.

    Raises:
        AssertionError: a top-level mpipipe module that is in no layer: place it (in a
            subpackage, or in COMMANDS if it is a command).
    """
    if module in COMMANDS:
        return "commands"
    for prefix in ("native", "stannis", "mpipipe.core", "mpipipe.tools", "mpipipe.pipeline", "mpipipe.respipe"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    raise AssertionError(f"{module} is in no layer: move it into mpipipe/core, mpipipe/tools, "
                         f"mpipipe/pipeline or mpipipe/respipe, or add it to COMMANDS in tests/test_layers.py "
                         f"if it is a command")


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return a == "commands" or b in ALLOWED[a]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest module of ours that ``name`` names
    (``mpipipe.core.mpi.roles.Role`` -> ``mpipipe.core.mpi.roles``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def arrows(module: str, path: Path, known: dict[str, Path]) -> list[Arrow]:
    """The imports of one module that point at a module of ours."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[Arrow] = []

    def add(name: str, line: int, where: str) -> None:
        target = _resolve(name, known)
        if target is not None and target != module:
            out.append(Arrow(module, target, line, where))

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, where)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import mod` names the module pkg.mod
                if f"{source}.{alias.name}" in known:
                    add(f"{source}.{alias.name}", node.lineno, where)
                else:
                    add(source, node.lineno, where)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                add(node.args[0].value, node.lineno, "function" if where == "module" else where)
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                visit(child, "type_checking")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and where == "module":
                visit(child, "function")
            else:
                visit(child, where)

    visit(tree, "module")
    return out


def all_arrows() -> list[Arrow]:
    known = modules()
    return [a for module, path in known.items() if path.suffix == ".py" for a in arrows(module, path, known)]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_through(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def _path_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One cycle inside a strongly connected component, from its first module back to it."""
    members = set(component)
    start = component[0]
    # breadth-first from start's successors back to start
    paths = {w: [start, w] for w in sorted(edges[start] & members)}
    queue = list(paths)
    while queue:
        v = queue.pop(0)
        if v == start:
            return paths[v]
        for w in sorted(edges.get(v, set()) & members):
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer_of(module)  # raises, naming the module, when it is in none


def test_no_import_points_up() -> None:
    wrong = [a for a in all_arrows() if not allowed(a.importer, a.imported)]
    if wrong:
        pytest.fail(f"{len(wrong)} import(s) point up or sideways:\n" + "\n".join(
            f"  {a.importer} (line {a.line}{'' if a.where == 'module' else ', ' + a.where}) imports "
            f"{a.imported} [{layer_of(a.imported)}]: {RULES[layer_of(a.importer)]}" for a in wrong))


def test_no_import_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for a in all_arrows():
        if a.runs:
            edges.setdefault(a.importer, set()).add(a.imported)
    cycles = _cycles(edges)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) (a module that, through others, imports itself):\n" + "\n".join(
            "  " + " -> ".join(c) for c in cycles))


def test_the_walker_sees_every_form_of_import(tmp_path: Path) -> None:
    """Relative, function-local, TYPE_CHECKING and import_module arrows are all found."""
    pkg = tmp_path / "mpipipe" / "core"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "b.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from .b import thing\n"
        "if TYPE_CHECKING:\n    import mpipipe.respipe.trainer\n"
        "def f():\n    from mpipipe.pipeline import engine\n"
        "    import importlib\n    importlib.import_module('stannis.plots')\n")
    known = {"mpipipe.core": pkg / "__init__.py", "mpipipe.core.a": pkg / "a.py", "mpipipe.core.b": pkg / "b.py",
             "mpipipe.pipeline.engine": pkg / "b.py", "mpipipe.respipe.trainer": pkg / "b.py",
             "stannis.plots": pkg / "b.py"}
    got = [(a.imported, a.line, a.where) for a in arrows("mpipipe.core.a", pkg / "a.py", known)]
    assert got == [("mpipipe.core.b", 2, "module"), ("mpipipe.core.b", 3, "module"),
                   ("mpipipe.respipe.trainer", 5, "type_checking"), ("mpipipe.pipeline.engine", 7, "function"),
                   ("stannis.plots", 9, "function")]
    assert not allowed("mpipipe.core.a", "mpipipe.pipeline.engine")
    assert not allowed("stannis.trainer", "mpipipe") and allowed("stannis.trainer", "mpipipe.core.run.cli")
    assert allowed("mpipipe.report", "stannis.plots") and not allowed("mpipipe.respipe.trainer", "stannis.plots")
    assert not allowed("mpipipe.core.mpi.faults", "mpipipe.tools.emulator")
    assert not allowed("mpipipe.pipeline.train", "mpipipe.tools.launch")
    assert allowed("stannis.chaos", "mpipipe.tools.campaign") and not allowed("mpipipe.tools.campaign", "stannis.chaos")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("module", RANK_MODULES)
def test_no_rank_imports_the_tools(module: str) -> None:
    """A rank's modules, imported in a fresh interpreter (this tree first on its path), load no
    module of :mod:`mpipipe.tools`: the emulator, the campaign runner, the launcher and the plots
    run around ranks, never inside one."""
    probe = ("import importlib, json, sys\n"
             f"importlib.import_module({module!r})\n"
             "print(json.dumps(sorted(m for m in sys.modules if m == 'mpipipe.tools' "
             "or m.startswith('mpipipe.tools.'))))\n"
             f"print(sys.modules[{module!r}].__file__)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tools, where = done.stdout.splitlines()[-2:]
    assert Path(where).resolve().is_relative_to(ROOT), f"{module} came from {where}, not from {ROOT}"
    assert json.loads(tools) == [], f"importing {module} loads the tools {json.loads(tools)}"
