"""No import circles in ckptxform/ or benchmarks/, lazy imports included.

A lazy import (inside a function) is still a dependency: a dispatcher and a backend that
import each other, one of them lazily, are one module split in two. The graph is read
with ``ast`` from every module's source, every ``import`` statement counted wherever it
sits (function bodies and ``TYPE_CHECKING`` blocks included). The benchmarks import each
other by bare module name (``from bench import measure``, with their folder on
``sys.path``): such a name is resolved to the sibling module of that name. A child
importing its own package (``__init__``) is not an edge: Python runs the parent first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``*.py`` under ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path, is_package: bool, flat: bool) -> set[str]:
    """Every dotted name an import statement of ``path`` may load; ``flat``: the folder is on
    sys.path, so a bare top-level name may be a sibling (``bench`` -> ``benchmarks.bench``)."""
    names = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    if flat:
        names |= {f"{package[0]}.{name}" for name in names}
    return names


def import_graph(root: Path, packages: dict[str, bool]) -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (the longest known prefix of each name)."""
    files = {}
    for package in packages:
        files.update(module_files(root, package))
    graph = {}
    for module, path in files.items():
        flat = packages[module.split(".")[0]]
        edges = set()
        for name in imported_names(module, path, path.name == "__init__.py", flat):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


#: the trees checked, and whether their folder is on sys.path (bare sibling names)
TREES = {"ckptxform": False, "benchmarks": True}


def test_no_import_circles_in_the_package_or_the_benchmarks() -> None:
    found = cycles(import_graph(REPO, TREES))
    assert not found, "import circles (lazy imports included); make the arrows go one way:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize(("files", "want"), [
    # a dispatcher importing its backend at the top, the backend importing it back lazily
    ({"pkg/__init__.py": "", "pkg/q/__init__.py": "", "pkg/q/kernels.py": "from . import numpy_kernels\n",
      "pkg/q/numpy_kernels.py": "def f():\n    from .kernels import backend\n"},
     [["pkg.q.kernels", "pkg.q.numpy_kernels"]]),
    # through a parent package and a TYPE_CHECKING block, three modules round
    ({"pkg/__init__.py": "", "pkg/a.py": "from .b import x\n", "pkg/b.py": "from pkg.sub import c\n",
      "pkg/sub/__init__.py": "", "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                  "    from ..a import y\n"},
     [["pkg.a", "pkg.b", "pkg.sub.c"]]),
    # a child importing its own package is no circle; one way is none
    ({"pkg/__init__.py": "from .a import x\n", "pkg/a.py": "from . import b\nimport pkg\n", "pkg/b.py": ""}, []),
])
def test_the_scanner_finds_lazy_and_relative_circles(tmp_path: Path, files: dict[str, str],
                                                     want: list[list[str]]) -> None:
    write(tmp_path, files)
    assert cycles(import_graph(tmp_path, {"pkg": False})) == want


def test_the_scanner_resolves_bare_sibling_names(tmp_path: Path) -> None:
    """What the benchmarks do: ``from bench import measure`` with their folder on sys.path."""
    write(tmp_path, {"benchmarks/bench.py": "def run():\n    import quantize_bench\n",
                     "benchmarks/quantize_bench.py": "from bench import measure\nimport json\n",
                     "benchmarks/harness.py": ""})
    assert cycles(import_graph(tmp_path, {"benchmarks": True})) == [["benchmarks.bench", "benchmarks.quantize_bench"]]
    write(tmp_path, {"benchmarks/quantize_bench.py": "from harness import measure\n"})
    assert cycles(import_graph(tmp_path, {"benchmarks": True})) == []
