"""No import cycles between the modules of `dsv4_engine` or of `dsv4_operator`.

The modules are parsed with `ast`, never imported (the operator's tests must not pull in torch).
Edges are every intra-package import, at module level or inside a function: a function-local
import still makes one module depend on the other, and it is usually there to dodge a cycle.
Imports under `if TYPE_CHECKING:` are annotations only and do not count.

Packages: `from pkg import X` is an edge to `pkg.X` when that is a module, else to the module that
`pkg/__init__.py` re-exports X from (following chains of re-exports), else to `pkg` itself. A
submodule gets no implicit edge to its parent package, so `__init__` re-exporting its submodules
is not a cycle by itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "engine" / "dsv4_engine", ROOT / "operator" / "dsv4_operator"]


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    path: Path
    lineno: int
    line: str


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module


def discover(pkg_dir: Path) -> dict[str, Module]:
    """Every module under `pkg_dir` by dotted name (a package's `__init__.py` is the package)."""
    modules: dict[str, Module] = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = [pkg_dir.name, *path.relative_to(pkg_dir).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        modules[name] = Module(name, path, is_package, ast.parse(path.read_text(), str(path)))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, top_level_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under `node`, skipping `if TYPE_CHECKING:` bodies (their `else:` runs);
    `top_level_only` also skips function and class bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), top_level_only)
        elif top_level_only and isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        ):
            continue
        else:
            yield from _imports(child, top_level_only)


def _base(mod: Module, node: ast.ImportFrom) -> str | None:
    """The absolute module name `from <...> import` names, or None for a relative import that
    climbs out of the package."""
    if node.level == 0:
        return node.module
    pkg = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    if node.level - 1 > len(pkg) - 1:
        return None
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Graph:
    def __init__(self, modules: dict[str, Module]) -> None:
        self.modules = modules
        self._reexports: dict[str, dict[str, tuple[str, str]]] = {}

    def _exports_of(self, pkg: str) -> dict[str, tuple[str, str]]:
        """name -> (module it is imported from, its name there), for a package `__init__`'s
        module-level intra-package `from ... import` statements."""
        if pkg not in self._reexports:
            found: dict[str, tuple[str, str]] = {}
            mod = self.modules[pkg]
            for node in _imports(mod.tree, top_level_only=True):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = _base(mod, node)
                if base is None or base not in self.modules:
                    continue
                for alias in node.names:
                    if alias.name != "*":
                        found[alias.asname or alias.name] = (base, alias.name)
            self._reexports[pkg] = found
        return self._reexports[pkg]

    def resolve_name(self, base: str, name: str) -> str:
        """The module `from <base> import <name>` depends on."""
        seen: set[tuple[str, str]] = set()
        while (base, name) not in seen:
            seen.add((base, name))
            if f"{base}.{name}" in self.modules:
                return f"{base}.{name}"
            if not self.modules[base].is_package or name not in self._exports_of(base):
                return base
            base, name = self._exports_of(base)[name]
        return base

    def _longest_module(self, dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.modules:
                return ".".join(parts[:n])
        return None

    def edges(self) -> list[Edge]:
        out: list[Edge] = []
        for mod in self.modules.values():
            lines = mod.path.read_text().splitlines()
            for node in _imports(mod.tree):
                targets: set[str] = set()
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if (t := self._longest_module(alias.name)) is not None:
                            targets.add(t)
                else:
                    base = _base(mod, node)
                    if base is None or base not in self.modules:
                        continue
                    for alias in node.names:
                        targets.add(base if alias.name == "*" else self.resolve_name(base, alias.name))
                line = " ".join(s.strip() for s in lines[node.lineno - 1 : node.end_lineno])
                out.extend(
                    Edge(mod.name, t, mod.path, node.lineno, line) for t in sorted(targets) if t != mod.name
                )
        return out


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the strongly connected components of the graph."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(succ[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc: list[str] = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        scc.append(x)
                        if x == v:
                            break
                    sccs.append(sorted(scc))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(succ[w])))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return sccs


def find_cycles(pkg_dir: Path) -> list[tuple[list[str], list[Edge]]]:
    """Each import cycle in the package: its modules and the import statements among them."""
    modules = discover(pkg_dir)
    edges = Graph(modules).edges()
    cycles = []
    for scc in strongly_connected(sorted(modules), edges):
        if len(scc) > 1:
            members = set(scc)
            cycles.append((scc, [e for e in edges if e.src in members and e.dst in members]))
    return cycles


def describe(cycles: list[tuple[list[str], list[Edge]]]) -> str:
    out = []
    for scc, edges in cycles:
        out.append("cycle: " + ", ".join(scc))
        for e in edges:
            rel = e.path.relative_to(ROOT) if e.path.is_relative_to(ROOT) else e.path
            out.append(f"  {e.src} -> {e.dst}   {rel}:{e.lineno}: {e.line}")
    return "\n".join(out)


@pytest.mark.parametrize("pkg_dir", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycles(pkg_dir: Path) -> None:
    cycles = find_cycles(pkg_dir)
    if cycles:
        pytest.fail(f"import cycles in {pkg_dir.name}:\n{describe(cycles)}", pytrace=False)


def test_finder_sees_cycles(tmp_path: Path) -> None:
    """The finder catches a cycle through a function-local import, and ignores `TYPE_CHECKING`
    imports and a package `__init__` re-exporting its submodules."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\nfrom .sub import S\n",
        "a.py": "from pkg.b import B\nA = 1\n",
        "b.py": "B = 2\n\ndef f() -> None:\n    from . import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\nC = 3\n",
        "d.py": "from pkg import C\nD = 4\n",
        "sub/__init__.py": "from .s import S\n",
        "sub/s.py": "from pkg import A\nS = 5\n",
        "sub/t.py": "from ..sub import S\nfrom pkg.c import C\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    cycles = find_cycles(pkg)
    assert [scc for scc, _ in cycles] == [["pkg.a", "pkg.b"]], describe(cycles)
    lines = {(e.src, e.dst, e.lineno) for e in cycles[0][1]}
    assert lines == {("pkg.a", "pkg.b", 1), ("pkg.b", "pkg.a", 4)}
    # `from pkg import C` (C not re-exported by pkg/__init__) is an edge to the package itself.
    edges = {(e.src, e.dst) for e in Graph(discover(pkg)).edges()}
    assert ("pkg.d", "pkg") in edges and ("pkg.sub.s", "pkg.a") in edges
    assert ("pkg.sub.t", "pkg.sub.s") in edges and ("pkg.c", "pkg.d") not in edges


# The engine's layers, lowest first (docs/engine.md, "Layers"): a module imports only from its own
# layer or below, so data flows one way (server → engine → scheduler / model runner → model → kernels).
# A module is placed by its longest listed prefix; one listed nowhere is in the top layer (""), so a
# lower layer importing it fails until it is placed.
ENGINE_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("config", "device", "options", "rope", "quant", "ckpt_names", "ckpt_plan",
              "sampling_params", "tokenizer", "parallel.groups")),
    ("compute", ("kernels", "attention", "model", "memory", "parallel", "loader")),
    ("step", ("sampler", "grammar", "sequence", "scheduler", "graph_runner", "speculative", "model_runner")),
    ("engine", ("engine_config", "engine", "ranks", "llm")),
    ("disagg", ("disagg",)),
    ("serving", ("server", "cli", "make_tiny", "demo", "demo_train", "testing", "")),
]  # fmt: skip


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int:
    """The index of `module`'s layer (`pkg.a.b`: the longest listed prefix of `a.b`)."""
    rel = module.partition(".")[2]
    placed = [
        (len(p), i)
        for i, (_, prefixes) in enumerate(layers)
        for p in prefixes
        if p == "" or rel == p or rel.startswith(p + ".")
    ]
    return max(placed)[1]


def upward_edges(pkg_dir: Path, layers: list[tuple[str, tuple[str, ...]]]) -> list[Edge]:
    return [e for e in Graph(discover(pkg_dir)).edges() if layer_of(e.dst, layers) > layer_of(e.src, layers)]


def test_engine_layers_import_one_way() -> None:
    up = upward_edges(PACKAGES[0], ENGINE_LAYERS)
    names = [n for n, _ in ENGINE_LAYERS]
    lines = [
        f"  {e.src} ({names[layer_of(e.src, ENGINE_LAYERS)]}) -> {e.dst} "
        f"({names[layer_of(e.dst, ENGINE_LAYERS)]})   {e.path.relative_to(ROOT)}:{e.lineno}: {e.line}"
        for e in up
    ]
    assert not up, "a lower layer imports a higher one:\n" + "\n".join(lines)


def test_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "low.py": "def f() -> None:\n    from pkg.high import H\n",
        "high.py": "H = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    layers = [("low", ("low",)), ("high", ("high", ""))]
    assert [(e.src, e.dst) for e in upward_edges(pkg, layers)] == [("pkg.low", "pkg.high")]
    assert not upward_edges(pkg, list(reversed(layers)))
