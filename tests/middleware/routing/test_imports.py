"""The routing modules import one another in one direction: no cycle, nothing imported late
to get around one, and each module loads alone."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import middleware.routing

ROUTING = Path(middleware.routing.__file__).parent
PACKAGE = "middleware.routing"
MODULES = sorted(
    f"{PACKAGE}.{path.stem}" for path in ROUTING.glob("*.py") if path.stem != "__init__"
)
# The package loads semantic routing (and numpy) only when one of its names is first used.
LAZY_ALLOWED = {(PACKAGE, f"{PACKAGE}.semantic")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The routing modules an import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module == PACKAGE:  # from middleware.routing import semantic
        names = [f"{PACKAGE}.{alias.name}" for alias in node.names]
    else:
        names = [node.module or ""]
    return [n for n in names if n in MODULES]


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(routing modules imported when `module` loads, routing modules imported later:
    inside a function). Imports under ``if TYPE_CHECKING:`` are neither."""
    path = ROUTING / ("__init__.py" if module == PACKAGE else f"{module.rsplit('.', 1)[1]}.py")
    tree = ast.parse(path.read_text())
    eager: set[str] = set()
    late: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                (late if in_function else eager).update(_imported(child))
            nested = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            visit(child, nested)

    visit(tree, False)
    return eager, late


def test_the_routing_modules_are_the_ones_these_tests_know() -> None:
    assert {"middleware.routing._engine", "middleware.routing.failover"} <= set(MODULES)


def test_no_import_cycle_among_the_routing_modules() -> None:
    graph = {module: _imports(module)[0] for module in MODULES}
    done: set[str] = set()

    def walk(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for imported in sorted(graph[module]):
            walk(imported, (*path, module))
        done.add(module)

    for module in MODULES:
        walk(module, ())
    assert done == set(MODULES)


def test_no_routing_module_is_imported_late() -> None:
    late = {
        (module, imported) for module in [PACKAGE, *MODULES] for imported in _imports(module)[1]
    }
    assert late <= LAZY_ALLOWED


def test_the_engine_imports_no_router() -> None:
    eager, late = _imports("middleware.routing._engine")
    routers = {f"{PACKAGE}.{name}" for name in ("router", "failover", "tiered", "semantic")}
    assert not (eager | late) & routers


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
