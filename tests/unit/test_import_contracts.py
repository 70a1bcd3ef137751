"""The import direction holds: the import-linter contracts (``.importlinter``, run by
``make lint``) are kept, their layers name every module, and no module takes part in an
import cycle, counting every import statement: those inside functions (grimp reads them
all) and those under ``if TYPE_CHECKING:`` (a type-only import is a dependency of the
design too: a contract naming a type of a higher layer points up)."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentspec", "adapters", "workflows")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            succ = [w for w in edges.get(node, []) if w in edges]
            if i < len(succ):
                work.append((node, i + 1))
                w = succ[i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[node] = min(low[node], index[w])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def test_no_module_is_in_an_import_cycle(graph: grimp.ImportGraph) -> None:
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    """The check above can fail: a two-module cycle made of function-level imports."""
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.a")
    g.add_import(importer="p.c", imported="p.a")
    assert _cycles(g) == [["p.a", "p.b"]]


def test_only_the_cli_imports_workflows_or_adapters(graph: grimp.ImportGraph) -> None:
    bad = sorted(
        (m, t) for m in graph.modules if m.split(".")[0] == "agentspec"
        for t in graph.find_modules_directly_imported_by(m)
        if t.split(".")[0] in ("workflows", "adapters") and m != "agentspec.cli.console"
    )
    assert bad == []


def test_import_linter_contracts_are_kept() -> None:
    linter = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_type_only_imports_are_counted() -> None:
    """The graph above keeps ``if TYPE_CHECKING:`` imports, and so does import-linter."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    assert cfg["importlinter"]["exclude_type_checking_imports"].strip() == "False"
    g = grimp.build_graph("agentspec", exclude_type_checking_imports=False, cache_dir=None)
    # agentspec/__init__.py names its exports for type checkers only under TYPE_CHECKING
    assert "agentspec.runtime" in g.find_modules_directly_imported_by("agentspec")


def _layer_entries() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    entries = []
    for section in cfg.sections():
        if cfg[section].get("type", "").strip() != "layers":
            continue
        for line in cfg[section]["layers"].strip().splitlines():
            entries += [e.strip() for e in line.split(":") if e.strip()]
    return entries


def test_the_layers_name_every_module(graph: grimp.ImportGraph) -> None:
    """A module outside every layer would escape the direction checks: each module of the
    three packages is a layer or inside one. Excepted: the roots (``agentspec/__init__.py``
    is the public facade above every layer: nothing inside imports it) and package
    ``__init__`` files that import nothing."""
    entries = _layer_entries()
    loose = sorted(
        m for m in graph.modules if m.split(".")[0] in PACKAGES and m not in PACKAGES
        and not any(m == e or m.startswith(e + ".") for e in entries)
        and graph.find_modules_directly_imported_by(m)
    )
    assert loose == []
    inside = sorted(m for m in graph.find_modules_that_directly_import("agentspec"))
    assert inside == []
