"""The package's layering, read off its import statements (an AST walk, no import is run):
``integration/`` is laid out by the SGLang process each module runs in; ``testing/`` is the harness
that tests and benchmarks share, which the serving package never imports.

- the import graph of ``sglang_kvshare`` has no cycle (imports under ``if TYPE_CHECKING:`` are
  not run and do not count);
- nothing imports ``integration/plugin.py`` (the composition root);
- ``integration/model/`` never imports ``integration/scheduler/``;
- ``integration/server/`` (the HTTP process) imports nothing of ``scheduler/``, ``model/``,
  ``cache/`` or ``state/`` (the scheduler process);
- only ``integration/`` imports ``sglang.srt``;
- no module of the package or of ``benchmarks/`` is over 300 lines;
- nothing in ``benchmarks/`` imports ``tests``, and nothing in the package imports ``tests`` or
  ``benchmarks``;
- only ``testing/`` itself, ``tests/``, ``benchmarks/`` and ``examples/`` import
  ``sglang_kvshare.testing``;
- no file of ``tests/`` is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "sglang_kvshare"
INTEGRATION = f"{PACKAGE}.integration"
SCHEDULER_SIDE = tuple(f"{INTEGRATION}.{side}" for side in ("scheduler", "model", "cache", "state"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations
    only, never run, so they make no import cycle)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports at run time (any depth: function-local imports count; not
    those under ``if TYPE_CHECKING:``), each name of a ``from X import a`` counted as ``X.a`` when
    that is a module of the package, else ``X``."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    return {m: {i for i in _imports(p, m) if i in files} for m, p in files.items()}


def _imports_under(top: str) -> dict[str, set[str]]:
    """Every module under the folder ``top`` -> what it imports."""
    return {m: _imports(p, m) for m, p in ((_module_name(p), p) for p in (ROOT / top).rglob("*.py"))}


GRAPH = _graph()
ALL_IMPORTS = _imports_under(PACKAGE)
TESTING = f"{PACKAGE}.testing"


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _edges_between(src_prefixes, dst_prefixes) -> list[tuple[str, str]]:
    return sorted(
        (m, i)
        for m, deps in ALL_IMPORTS.items()
        for i in deps
        if any(_under(m, s) for s in src_prefixes) and any(_under(i, d) for d in dst_prefixes)
    )


def test_the_walk_sees_the_package():
    assert f"{INTEGRATION}.plugin" in GRAPH and f"{INTEGRATION}.server.middleware" in GRAPH
    assert f"{INTEGRATION}.hooks" in GRAPH[f"{INTEGRATION}.plugin"]


def test_the_import_graph_has_no_cycle():
    # a module's own package __init__ is imported with it; an edge to an ancestor package is fine
    # only when the package does not import back, which the walk below checks like any other edge
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_nothing_imports_the_composition_root():
    assert [m for m, deps in ALL_IMPORTS.items() if f"{INTEGRATION}.plugin" in deps] == []


def test_the_model_side_never_imports_the_scheduler_side():
    assert _edges_between([f"{INTEGRATION}.model"], [f"{INTEGRATION}.scheduler"]) == []


def test_the_http_process_imports_nothing_of_the_scheduler_process():
    assert _edges_between([f"{INTEGRATION}.server"], SCHEDULER_SIDE) == []


def test_only_the_integration_layer_imports_sglang_internals():
    outside = [
        (m, i)
        for m, deps in ALL_IMPORTS.items()
        for i in deps
        if _under(i, "sglang.srt") and not _under(m, INTEGRATION)
    ]
    assert outside == []


@pytest.mark.parametrize("top", [PACKAGE, "benchmarks"])
def test_no_module_is_over_300_lines(top):
    long = {
        str(p.relative_to(ROOT)): n for p in (ROOT / top).rglob("*.py") if (n := len(p.read_text().splitlines())) > 300
    }
    assert long == {}


def _importers(imports: dict[str, set[str]], prefixes) -> list[tuple[str, str]]:
    return sorted((m, i) for m, deps in imports.items() for i in deps if any(_under(i, p) for p in prefixes))


def test_the_walk_sees_benchmarks_and_tests():
    # benchmarks.serving.servers imports the harness inside a function: imports at any depth count
    assert f"{TESTING}.server" in _imports_under("benchmarks")["benchmarks.serving.servers"]
    assert f"{TESTING}.server" in _imports_under("tests")["tests.integration.conftest"]
    # the middleware's contract names its parts for the type checker only: no run-time edge
    server = f"{INTEGRATION}.server"
    assert f"{server}.annotate" not in GRAPH[f"{server}.host"]
    assert f"{server}.host" not in GRAPH[f"{server}.annotate"]


def test_benchmarks_never_import_the_tests():
    assert _importers(_imports_under("benchmarks"), ["tests"]) == []


def test_the_package_imports_neither_tests_nor_benchmarks():
    assert _importers(ALL_IMPORTS, ["tests", "benchmarks"]) == []


def test_only_tests_benchmarks_and_examples_import_the_harness():
    outside = {m: deps for m, deps in ALL_IMPORTS.items() if not _under(m, TESTING)}
    outside.update(_imports_under("scripts"))
    assert _importers(outside, [TESTING]) == []


def test_no_test_file_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "tests").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
