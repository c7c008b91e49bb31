"""The committed JSON Schema must match the Structs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import jsonschema


def test_committed_schema_is_current() -> None:
    committed = jsonschema.SCHEMA_PATH.read_text(encoding="utf-8")
    assert committed == jsonschema.render(), (
        "schemas/muster.schema.json is stale: run `python -m schemas.jsonschema` and commit it"
    )


def test_check_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "muster.schema.json"
    monkeypatch.setattr(jsonschema, "SCHEMA_PATH", target)
    assert jsonschema.main(["--check"]) == 1  # missing
    assert jsonschema.main([]) == 0
    assert jsonschema.main(["--check"]) == 0
    target.write_text(target.read_text().replace("JobSpec", "JobSpek", 1))
    assert jsonschema.main(["--check"]) == 1
    assert jsonschema.main(["--frobnicate"]) == 2


def test_schema_content() -> None:
    schema = json.loads(jsonschema.render())
    defs = schema["$defs"]
    for name in ("JobSpec", "PodSet", "SubmitReply", "JobEvent", "JobRef", "CancelRequest"):
        assert name in defs
    for name in ("JobReply", "JobListReply", "WhyReply", "QueueListReply", "ClusterListReply"):
        assert defs[name]["required"] == ["ok"]
    job = defs["JobSpec"]
    assert job["required"] == ["name"]
    assert job["properties"]["name"]["pattern"] == "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    assert defs["PodSet"]["properties"]["gpu"]["maximum"] == 64
    subjects = schema["x-muster-subjects"]
    assert subjects["muster.submit.<queue>"] == {
        "message": {"$ref": "#/$defs/JobSpec"},
        "reply": {"$ref": "#/$defs/SubmitReply"},
    }
    assert subjects["muster.api.list"]["reply"] == {"$ref": "#/$defs/JobListReply"}
    # every $ref points at a definition
    text = json.dumps(schema)
    for ref in {part.split('"')[0] for part in text.split('"$ref": "#/$defs/')[1:]}:
        assert ref in defs, ref
