"""The documentation site builds strictly, its links hold, and its references cannot drift.

* `mkdocs build --strict` passes (dead links and anchors between pages, pages left out of
  the nav and references that do not resolve are warnings, and strict makes them errors);
* every relative link of README.md reaches a file, and its anchor a heading there;
* the configuration reference (generated at build time from the settings classes) has a
  description for every key, and names every provider and router kind;
* the CLI page names every subcommand and option; every public module has an API page.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.docs_examples import DOCS, ROOT, blocks
from tests.processes import require_module

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _reference() -> ModuleType:
    path = ROOT / "scripts" / "configuration_reference.py"
    spec = importlib.util.spec_from_file_location("configuration_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    require_module("mkdocs", what="MkDocs", extra="docs")
    require_module(
        "mkdocstrings_handlers.python", what="mkdocstrings' Python handler", extra="docs"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (tmp_path / "reference" / "configuration" / "index.html").is_file()
    # Every public name is documented where users import it (`pipeline.ChatPipeline`, never
    # a private module's path): an anchor of that name on its module's API page.
    from tests.test_public_api import SURFACES

    built = {
        path: set(re.findall(r'id="([^"]+)"', path.read_text()))
        for path in (tmp_path / "reference" / "api").glob("*/index.html")
    }
    for module, names in SURFACES.items():
        for name in names:
            anchor = f"{module}.{name}"
            assert any(anchor in ids for ids in built.values()), anchor


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc makes of a heading (and GitHub, for these)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    fenced = {
        line
        for block in blocks(path)
        for line in range(block.line, block.line + len(block.source.splitlines()) + 2)
    }
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        heading = re.match(r"^#{1,6} (.*?)(?:\s*\{#([\w-]+)\})?\s*$", line)
        if heading and number not in fenced:
            found.add(heading[2] or _slug(heading[1]))
    return found


def _dead_links(page: Path) -> list[str]:
    dead = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        missing_anchor = bool(anchor) and resolved.suffix == ".md"
        if not resolved.exists() or (missing_anchor and anchor not in _anchors(resolved)):
            dead.append(target)
    return dead


def test_readme_links_and_anchors_resolve() -> None:
    assert _dead_links(ROOT / "README.md") == []


def test_docs_links_to_files_outside_the_site_resolve() -> None:
    """Links from a page to the repository (examples, scripts) exist; links between pages
    and their anchors are the strict build's to check."""
    dead = []
    for page in DOCS.rglob("*.md"):
        for target in _LINK.findall(page.read_text()):
            file = target.partition("#")[0]
            outside = file and not re.match(r"^[a-z]+:", file) and not file.endswith(".md")
            if outside and not (page.parent / file).resolve().exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert dead == []


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    # The two commands, as CI and the hooks look for them.
    assert (
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/chat-pipeline demo"
        in text
    )
    assert "./scripts/test" in text and "pytest" in text


def test_every_configuration_key_has_a_description() -> None:
    assert _reference().undocumented() == []


def test_the_configuration_reference_names_every_provider_and_router_kind() -> None:
    from typing import get_args

    from pipeline.config import RouteConfig, RouterConfig

    page = _reference().render()
    union_of_routes, union_of_routers = get_args(RouteConfig)[0], get_args(RouterConfig)[0]
    providers = [
        get_args(m.model_fields["provider"].annotation)[0] for m in get_args(union_of_routes)
    ]
    kinds = [get_args(m.model_fields["kind"].annotation)[0] for m in get_args(union_of_routers)]
    assert "openai_responses" in providers and "balanced" in kinds
    guide = (DOCS / "configuration.md").read_text()
    for provider in providers:
        assert f'`provider = "{provider}"`' in page
        assert f'| `"{provider}"` |' in guide, f"configuration.md's table lacks {provider}"
    for kind in kinds:
        assert f'`kind = "{kind}"`' in page
        assert f'| `"{kind}"` |' in guide, f"configuration.md's table lacks {kind}"
    for key in ("gateway.max_body_bytes", "routes.<name>.model", "router.health.store"):
        assert f"`{key}`" in page


def _help(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_the_cli_page_names_every_command_and_option() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    commands = re.search(r"\{([\w,-]+)\}", _help()).group(1).split(",")  # type: ignore[union-attr]
    assert len(commands) >= 6
    for command in commands:
        assert f"## `chat-pipeline {command}`" in page
        for option in set(re.findall(r"(--[a-z][a-z-]+)", _help(command))) - {"--help"}:
            assert option in page, f"chat-pipeline {command} {option}"


def test_every_public_module_has_an_api_page() -> None:
    from tests.test_public_api import SURFACES

    pages = "\n".join(p.read_text() for p in (DOCS / "reference" / "api").glob("*.md"))
    for module in SURFACES:
        if module == "pipeline.integrations":
            continue  # a namespace: its adapters have their own entries
        assert f"::: {module}\n" in pages, module


@pytest.mark.parametrize("name", ["cache.md", "semantic.md", "jaeger.md", "claude-code.md"])
def test_the_nav_marks_where_other_pages_go(name: str) -> None:
    """Pages written elsewhere are added to the nav at merge: the places are marked."""
    assert name in (ROOT / "mkdocs.yml").read_text()


def test_every_settings_field_of_the_library_has_a_description() -> None:
    """Beyond the file's keys: every field of every settings class a user may build in code
    (the layers', the providers', the routers', the test kit's fleet scenarios), code-only
    fields included."""
    import importlib
    import pkgutil

    import middleware
    import pipeline
    from pipeline._settings import Settings

    for package in (pipeline, middleware):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if module.name.endswith("__main__") or ".integrations." in module.name:
                continue
            importlib.import_module(module.name)

    def subclasses(cls: type) -> list[type]:
        return [sub for direct in cls.__subclasses__() for sub in (direct, *subclasses(direct))]

    missing = set()
    for cls in subclasses(Settings):
        if not cls.__module__.startswith(("pipeline", "middleware")):
            continue
        for name, field in cls.model_fields.items():
            if not (field.description or "").strip():
                missing.add(f"{cls.__module__}.{cls.__name__}.{name}")
    assert sorted(missing) == [], "\n".join(sorted(missing))
