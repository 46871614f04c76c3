"""The wire packages' place in the layout: they build on the core's types and import
nothing above them (no provider, gateway, layer or test kit), and the core never reaches
them, so the layering stays acyclic. Read from the import graph `tests.test_layout` builds
(every import statement, those inside functions and under ``TYPE_CHECKING`` included)."""

from __future__ import annotations

from tests.test_layout import GRAPH, MODULES

CORE = frozenset(
    {
        "pipeline.types",
        "pipeline.errors",
        "pipeline.client",
        "pipeline._json",
        "pipeline._json_codec",
    }
)
"""What the wire packages build on."""

WIRE = sorted(module for module in MODULES if module.split(".")[:2] == ["pipeline", "wire"])


def test_the_walk_sees_the_wire_packages() -> None:
    assert {"pipeline.wire", "pipeline.wire.tools", "pipeline.wire.messages.vocab"} <= set(WIRE)


def test_the_wire_packages_import_only_the_core() -> None:
    outside = {
        f"{module} imports {imported}"
        for module in WIRE
        for imported in GRAPH[module][0] | GRAPH[module][1]
        if imported not in WIRE and imported not in CORE
    }
    assert outside == set()


def test_the_core_never_reaches_the_wire_packages() -> None:
    reached: set[str] = set()
    todo = list(CORE)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(GRAPH[module][0] | GRAPH[module][1])
    assert reached.isdisjoint(WIRE)
