"""The package's shape, read from its own imports (ast, every import counted, lazy ones included): each folder
imports only the parts below it (MAY_IMPORT); views read records and never reach the engine; records reach
nothing above them; the harness imports nothing of the runner; no import cycle anywhere. Each rule is also run
on a copy of the package with one import planted that breaks it, and must say so."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "autoresearch"
ENGINE = ("autoresearch.sweep", "autoresearch.session", "autoresearch.executors")
# Which parts a part may import. "core" is the few cross-cutting modules left flat (config, errors, gitops, knobs,
# objective, decide, ...). Read top to bottom, each part builds on the ones after it; views sit beside the
# session and read what it leaves (records, the proposers' journal), never the session itself.
PARTS = ("cli", "sweep", "session", "experiment", "executors", "proposers", "views", "trust", "records", "core",
         "harness")
MAY_IMPORT = {
    "cli": set(PARTS),
    "sweep": {"sweep", "session", "executors", "records", "core", "harness"},
    "session": {"session", "experiment", "executors", "proposers", "trust", "records", "core", "harness"},
    "experiment": {"experiment", "executors", "proposers", "trust", "records", "core", "harness"},
    "executors": {"executors", "experiment", "trust", "records", "core", "harness"},
    "proposers": {"proposers", "trust", "records", "core", "harness"},
    "views": {"views", "proposers", "records", "core", "harness"},
    "trust": {"trust", "records", "core", "harness"},
    "records": {"records", "core", "harness"},
    "core": {"core", "records", "harness"},                 # config names runs/ paths (records/layout.py)
    "harness": {"harness"},
}


def _name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[1:] == ["__main__"]:
        return "cli"                                       # `python -m autoresearch` is the CLI's front door
    return parts[1] if len(parts) > 1 and parts[1] in PARTS else "core"


def _graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the package's modules it imports (an imported name that is a module counts as that module)."""
    files = {_name(p, pkg): p for p in pkg.rglob("*.py") if "resources" not in p.parts}
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


def _breaches(g: dict[str, set[str]]) -> list[str]:
    """Imports from one part into another that MAY_IMPORT does not allow."""
    return sorted(f"{m} -> {d}" for m, deps in g.items() for d in deps if _part(d) not in MAY_IMPORT[_part(m)])


def _views_reaching_the_engine(g: dict[str, set[str]]) -> list[str]:
    return sorted(_path(seen, m) for v in g if v.startswith("autoresearch.views") for seen in [_reach(g, v)]
                  for m in seen if m.startswith(ENGINE))


def _records_reaching_above(g: dict[str, set[str]]) -> list[str]:
    """A records module that leads, through any chain of imports, to a part above records."""
    return sorted(_path(seen, m) for r in g if _part(r) == "records" for seen in [_reach(g, r)]
                  for m in seen if _part(m) not in MAY_IMPORT["records"])


def _harness_leaving(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in g.items() if m.startswith("autoresearch.harness")
                  for d in deps if not d.startswith("autoresearch.harness"))


def _cycles(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {n}" for m in g for n in g[m] if m in _reach(g, n))   # m imports n, n leads back to m


RULES = (_breaches, _views_reaching_the_engine, _records_reaching_above, _harness_leaving, _cycles)


def test_the_graph_sees_the_package():
    g = _graph()
    assert "autoresearch.views.report" in g and "autoresearch.records.rows" in g["autoresearch.views.report"]
    assert "autoresearch.session.loop" in g["autoresearch.sweep.run"]           # a lazy import counts


def test_each_part_imports_only_the_parts_it_may():
    assert _breaches(_graph()) == []


def test_no_view_reaches_the_engine_even_through_another_module():
    g = _graph()
    assert len([m for m in g if m.startswith("autoresearch.views")]) >= 7
    assert _views_reaching_the_engine(g) == []


def test_records_reach_nothing_above_them():
    assert _records_reaching_above(_graph()) == []


def test_the_harness_imports_nothing_outside_the_harness():
    assert _harness_leaving(_graph()) == []


def test_no_two_modules_import_each_other_and_there_is_no_cycle():
    assert _cycles(_graph()) == []


PLANTED = [   # (module file, the import planted in it, the rules that must each report it)
    ("records/ledger.py", "from autoresearch.session import loop",
     {_breaches, _records_reaching_above, _views_reaching_the_engine, _cycles}),
    ("knobs.py", "from autoresearch.proposers import memory", {_breaches, _records_reaching_above, _cycles}),
    ("views/report.py", "from autoresearch.sweep.run import run_sweep", {_breaches, _views_reaching_the_engine}),
    ("proposers/memory.py", "from autoresearch.session import loop",   # views/serve.py reads the journal
     {_breaches, _views_reaching_the_engine, _cycles}),
    ("harness/data.py", "from autoresearch.records.layout import RunsLayout", {_breaches, _harness_leaving}),
    ("trust/repeats.py", "from autoresearch.experiment import settle", {_breaches, _cycles}),  # settle reads repeats
    ("slots.py", "from autoresearch.config import RunConfig", {_cycles}),
]


@pytest.mark.parametrize("where,line,rules", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_rule_reports_an_import_planted_against_it(tmp_path, where, line, rules):
    """A copy of the package with one import added (inside a function, as a lazy import would be): exactly the
    rules it breaks say so, and the others stay quiet, so a rule that could never fail would show here."""
    pkg = tmp_path / "autoresearch"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__", "resources"))
    f = pkg / where
    f.write_text(f.read_text() + f"\n\ndef _planted():\n    {line}\n")
    g = _graph(pkg)
    assert sorted(rule.__name__ for rule in RULES if rule(g)) == sorted(rule.__name__ for rule in rules)

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
