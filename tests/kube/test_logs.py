"""The kube backend reads an attempt's container logs through the (stand-in) API server."""

from __future__ import annotations

from typing import Any

import pytest

from agents.backend import BackendError
from kinds.base import LABEL_ATTEMPT, LABEL_JOB, LABEL_PODSET
from schemas.agent import LogRequest
from tests.kube.conftest import NS, PODS, pod
from tests.kube.fake_apiserver import FakeApiServer


def _worker(index: int, attempt: int = 1) -> dict[str, Any]:
    return pod(
        f"job-1-{attempt}-worker-{index}",
        f"n{index}",
        namespace=NS,
        labels={
            LABEL_JOB: "job-1",
            LABEL_ATTEMPT: str(attempt),
            LABEL_PODSET: "worker",
            "batch.kubernetes.io/job-completion-index": str(index),
        },
    )


async def test_logs_of_each_replica_with_tail_and_gone_pods(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, _ = await make_backend()
    for i in (0, 1):
        apiserver.put(PODS, _worker(i))
        apiserver.pod_logs[(NS, f"job-1-1-worker-{i}")] = "".join(
            f"rank {i} step {s}\n" for s in range(1, 51)
        )
    tail = await backend.read_logs(LogRequest(job_id="job-1", attempt=1, tail_lines=3))
    assert tail.lines == [
        "[worker-0] rank 0 step 48",
        "[worker-0] rank 0 step 49",
        "[worker-0] rank 0 step 50",
        "[worker-1] rank 1 step 48",
        "[worker-1] rank 1 step 49",
        "[worker-1] rank 1 step 50",
    ]
    one = await backend.read_logs(
        LogRequest(job_id="job-1", attempt=1, podset="worker", replica=1, tail_lines=1)
    )
    assert one.lines == ["[worker-1] rank 1 step 50"]
    # limitBytes is passed on: the server cuts the body.
    small = await backend.read_logs(
        LogRequest(job_id="job-1", attempt=1, replica=0, tail_lines=50, limit_bytes=20)
    )
    assert small.lines == ["[worker-0] rank 0 step 1", "[worker-0] rank 0"]  # 20 bytes
    with pytest.raises(BackendError, match="attempt 2 of job job-1 on cluster c1: its pods"):
        await backend.read_logs(LogRequest(job_id="job-1", attempt=2))
    apiserver.remove(f"{PODS}/job-1-1-worker-0")
    with pytest.raises(BackendError, match="replica 0 are gone"):
        await backend.read_logs(LogRequest(job_id="job-1", attempt=1, replica=0))
    still = await backend.read_logs(LogRequest(job_id="job-1", attempt=1, tail_lines=1))
    assert still.lines == ["[worker-1] rank 1 step 50"]


async def test_the_stand_in_log_endpoint_refuses_as_the_real_one(
    apiserver: FakeApiServer,
) -> None:
    import aiohttp

    apiserver.put(PODS, _worker(0))
    async with aiohttp.ClientSession() as http:
        for query, code in (("tailLines=-1", 400), ("limitBytes=0", 400), ("tailLines=2", 200)):
            async with http.get(f"{apiserver.url}{PODS}/job-1-1-worker-0/log?{query}") as resp:
                assert resp.status == code, query
        async with http.get(f"{apiserver.url}{PODS}/nope/log") as resp:
            assert resp.status == 404
            assert (await resp.json())["reason"] == "NotFound"
