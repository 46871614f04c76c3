"""The code blocks of README.md and docs/: found, and run the way the docs' tests run them.

A fence is ```` ```lang ```` optionally followed by attributes (```` ```py test="skip" ````),
which the site's build takes off before rendering (``scripts/docs_hooks.py``):

* ``test="skip"``: shown, not run (the page says why in a sentence beside the block);
* ``test="gateway-quickstart"``: run by the gateway quick start's test, against the
  quick start's server (``tests/test_gateway_quickstart.py``), not with the page's others;
* ``test="pytest"``: a test file of a user's suite, run by pytest with the test kit's
  plugin (``pipeline.testing.pytest_plugin``) named in its ``conftest.py``.

Every other Python block runs, in page order, in one namespace per page (so a page's later
blocks use what its earlier ones defined, as a reader would), with top-level ``await``
allowed (a block shown as the body of an ``async def``, as the docs say). The namespace
starts with `PRELUDE`: the clients the docs' fragments name (``primary``, ``backup``,
``east``...), each a `ScriptedChatClient`, as the pages' notes say.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<lang>[\w+-]*)(?P<attrs>.*)$")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int  # of the opening fence, from 1
    lang: str
    attrs: dict[str, str]
    source: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in ("py", "python")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of `path`, in order (fences inside list items included)."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(ticks) and lines[end].strip().strip("`") == ""
        ):
            body.append(lines[end][len(indent) :] if lines[end].startswith(indent) else lines[end])
            end += 1
        found.append(
            Block(
                path,
                index + 1,
                opening["lang"],
                dict(_ATTR.findall(opening["attrs"])),
                textwrap.dedent("\n".join(body)) + "\n",
            )
        )
        index = end + 1
    return found


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def python_blocks(path: Path, *, test: str | None = None) -> list[Block]:
    """`path`'s Python blocks that `test` runs (None: the ones with no ``test`` attribute)."""
    return [b for b in blocks(path) if b.is_python and b.attrs.get("test") == test]
