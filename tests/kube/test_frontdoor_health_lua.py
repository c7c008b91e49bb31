"""The Argo CD health check docs/kubernetes.md documents, run in a real Lua (lupa) as Argo CD
runs it: `obj` is the resource, the script returns a table with `status` and `message`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from agents.kube.frontdoor import ANN_MESSAGE, ANN_STATE, CONDITION

lupa = pytest.importorskip("lupa")
DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def script() -> str:
    text = DOC.read_text()
    block = re.search(
        r"resource\.customizations\.health\.kubeflow\.org_PyTorchJob: \|\n(.*?)```", text, re.S
    )
    assert block is not None, "the health check is gone from docs/kubernetes.md"
    return "\n".join(line[2:] for line in block.group(1).splitlines())


def health(obj: dict[str, Any]) -> tuple[str, str]:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(script())
    return str(hs["status"]), str(hs["message"])


def with_condition(reason: str, status: str = "False") -> dict[str, Any]:
    condition = {"type": CONDITION, "status": status, "reason": reason, "message": "m"}
    other = {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"}
    return {"metadata": {}, "status": {"conditions": [other, condition]}}


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("Running", "Healthy"),
        ("Succeeded", "Healthy"),
        ("Queued", "Progressing"),
        ("Admitted", "Progressing"),
        ("Preempting", "Progressing"),
        ("Failed", "Degraded"),
        ("Rejected", "Degraded"),
        ("QueueNotAllowed", "Degraded"),
        ("Cancelled", "Suspended"),
    ],
)
def test_the_condition_decides_the_health(reason: str, expected: str) -> None:
    assert health(with_condition(reason)) == (expected, f"{reason}: m")


def test_kinds_without_the_condition_are_read_from_the_annotations() -> None:
    job = {"metadata": {"annotations": {ANN_STATE: "Running", ANN_MESSAGE: "on west"}}}
    assert health(job) == ("Healthy", "Running: on west")


def test_nothing_from_muster_yet_is_progressing() -> None:
    assert health({"metadata": {}})[0] == "Progressing"
