#!/usr/bin/env python3
"""Cut a vendor's published API description down to what the gateway serves.

    scripts/cut_api_description.py openai --source CHECKOUT [--commit REV]
    scripts/cut_api_description.py anthropic --source CHECKOUT [--commit REV] [--file PATH]

The conformance suite (tests/conformance) generates requests from these cuts and validates
the gateway's answers against them. A cut keeps the operations the gateway serves and every
component they reference (plus the response schemas the suite reads that no operation
names: error bodies and stream events), and drops descriptions, summaries, titles, examples
and vendor extensions; a header names the source repository, file and commit.

* openai: OpenAI's official OpenAPI document, ``openapi.json`` (or ``openapi.yaml``) in a
  checkout of the GitHub repository openai/openai-openapi.
* anthropic: the Messages description Anthropic's TypeScript SDK is generated from (the
  ``openapi_spec_url`` of its ``.stats.yml``), as the GitHub repository
  laszukdawid/anthropic-openapi-spec keeps it (``hosted_spec.yaml``). That description
  predates thinking: what it lacks (thinking blocks and deltas, the newer stop reasons and
  error types, the ``thinking`` parameter) is added from the installed official ``anthropic``
  SDK's types (pydantic's JSON schema of each), each added schema named ``Sdk...`` and the
  SDK's version written in the header.

The source is read with git at `--commit` (default HEAD), so the header's commit is the one
read. Needs PyYAML (the test extra has it) and, for anthropic, the ``anthropic`` package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DESCRIPTIONS = ROOT / "tests" / "conformance" / "descriptions"

# Keywords that only describe: dropped everywhere they are keywords (not property names).
_DESCRIBING = frozenset(
    {"description", "summary", "title", "example", "examples", "externalDocs", "tags"}
)
# Keywords whose value maps names to schemas (their keys are names, never keywords).
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)

OPENAI = {
    "repository": "openai/openai-openapi",
    "operations": [
        ("/chat/completions", "post"),
        ("/responses", "post"),
        ("/models", "get"),
        ("/models/{model}", "get"),
    ],
    # Read by the suite, named by no operation: the error body and the stream events.
    "schemas": ["ErrorResponse", "CreateChatCompletionStreamResponse", "ResponseStreamEvent"],
}
ANTHROPIC = {
    "repository": "laszukdawid/anthropic-openapi-spec",
    "file": "hosted_spec.yaml",
    "operations": [("/v1/messages", "post")],
    "schemas": ["ErrorResponse", "MessageStreamEvent"],
}


def git(source: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(source), *args], check=True, capture_output=True, text=True
    ).stdout


def read_document(source: Path, commit: str, candidates: Iterable[str]) -> tuple[str, Any]:
    """The first of `candidates` that exists at `commit`, parsed."""
    for name in candidates:
        try:
            text = git(source, "show", f"{commit}:{name}")
        except subprocess.CalledProcessError:
            continue
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return name, json.loads(text) if name.endswith(".json") else yaml.load(text, loader)
    raise SystemExit(f"none of {list(candidates)} exists at {commit} in {source}")


def strip(node: Any, *, names: bool = False) -> Any:
    """`node` without describing keywords and vendor extensions. `names`: `node` maps names
    to schemas (its own keys are kept)."""
    if isinstance(node, list):
        return [strip(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {key: strip(value) for key, value in node.items()}
    kept = {}
    for key, value in node.items():
        if key in _DESCRIBING or key.startswith("x-"):
            continue
        kept[key] = strip(value, names=key in _SCHEMA_MAPS)
    return kept


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def cut(document: dict[str, Any], operations: list[tuple[str, str]], schemas: list[str]) -> Any:
    """The kept operations and every component they (and `schemas`) reference."""
    paths: dict[str, Any] = {}
    for path, method in operations:
        operation = document["paths"][path][method]
        kept = {
            k: v
            for k, v in operation.items()
            if k in ("operationId", "parameters", "requestBody", "responses")
        }
        paths.setdefault(path, {})[method] = strip(kept)
    components: dict[str, dict[str, Any]] = {}
    pending = [f"#/components/schemas/{name}" for name in schemas]
    pending += list(refs(paths))
    while pending:
        ref = pending.pop()
        if not ref.startswith("#/components/"):
            raise SystemExit(f"a reference outside the document's components: {ref}")
        _, _, kind, name = ref.split("/", 3)
        if name in components.get(kind, {}):
            continue
        component = strip(document["components"][kind][name])
        components.setdefault(kind, {})[name] = component
        pending += list(refs(component))
    for response in (r for op in _operations(paths) for r in op.get("responses", {}).values()):
        response.setdefault("description", "")  # required by OpenAPI; kept empty
    ordered = {kind: dict(sorted(items.items())) for kind, items in sorted(components.items())}
    return {
        "openapi": document["openapi"],
        "info": {"title": document["info"]["title"], "version": document["info"]["version"]},
        "paths": paths,
        "components": ordered,
    }


def _operations(paths: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in paths.values():
        yield from item.values()


# -- the Anthropic SDK's types, for what the description predates -------------------------------


def sdk_schemas() -> tuple[str, dict[str, Any]]:
    """JSON schemas of the official SDK's types the description lacks, named ``Sdk...``:
    the SDK's version and the schemas (references rewritten into the components)."""
    import anthropic
    from anthropic import types
    from pydantic import TypeAdapter

    wanted = {
        "SdkThinkingBlock": types.ThinkingBlock,
        "SdkRedactedThinkingBlock": types.RedactedThinkingBlock,
        "SdkThinkingDelta": types.ThinkingDelta,
        "SdkSignatureDelta": types.SignatureDelta,
        "SdkStopReason": types.StopReason,
        "SdkErrorObject": types.ErrorObject,
        "SdkThinkingConfigParam": types.ThinkingConfigParam,
        "SdkThinkingBlockParam": types.ThinkingBlockParam,
        "SdkRedactedThinkingBlockParam": types.RedactedThinkingBlockParam,
    }
    schemas: dict[str, Any] = {}
    for name, kind in wanted.items():
        schema = TypeAdapter(kind).json_schema(ref_template="#/components/schemas/Sdk{model}")
        for inner, definition in schema.pop("$defs", {}).items():
            schemas[f"Sdk{inner}"] = strip(definition)
        schemas[name] = strip(schema)
    return anthropic.__version__, schemas


def with_sdk_types(description: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Join the SDK's schemas to the unions of the description that lack them."""
    components = description["components"]["schemas"]
    components.update(schemas)

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def join(union: dict[str, Any], names: list[str]) -> None:
        union["oneOf"] = [*union["oneOf"], *(ref(name) for name in names)]
        union.pop("discriminator", None)  # the added members are told apart by `type`

    thinking_blocks = ["SdkThinkingBlock", "SdkRedactedThinkingBlock"]
    join(components["ContentBlock"], thinking_blocks)
    join(components["ContentBlockStartEvent"]["properties"]["content_block"], thinking_blocks)
    join(
        components["ContentBlockDeltaEvent"]["properties"]["delta"],
        ["SdkThinkingDelta", "SdkSignatureDelta"],
    )
    stop_reason = {"anyOf": [ref("SdkStopReason"), {"type": "null"}]}
    components["Message"]["properties"]["stop_reason"] = stop_reason
    components["MessageDelta"]["properties"]["stop_reason"] = stop_reason
    components["ErrorResponse"]["properties"]["error"] = ref("SdkErrorObject")
    components["CreateMessageParams"]["properties"]["thinking"] = ref("SdkThinkingConfigParam")
    for block in components["InputMessage"]["properties"]["content"]["anyOf"]:
        if block.get("type") == "array":
            join(block["items"], ["SdkThinkingBlockParam", "SdkRedactedThinkingBlockParam"])


# -- writing ----------------------------------------------------------------------------------


def write(path: Path, header: list[str], document: Any) -> None:
    text = yaml.dump(document, sort_keys=False, allow_unicode=True, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n".replace("# \n", "#\n") for line in header) + text)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vendor", choices=["openai", "anthropic"])
    parser.add_argument("--source", type=Path, required=True, help="a git checkout")
    parser.add_argument("--commit", default="HEAD", help="the revision to read (HEAD)")
    parser.add_argument("--file", help="the description's path in the checkout")
    parser.add_argument("--out", type=Path, help="where to write (the suite's copy)")
    args = parser.parse_args(argv)
    spec = OPENAI if args.vendor == "openai" else ANTHROPIC
    commit = git(args.source, "rev-parse", args.commit).strip()
    date = git(args.source, "show", "-s", "--format=%cs", commit).strip()
    candidates = [args.file] if args.file else [spec.get("file", "openapi.json"), "openapi.yaml"]
    name, document = read_document(args.source, commit, candidates)
    description = cut(document, spec["operations"], spec["schemas"])
    kept = ", ".join(f"{method.upper()} {path}" for path, method in spec["operations"])
    header = [
        f"The {args.vendor} API description, cut to what chat-pipeline's gateway serves.",
        f"Source: the GitHub repository {spec['repository']}, {name} at commit",
        f"  {commit} ({date}).",
        f"Kept: {kept}, the components they reference, and",
        f"  {', '.join(spec['schemas'])};",
        "  descriptions, summaries, titles, examples and x- extensions removed.",
    ]
    if args.vendor == "anthropic":
        version, schemas = sdk_schemas()
        with_sdk_types(description, schemas)
        header += [
            f"Added from the official anthropic SDK {version}'s types (pydantic's JSON schema),",
            "  what this description predates: the Sdk... schemas (thinking blocks and deltas,",
            "  stop reasons, error objects, the thinking parameter), joined to its unions.",
        ]
    header += [
        f"Re-cut from a newer revision: scripts/cut_api_description.py {args.vendor} \\",
        "  --source <checkout> [--commit <revision>]   (see docs/development.md)",
        "",
    ]
    write(args.out or DESCRIPTIONS / f"{args.vendor}.yaml", header, description)
    return 0


if __name__ == "__main__":
    sys.exit(main())
