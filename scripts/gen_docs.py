"""mkdocs-gen-files script: the pages generated at build time (the configuration reference)."""

import importlib.util
import sys
from pathlib import Path

import mkdocs_gen_files

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
_spec = importlib.util.spec_from_file_location(
    "configuration_reference", _ROOT / "scripts" / "configuration_reference.py"
)
assert _spec is not None
assert _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module  # dataclasses look their module up
_spec.loader.exec_module(_module)

with mkdocs_gen_files.open("reference/configuration.md", "w") as page:
    page.write(_module.render())
mkdocs_gen_files.set_edit_path(
    "reference/configuration.md", "../scripts/configuration_reference.py"
)
