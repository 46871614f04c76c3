"""MkDocs hooks: fence attributes the docs' example tests read (``py test="skip"``) are taken
off before the page is rendered, so the highlighter sees a plain ``py`` fence."""

from __future__ import annotations

import re
from typing import Any

_FENCE = re.compile(r'^(\s*```+\s*[\w+-]+)((?:\s+\w+="[^"]*")+)\s*$', re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return _FENCE.sub(r"\1", markdown)
