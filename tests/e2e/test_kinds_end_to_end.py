"""One gang of every job kind end to end through the kube backend: the real broker, the real
agent runtime with `KubeBackend`, a real nats-server and per cluster one stand-in API server.

The test plays the operator, the scheduler and the kubelet: for every object Muster creates it
makes the pods the kind's controller would make from the written templates, binds them with the
scheduler stand-in (tests/kube/scheduling.py, so the pinning must really admit the nodes), and
runs them. Then: a checkpoint, a spot notice, the resume on the other cluster, and the kind's
own success status. Every object the agent wrote must pass the offline API-server validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kinds.base import ANN_CHECKPOINT_REQUEST, LABEL_TOP
from kinds.podgroup import group_pods
from tests.e2e.kinds_world import (
    EXAMPLE_FILES,
    POD_GROUP,
    KubeCluster,
    run_on_spot,
)
from tests.e2e.kinds_world import kube_world as kube_world  # the fixture, shared
from tests.world import World


def _first_job(path: Path) -> dict[str, Any]:
    """The file's job; for the pod-group file, the group as the broker gathers it."""
    docs = list(yaml.safe_load_all(path.read_text()))
    if len(docs) == 1:
        return dict(docs[0])
    groups, _ = group_pods(docs)
    return groups[0]


@pytest.mark.parametrize("path", [*EXAMPLE_FILES, POD_GROUP], ids=lambda p: p.stem)
async def test_every_kind_runs_is_moved_by_a_spot_notice_and_succeeds(
    kube_world: tuple[World, dict[str, KubeCluster]], path: Path
) -> None:
    world, clusters = kube_world
    h = world.harness
    job_id = f"{path.stem}-1"
    manifest = _first_job(path)
    home, away = await run_on_spot(world, clusters, manifest, job_id)
    if manifest["kind"] != "List":
        ((_, obj),) = home.workloads()
        original = obj["metadata"]["annotations"]["muster.dev/original-name"]
        assert original == manifest["metadata"]["name"]
    home.write_checkpoint(job_id, 120)
    await h.wait_event(job_id, "checkpointed")

    home.reclaim_pool()
    await h.wait_event(job_id, "preempting")

    def asked() -> bool:
        pods = home.pods(job_id)
        return bool(pods) and all(
            ANN_CHECKPOINT_REQUEST in p["metadata"]["annotations"] for p in pods
        )

    await h.wait_for(asked, 5)
    home.write_checkpoint(job_id, 150)
    admitted = await h.wait_event(job_id, "admitted", count=2)
    assert admitted.cluster == away.name and admitted.resume_from_step == 150
    second = await h.wait_event(job_id, "running", count=2)
    assert second.cluster == away.name and second.attempt == 2
    assert home.workloads() == [], "the first attempt's object is still there"
    # Pods Muster created itself are deleted (they may stay Terminating for their grace).
    assert not [
        p
        for p in home.pods(job_id)
        if LABEL_TOP in p["metadata"]["labels"] and not p["metadata"].get("deletionTimestamp")
    ]

    away.succeed()
    done = await h.wait_event(job_id, "succeeded")
    assert done.accounting is not None and done.accounting.attempts == 2
    assert home.refused == [] and away.refused == []
