"""Generate the JSON Schema of the client-facing messages into `schemas/muster.schema.json`.

    python -m schemas.jsonschema          # write the file
    python -m schemas.jsonschema --check  # exit 1 if the committed file is stale

Clients in other languages validate against it; `x-muster-subjects` says which type goes on
which subject. The file is generated from the Structs, so never edit it by hand.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas.api import (
    ApiReply,
    CancelRequest,
    ClusterView,
    Empty,
    JobEvent,
    JobRef,
    JobView,
    ListRequest,
    QueueView,
    SubmitReply,
    WhyView,
)
from schemas.job import JobSpec

SCHEMA_PATH = Path(__file__).with_name("muster.schema.json")
REF_TEMPLATE = "#/$defs/{name}"

# (subject pattern, request type, reply type); `None` = no reply on that subject.
_MESSAGES: list[tuple[str, Any, Any]] = [
    ("muster.submit.<queue>", JobSpec, SubmitReply),
    ("muster.events.job.<job_id>", JobEvent, None),
    ("muster.api.get", JobRef, ApiReply[JobView]),
    ("muster.api.list", ListRequest, ApiReply[list[JobView]]),
    ("muster.api.cancel", CancelRequest, ApiReply[JobView]),
    ("muster.api.why", JobRef, ApiReply[WhyView]),
    ("muster.api.queues", Empty, ApiReply[list[QueueView]]),
    ("muster.api.clusters", Empty, ApiReply[list[ClusterView]]),
]


# Readable names for the generic reply types (msgspec would call them
# `ApiReply_list_schemas.api.JobView__`).
_NAMES: list[tuple[Any, str]] = [
    (ApiReply[JobView], "JobReply"),
    (ApiReply[list[JobView]], "JobListReply"),
    (ApiReply[WhyView], "WhyReply"),
    (ApiReply[list[QueueView]], "QueueListReply"),
    (ApiReply[list[ClusterView]], "ClusterListReply"),
]


def _rename_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            k: (renames.get(v, v) if k == "$ref" else _rename_refs(v, renames))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rename_refs(v, renames) for v in node]
    return node


def _types() -> list[Any]:
    """Every distinct message type, in a stable order."""
    seen: list[Any] = []
    for _, request, reply in _MESSAGES:
        for t in (request, reply):
            if t is not None and t not in seen:
                seen.append(t)
    return seen


def build_schema() -> dict[str, Any]:
    """One JSON Schema document: every message type under `$defs`."""
    types = _types()
    refs, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    ref_of = {id(t): r for t, r in zip(types, refs, strict=True)}
    renames: dict[str, str] = {}
    for t, name in _NAMES:
        old = ref_of[id(t)]["$ref"]
        renames[old] = REF_TEMPLATE.format(name=name)
        components[name] = components.pop(old.rpartition("/")[2])
        ref_of[id(t)] = {"$ref": renames[old]}
    components = _rename_refs(components, renames)
    subjects: dict[str, dict[str, Any]] = {}
    for subject, request, reply in _MESSAGES:
        entry: dict[str, Any] = {"message": ref_of[id(request)]}
        if reply is not None:
            entry["reply"] = ref_of[id(reply)]
        subjects[subject] = entry
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://muster.dev/schemas/muster.schema.json",
        "title": "Muster client-facing messages",
        "description": (
            "JSON messages on the client-facing NATS subjects (default prefix `muster`). "
            "Generated from schemas/*.py by `python -m schemas.jsonschema`; do not edit."
        ),
        "anyOf": [ref_of[id(t)] for t in types],
        "x-muster-subjects": subjects,
        "$defs": components,
    }


def render() -> str:
    """The schema file's exact text (stable: sorted keys, two-space indent, final newline)."""
    return json.dumps(build_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in ([], ["--check"]):
        print("usage: python -m schemas.jsonschema [--check]", file=sys.stderr)
        return 2
    text = render()
    current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else None
    if args == ["--check"]:
        if current != text:
            print(
                f"{SCHEMA_PATH.name} is stale: run `python -m schemas.jsonschema` "
                "(or `make schema`) and commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    if current != text:
        SCHEMA_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {SCHEMA_PATH.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
