"""The adapters are optional: importing the library loads neither framework."""

import json
import subprocess
import sys

FRAMEWORKS = ("pydantic_ai", "langchain_core", "langgraph")


def loaded_after(code: str) -> list[str]:
    """Which framework packages a new interpreter has loaded after running `code`."""
    probe = (
        f"{code}; import json, sys; "
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout))


def test_importing_the_library_loads_no_framework() -> None:
    assert loaded_after("import pipeline, pipeline.integrations, middleware") == []


def test_each_adapter_loads_only_its_framework() -> None:
    assert loaded_after("import pipeline.integrations.pydantic_ai") == ["pydantic_ai"]
    assert loaded_after("import pipeline.integrations.langchain") == ["langchain_core"]
