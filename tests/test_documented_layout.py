"""docs/development.md's layout names every module of `pipeline` and `middleware`, and no
module that is gone; its count of what adding a wire API touches holds for the APIs added.

The layout is a code block: a line whose first character is before column 26 names files
(``x.py``) or one package (``x/``) in its first column, indented under its package; a line
starting at column 26 or later continues a description.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import middleware
import pipeline

ROOT = Path(pipeline.__file__).parent.parent
DOC = ROOT / "docs" / "development.md"
NAME_COLUMN = 26
_NAME = re.compile(r"[A-Za-z0-9_]+(\.py|/)")


def _layout_block(text: str) -> list[str]:
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return block.splitlines()


def documented(lines: list[str]) -> set[str]:
    """The files (``pipeline/types.py``) and packages (``pipeline/wire/``) the layout names;
    `ValueError` for a name column that is not file and package names."""
    found: set[str] = set()
    packages: list[tuple[int, str]] = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent >= NAME_COLUMN:
            continue  # a description's continuation
        gap = line.find("  ", indent)  # names end at a double space, or at the column
        gap = len(line) if gap < 0 else gap
        if gap <= NAME_COLUMN or line[NAME_COLUMN - 1] != " ":
            names = line[:gap]  # a name running past the column ends at the double space
        else:
            names = line[:NAME_COLUMN]
        tokens = names.split()
        if not all(_NAME.fullmatch(token) for token in tokens):
            raise ValueError(f"not file or package names: {names.strip()!r}")
        while packages and packages[-1][0] >= indent:
            packages.pop()
        where = "".join(name for _, name in packages)
        if tokens[0].endswith("/"):
            if len(tokens) != 1:
                raise ValueError(f"a package shares its line: {names.strip()!r}")
            packages.append((indent, tokens[0]))
            found.add(where + tokens[0])
        else:
            found.update(where + token for token in tokens)
    return found


def actual() -> set[str]:
    found: set[str] = set()
    for package in (Path(pipeline.__file__).parent, Path(middleware.__file__).parent):
        for path in package.rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if path.name == "__init__.py":
                found.add(relative.removesuffix("__init__.py"))
            else:
                found.add(relative)
    return found


def test_the_reader_reads_nesting_columns_and_long_names() -> None:
    lines = [
        "top/                      what it is",
        "  a.py b.py               two files",
        "                          a description going on: c.py is not named",
        "  sub/                    a package",
        "    c.py                  its file",
        "    a_name_longer_than_the_column.py",
        "  d.py (a description too close to the names)",
        "  e.py                    back in top",
        "  f.py  g.py is a description",
    ]
    with pytest.raises(ValueError, match="not file or package names"):
        documented(lines)
    del lines[6]
    assert documented(lines) == {
        "top/",
        "top/a.py",
        "top/b.py",
        "top/sub/",
        "top/sub/c.py",
        "top/sub/a_name_longer_than_the_column.py",
        "top/e.py",
        "top/f.py",
    }


def test_the_layout_names_every_module_and_no_other() -> None:
    named = documented(_layout_block(DOC.read_text()))
    files = actual()
    assert sorted(files - named) == [], "modules missing from docs/development.md's layout"
    assert sorted(named - files) == [], "docs/development.md's layout names what is gone"


# -- what adding a wire API touches ---------------------------------------------------------

REGISTRATIONS = {
    "pipeline/config.py",
    "pipeline/providers/__init__.py",
    "pipeline/testing/__init__.py",
    "pipeline/types.py",
}
"""The places docs/development.md ("Adding a wire API") says an API is registered in."""


def test_the_documented_registrations_are_the_ones_listed() -> None:
    text = DOC.read_text().split("### Adding a wire API", 1)[1].split("\n## ", 1)[0]
    registrations = text.split("- the registrations:", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`(pipeline/[\w/]+\.py)`", registrations)) == REGISTRATIONS
    assert len(REGISTRATIONS) == 4
    assert "four registrations" in " ".join(text.split())


@pytest.mark.parametrize(
    ("api", "own"),
    [
        # Gemini's provider file serves Vertex AI's Gemini models too (vertex.py), and its
        # fake serves Vertex AI's Anthropic models beside the Messages fake.
        (
            "gemini",
            {
                "pipeline/providers/gemini.py",
                "pipeline/providers/vertex.py",
                "pipeline/testing/_fake_gemini.py",
                "pipeline/testing/_fake_anthropic.py",
            },
        ),
        ("bedrock", {"pipeline/providers/bedrock.py", "pipeline/testing/_fake_bedrock.py"}),
    ],
)
def test_an_added_wire_api_touches_its_package_provider_fake_and_the_registrations(
    api: str, own: set[str]
) -> None:
    """Every module naming the API is its package, its provider file, its fake, a
    registration, or the shared places every API is named in (the wire's common readers,
    the HTTP base's destinations, the fakes' shared server, and the price book's map of
    every provider name the semantic conventions define, which a test holds whole)."""
    shared = {
        "pipeline/pricing.py",
        "pipeline/wire/__init__.py",
        "pipeline/wire/_common.py",
        "pipeline/providers/_base.py",
        "pipeline/providers/_settings.py",
        "pipeline/testing/_fake_server.py",
    }
    naming = {
        path
        for path in actual()
        if path.endswith(".py") and api in (ROOT / path).read_text().lower()
    }
    package = {path for path in naming if path.startswith(f"pipeline/wire/{api}/")}
    assert package, api
    outside = naming - package - own - shared - REGISTRATIONS
    assert sorted(outside) == []
