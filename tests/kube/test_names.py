"""Object names that cannot collide across jobs, and an agent that never adopts or deletes an
object that is not its attempt's, on the stand-in API server."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kinds.batch
from agents.backend import BackendError
from kinds.plan import id_digest, workload_name
from tests.kube.conftest import NS, gang_dispatch, node
from tests.kube.fake_apiserver import FakeApiServer

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
SERVICES = f"/api/v1/namespaces/{NS}/services"
VICTIM = "train-3f9c2a"  # a clean id: its objects are named after it


def old_name(job_id: str, attempt: int) -> str:
    """The scheme the attack broke: 24 bits of SHA-1 after a readable core."""
    slug = job_id.lower().replace("_", "-").strip("-")
    return f"{slug[:20].strip('-')}-{hashlib.sha1(job_id.encode()).hexdigest()[:6]}-a{attempt}"


def test_a_hashed_name_carries_80_bits_of_the_exact_id() -> None:
    odd = "Train_3F9C2A"  # not a clean DNS label: hashed
    name = workload_name(odd, 1)
    assert name == f"train-3f9c2a-{id_digest(odd)}-a1" and len(name) <= 40
    assert len(id_digest(odd)) == 16  # 80 bits: no brute force reaches a chosen name
    # What an attacker needs under the old scheme: a 6-hex suffix, found in seconds.
    assert len(old_name(odd, 1).rsplit("-", 2)[1]) == 6


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=80), st.text(min_size=1, max_size=80))
def test_distinct_ids_get_distinct_names(a: str, b: str) -> None:
    if a != b:
        assert workload_name(a, 1) != workload_name(b, 1)


async def test_a_colliding_name_is_refused_and_the_victims_objects_survive(
    apiserver: FakeApiServer, make_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in ("n1", "n2"):
        apiserver.put("/api/v1/nodes", node(n))
    backend, _ = await make_backend()
    await backend.dispatch(gang_dispatch(job_id=VICTIM, attempt=1))
    job = apiserver.get(f"{JOBS}/{VICTIM}-a1-worker")
    svc = apiserver.get(f"{SERVICES}/{VICTIM}-a1")
    assert job is not None and svc is not None
    # The attack: another team's id whose objects are named like the victim's (a collision
    # found by brute force under the old 24-bit scheme; forced here).
    attacker = "Train_3F9C2A_x"
    monkeypatch.setattr(
        kinds.batch,
        "workload_name",
        lambda job_id, attempt: workload_name(VICTIM if job_id == attacker else job_id, attempt),
    )
    with pytest.raises(BackendError, match="not this attempt's"):
        await backend.dispatch(gang_dispatch(job_id=attacker, attempt=1))
    await backend.cancel(attacker, None, "the attacker cancels its own job")
    kept_job = apiserver.get(f"{JOBS}/{VICTIM}-a1-worker")
    kept_svc = apiserver.get(f"{SERVICES}/{VICTIM}-a1")
    assert kept_job is not None and kept_svc is not None
    assert kept_job["metadata"]["uid"] == job["metadata"]["uid"]
    assert not kept_job["metadata"].get("deletionTimestamp")
    assert all(VICTIM not in path for path, _ in apiserver.deletes)


async def test_a_retried_dispatch_still_adopts_its_own_objects(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    for n in ("n1", "n2"):
        apiserver.put("/api/v1/nodes", node(n))
    backend, _ = await make_backend()
    odd = "Team_A_run-7"  # hashed name, sanitised label: the exact id is the annotation
    await backend.dispatch(gang_dispatch(job_id=odd, attempt=3))
    await backend.dispatch(gang_dispatch(job_id=odd, attempt=3))  # 409s: its own, adopted
    base = workload_name(odd, 3)
    assert apiserver.get(f"{JOBS}/{base}-worker") is not None
    # Another attempt of the same job under the same names is not adopted either.
    with pytest.raises(BackendError, match="not this attempt's"):
        job = apiserver.get(f"{JOBS}/{base}-worker")
        assert job is not None
        job["metadata"]["labels"]["muster.dev/attempt"] = "2"
        apiserver.put(JOBS, job)
        await backend.dispatch(gang_dispatch(job_id=odd, attempt=3))
