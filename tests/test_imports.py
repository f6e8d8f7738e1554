"""The package's import graph, read from the source with ``ast`` (nothing is imported):
no module imports one that imports it back, and only the Optuna adapter touches Optuna's
private API.

**What an edge is.** Module A imports module B of the package when A holds an import
statement naming B, wherever the statement is: at the top, inside a function (a lazy import
only moves a cycle from import time to call time, and it breaks as soon as someone hoists
the import), or under ``if TYPE_CHECKING`` (a cycle of types still means neither module can
be read without the other). ``import p.b`` and ``from p.b import x`` name ``p.b``; so does
``from p import b`` when ``p.b`` is a module, since Python then imports the submodule rather
than reading a name of ``p``; relative imports are resolved first. A package is its
``__init__`` module.

**What is not an edge.** Importing ``p.b`` runs ``p/__init__.py`` first, and a package's
``__init__`` usually imports its submodules to re-export them. Counting that would make every
re-exporting package a cycle, though Python always resolves it: the package is in
``sys.modules`` before its ``__init__`` runs, and a submodule that names only submodules
never reads a name the ``__init__`` has not bound yet. A submodule that does read one
(``from evoengine import __version__``) names the package itself, which is an edge, so a
package that imports such a module back, even lazily inside a function, closes a cycle; that
is why the version lives in ``evoengine/_version.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from collections.abc import Iterator
from pathlib import Path

from evoengine import paths

PACKAGE = "evoengine"
ADAPTER = "evoengine.search.study"  # the one module allowed Optuna's private API


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` names in any import statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    out.add(f"{base}.{alias.name}")
                elif base in known:
                    out.add(base)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    found = modules(root, package)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle from the group's first module back to it, inside the group."""
    start = min(group)
    paths_ = [[start]]
    while paths_:
        path = paths_.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return [*path, start]
            if w not in path:
                paths_.append([*path, w])
    raise AssertionError("a strongly connected group always has a cycle")


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(paths.ROOT, PACKAGE)
    assert len(graph) > 20 and "evoengine.search.loop" in graph
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_finds_lazy_relative_and_type_only_cycles(tmp_path: Path) -> None:
    write_package(tmp_path, {
        "pkg/__init__.py": """
            from pkg import a            # a submodule: an edge to pkg.a, not to pkg

            def load():
                from pkg.lazy import f   # lazy, and lazy imports pkg back: a cycle
                return f
            """,
        "pkg/a.py": "from pkg import b\nfrom pkg.sub.c import g\n",
        "pkg/b.py": "X = 1\n",
        "pkg/lazy.py": "from pkg import VERSION\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": """
            from typing import TYPE_CHECKING
            from . import d
            if TYPE_CHECKING:
                from ..a import T        # relative, two levels up, type only
            """,
        "pkg/sub/d.py": "import pkg.b\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a", "pkg.lazy"}
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub.c"}  # no edge to pkg: b is a module
    assert graph["pkg.lazy"] == {"pkg"}
    assert graph["pkg.sub.c"] == {"pkg.sub.d", "pkg.a"}
    assert graph["pkg.sub.d"] == {"pkg.b"}
    assert sorted(map(tuple, cycles(graph))) == [("pkg", "pkg.lazy", "pkg"),
                                                 ("pkg.a", "pkg.sub.c", "pkg.a")]


# ---- Optuna's private API ---------------------------------------------------------------

def optuna_private_names() -> set[str]:
    """The ``_``-prefixed attribute and method names that Optuna's own objects carry, read
    from its source: every ``self._x`` / ``cls._x`` it uses and every ``_x`` method."""
    spec = importlib.util.find_spec("optuna")
    assert spec is not None and spec.origin is not None
    names = set()
    for path in Path(spec.origin).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls") and _private(node.attr)):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                names.add(node.name)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_optuna_uses(source: str, private: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each use of Optuna's private API in ``source``: an import of a
    ``_``-prefixed Optuna module or name, an ``optuna._x`` attribute, or ``obj._x`` for a
    name of ``private`` on anything but ``self`` and ``cls`` (which are our own objects)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "optuna" and any(
                        map(_private, alias.name.split("."))):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "optuna":
            names = [*node.module.split("."), *(a.name for a in node.names)]  # type: ignore[union-attr]
            if any(map(_private, names)):
                yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if base.split(".")[0] == "optuna":
                yield node.lineno, f"{base}.{node.attr}"
            elif base not in ("self", "cls") and node.attr in private:
                yield node.lineno, f"{base}.{node.attr}"


def test_only_the_adapter_touches_optunas_private_api() -> None:
    private = optuna_private_names()
    assert {"_storage", "_study_id", "_trial_id"} <= private
    found = {name: list(private_optuna_uses(path.read_text(), private))
             for name, path in modules(paths.ROOT, PACKAGE).items()}
    outside = {name: uses for name, uses in found.items() if uses and name != ADAPTER}
    assert not outside, f"Optuna's private API outside {ADAPTER}: {outside}"
    assert found[ADAPTER]  # the adapter is where they are (else this test checks nothing)


def test_the_private_api_scan_sees_each_kind_of_use() -> None:
    private = {"_storage", "_trial_id"}
    source = textwrap.dedent("""
        import optuna._imports
        from optuna.storages._cached_storage import _CachedStorage
        from optuna import _experimental
        s = study._storage
        t = self.study._storage.get_trial(trial._trial_id)
        u = optuna._warnings
        ok = self._storage, cls._trial_id, os._exit, store._candidate_id, optuna.Trial
    """)
    assert sorted(line for line, _ in private_optuna_uses(source, private)) == [2, 3, 4, 5, 6, 6, 7]
