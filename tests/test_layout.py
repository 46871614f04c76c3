"""The project's layout: the files of `pipeline` and `middleware` import one another in one
direction (no cycle between any two of them), and the test kit stays out of the core.

The import graph has an edge for every import statement that names a project module:
module-level ones, those under ``if TYPE_CHECKING:`` (a type-level circle is still a circle
in the design) and those inside functions (importing late is not a way around a cycle).
``from package import name`` is an edge to ``package.name`` when that is a module, else to
the package; the parent packages Python runs first are no edge (every ``__init__`` that
re-exports its modules would otherwise be a cycle). One late edge is allowed, named in
`LATE_ALLOWED` with its reason.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import middleware
import pipeline

ROOT = Path(pipeline.__file__).parent.parent
PACKAGES = (Path(pipeline.__file__).parent, Path(middleware.__file__).parent)

# (importer, imported): imports inside a function that close a cycle on purpose.
LATE_ALLOWED = {
    # `ChatPipeline.from_config` (the builder's door to a TOML file) loads the config layer,
    # which builds with the builder: the core's one upward reference, made when called.
    ("pipeline.builder", "pipeline.config"),
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules an import statement in `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package.pop()
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
            for alias in node.names
        ]
    return {name for name in names if name in MODULES and name != module}


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(project modules `module` imports at module level, ``TYPE_CHECKING`` included;
    project modules it imports inside a function)."""
    eager: set[str] = set()
    late: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                (late if in_function else eager).update(_targets(module, child))
            nested = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, in_function or nested)

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])), False)
    return eager, late


GRAPH = {module: _imports(module) for module in MODULES}


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in import order, the first repeated at the end),
    or None."""
    done: set[str] = set()
    for start in sorted(edges):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(edges[start]))]
        while stack:
            following = next(stack[-1], None)
            if following is None:  # every import of path[-1] explored: no cycle through it
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if following in on_path:
                return [*path[path.index(following) :], following]
            if following not in done:
                path.append(following)
                on_path.add(following)
                stack.append(iter(sorted(edges[following])))
    return None


def test_the_walk_sees_every_package() -> None:
    expected = {
        "pipeline",
        "pipeline.builder",
        "pipeline.config",
        "pipeline.testing",
        "pipeline.testing._fake_server",
        "pipeline.gateway.app",
        "pipeline.gateway._handler",
        "pipeline.providers._http",
        "pipeline.integrations.langchain",
        "middleware",
        "middleware.routing._engine",
    }
    assert expected <= set(MODULES)
    eager, late = GRAPH["pipeline.gateway.app"]
    assert "pipeline.gateway._handler" in eager
    assert "pipeline.config" in eager  # under TYPE_CHECKING: counted
    assert "pipeline.builder" in late


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_between_any_two_files() -> None:
    edges = {
        module: eager | {m for m in late if (module, m) not in LATE_ALLOWED}
        for module, (eager, late) in GRAPH.items()
    }
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_allowed_late_imports_are_late_and_needed() -> None:
    for importer, imported in LATE_ALLOWED:
        eager, late = GRAPH[importer]
        assert imported in late and imported not in eager, (importer, imported)
        # It closes a cycle (the imported module reaches the importer): else it needs no
        # exception.
        reached, todo = set(), [imported]
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo.extend(GRAPH[module][0] | GRAPH[module][1])
        assert importer in reached, (importer, imported)


def test_every_exception_class_is_defined_in_pipeline_errors() -> None:
    """Found by their bases: a built-in exception, or a class `pipeline.errors` defines."""
    import builtins

    import pipeline.errors

    bases = {
        name
        for name, value in [*vars(builtins).items(), *vars(pipeline.errors).items()]
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    outside = sorted(
        f"{module}.{node.name}"
        for module, path in MODULES.items()
        if module != "pipeline.errors"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).rsplit(".", 1)[-1] in bases for base in node.bases)
    )
    assert outside == []


def test_the_core_folder_holds_no_fake() -> None:
    top = {path.name for path in PACKAGES[0].glob("*.py")}
    assert not {name for name in top if name.startswith(("_fake", "_scripted", "testing"))}
    assert (PACKAGES[0] / "testing" / "__init__.py").is_file()


def test_the_core_imports_the_test_kit_only_inside_functions() -> None:
    kit = {m for m in MODULES if m == "pipeline.testing" or m.startswith("pipeline.testing.")}
    eager_users = {
        module for module, (eager, _) in GRAPH.items() if module not in kit and eager & kit
    }
    assert eager_users == set()


@pytest.mark.parametrize(
    "modules",
    [
        "pipeline",
        "pipeline.builder, pipeline.config, pipeline.cli, pipeline.evals",
        "pipeline.providers, pipeline.gateway.app, pipeline.gateway.server",
        "middleware, middleware.routing",
    ],
)
def test_importing_the_core_leaves_the_test_kit_out(modules: str) -> None:
    code = (
        f"import sys, {modules};"
        "print(sorted(m for m in sys.modules if m.startswith('pipeline.testing')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _contracts() -> list[dict[str, Any]]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        contracts: list[dict[str, Any]] = tomllib.load(file)["tool"]["importlinter"]["contracts"]
    return contracts


def test_the_import_contracts_hold() -> None:
    """The import-linter contracts in pyproject.toml (``[tool.importlinter]``): the gateway's
    layers (server, app, endpoints, then the handler and the formats, the layers, the
    exchange, the shared leaf, the wire and settings; siblings on one rank do not import one
    another), `pipeline.wire` on the core alone, the gateway off the providers' private
    modules, the providers and fakes off the gateway, the fakes off the codecs."""
    code = (
        "import sys; from importlinter.cli import lint_imports;"
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(_contracts())} kept, 0 broken" in done.stdout
    assert len(_contracts()) >= 5


def test_the_contract_names_every_private_module_of_the_providers() -> None:
    """import-linter has no wildcard within a name (``_*``): the list is checked here, so a
    new private module of the providers is forbidden to the gateway the day it is added."""
    (contract,) = [c for c in _contracts() if c.get("source_modules") == ["pipeline.gateway"]]
    private = {
        module
        for module in MODULES
        if module.startswith("pipeline.providers.") and module.rsplit(".", 1)[1].startswith("_")
    }
    assert set(contract["forbidden_modules"]) == private


def test_no_module_imports_a_private_module_of_another_wire_package() -> None:
    """Across `pipeline.wire`, `pipeline.providers` and `pipeline.gateway`, a module named
    ``_x`` (or under a package ``_x``) is its own package's: no other of the three imports it."""
    owners = ("pipeline.wire", "pipeline.providers", "pipeline.gateway")

    def owner(module: str) -> str | None:
        return next((o for o in owners if module == o or module.startswith(o + ".")), None)

    crossing = sorted(
        f"{module} -> {imported}"
        for module, (eager, late) in GRAPH.items()
        for imported in eager | late
        if owner(module) is not None
        and owner(imported) not in (None, owner(module))
        and any(part.startswith("_") for part in imported.split(".")[2:])
    )
    assert crossing == []
