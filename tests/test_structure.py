"""The package's shape, read from its own imports (ast, every import counted, lazy ones included): views read
records and never reach the engine; the harness imports nothing of the runner; no import cycle anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "autoresearch"
ENGINE = ("autoresearch.sweep", "autoresearch.scheduler", "autoresearch.session", "autoresearch.executors")


def _name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (an imported name that is a module counts as that module)."""
    files = {_name(p): p for p in PKG.rglob("*.py") if "resources" not in p.parts}
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join((here[:len(here) - node.level + 1] if node.level else [])
                                + (node.module.split(".") if node.module else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` reaches, each with the module it was reached from."""
    seen, todo = {start: ""}, [start]
    while todo:
        m = todo.pop()
        for n in graph[m]:
            if n not in seen:
                seen[n] = m
                todo.append(n)
    return seen


def _path(seen: dict[str, str], end: str) -> str:
    out = [end]
    while seen[out[-1]]:
        out.append(seen[out[-1]])
    return " <- ".join(out)


def test_the_graph_sees_the_package():
    g = _graph()
    assert "autoresearch.views.report" in g and "autoresearch.records" in g["autoresearch.views.report"]
    assert "autoresearch.session" in g["autoresearch.sweep.run"]           # a lazy import counts


def test_no_view_reaches_the_engine_even_through_another_module():
    g = _graph()
    views = [m for m in g if m.startswith("autoresearch.views")]
    assert len(views) >= 7
    bad = {v: [_path(seen, m) for m in seen if m.startswith(ENGINE)] for v in views for seen in [_reach(g, v)]}
    assert {v: p for v, p in bad.items() if p} == {}


def test_the_harness_imports_nothing_outside_the_harness():
    g = _graph()
    out = {m: sorted(d for d in deps if not d.startswith("autoresearch.harness"))
           for m, deps in g.items() if m.startswith("autoresearch.harness")}
    assert {m: d for m, d in out.items() if d} == {}


def test_no_two_modules_import_each_other_and_there_is_no_cycle():
    g = _graph()
    back = {m: sorted(n for n in g[m] if m in _reach(g, n)) for m in g}     # m imports n, and n leads back to m
    assert {m: n for m, n in back.items() if n} == {}


def test_the_module_map_in_the_architecture_doc_is_the_tree():
    """docs/architecture.md's module map names every module of the package and nothing else, in its folder."""
    import re
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    block = doc.split("## Module map", 1)[1].split("```", 2)[1]
    named, folder = set(), ""
    for line in block.splitlines():
        m = re.match(r"^(  |    )(\S+?)(/)?(\s|$)", line)
        if not m:
            continue
        if len(m.group(1)) == 2:
            folder = m.group(2) + "/" if m.group(3) else ""
            if not m.group(3):
                named.add(m.group(2))
        else:
            named.add(folder + m.group(2))
    tree = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "resources" not in p.parts}
    assert sorted(tree - named) == [] and sorted(n for n in named - tree if n.endswith(".py")) == []
