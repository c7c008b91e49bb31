"""End to end through the kube backend: the real broker, the real agent runtime with
`KubeBackend`, a real nats-server, and per cluster one stand-in Kubernetes API server
(`tests/kube/fake_apiserver.py`, validating every write; no real API server can be installed
here). The test plays the parts Kubernetes would: the Job controller creates the pods, the
scheduling helper (`tests/kube/scheduling.py`) binds them where a real scheduler would, the
kubelet runs them, the workload writes checkpoint annotations, and each cloud announces the
end of a spot node its own way. Everything between is Muster's own code.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.kube.backend import KubeBackend
from tests.e2e.kube_providers import (
    PROVIDERS,
    KubeCluster,
)
from tests.e2e.kube_providers import kube_world as kube_world  # the fixture, shared
from tests.kube.conftest import (
    rfc3339,
)
from tests.world import World


@pytest.mark.parametrize("kube_world", list(PROVIDERS), indirect=True)
async def test_spot_path_per_provider_resumes_from_checkpoint_on_another_cluster(
    kube_world: tuple[World, dict[str, KubeCluster]], request: pytest.FixtureRequest
) -> None:
    world, clusters = kube_world
    signal = PROVIDERS[request.node.callspec.params["kube_world"]][3]
    h = world.harness
    most_live = 0

    async def count_live_copies() -> None:
        """Samples the Jobs of ddp-1 across both API servers: never more than one at a time."""
        nonlocal most_live
        for _ in range(10_000):
            live = sum(
                1
                for c in clusters.values()
                for j in c.jobs()
                if j["metadata"]["name"].startswith("ddp-1-a")
            )
            most_live = max(most_live, live)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(count_live_copies())
    reply = await h.submit(
        {
            "name": "ddp",
            "job_id": "ddp-1",
            "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
            "capacity": "spot",
            "checkpoint": {"uri": "s3://ckpt"},  # the pods write below it
            "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
        }
    )
    assert reply.accepted, reply
    first = await h.wait_event("ddp-1", "running")
    home, away = (
        clusters[first.cluster or ""],
        clusters["west" if first.cluster == "east" else "east"],
    )
    (job,) = home.jobs()
    name = job["metadata"]["name"]
    assert name == "ddp-1-a1-worker" and job["spec"]["completions"] == 2

    # The workload checkpoints at step 120; the broker records it.
    home.write_checkpoint(name, 120)
    await h.wait_event("ddp-1", "checkpointed")

    # The cloud announces the end of the node under replica 0, its own way.
    node_name = home.pods_of(name)[0]["spec"]["nodeName"]
    await signal(home, node_name, name)
    await h.wait_event("ddp-1", "preempting")

    # The agent asks the pods to checkpoint now (annotation); the workload answers at 150.
    def asked() -> bool:
        pods = home.pods_of(name)
        return bool(pods) and all(
            "muster.dev/checkpoint-request" in p["metadata"].get("annotations", {}) for p in pods
        )

    await h.wait_for(asked, 5)  # fails with "condition not met" if CheckpointNow never came
    home.write_checkpoint(name, 150)

    # The next attempt runs on the other cluster, resumed from step 150, and only after the
    # first attempt's Job was deleted (never two live copies).
    admitted = await h.wait_event("ddp-1", "admitted", count=2)
    assert admitted.cluster == away.name and admitted.resume_from_step == 150
    second = await h.wait_event("ddp-1", "running", count=2)
    assert second.cluster == away.name and second.attempt == 2
    assert home.jobs() == [], "the first attempt's Job is still there"
    home.server.finish_terminating()  # the old pods' grace ends
    (job2,) = away.jobs()
    env = {
        e["name"]: e.get("value") for e in job2["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MUSTER_ATTEMPT"] == "2" and env["MUSTER_RESUME_STEP"] == "150"
    assert env["MUSTER_RESUME_FROM"] == "s3://ckpt/ddp-1-a1-worker/150"

    # The Job controller reports success; the broker finishes the job with its accounting.
    away.complete(job2["metadata"]["name"])
    done = await h.wait_event("ddp-1", "succeeded")
    assert done.accounting is not None and done.accounting.attempts == 2
    view = await world.job("ddp-1")
    assert view["state"] == "succeeded" and view["latest_checkpoint"]["step"] == 150
    sampler.cancel()
    assert most_live == 1
    assert not home.server.rejected and not away.server.rejected  # every write was valid


async def test_blips_end_no_attempt_but_not_ready_past_grace_does(
    kube_world: tuple[World, dict[str, KubeCluster]],
) -> None:
    """A device-plugin restart (8 -> 0 -> 8 within 30 s) and a NotReady of 10 s take the node
    out of new placements at most; NotReady past the grace (120 s here) loses the replicas only
    once the node is tainted out-of-service, and the job moves on. The agent's clock is
    driven: no test waits 30 s."""
    world, clusters = kube_world
    h = world.harness
    reply = await h.submit(
        {
            "name": "ddp",
            "job_id": "blip-1",
            "gang": [{"name": "worker", "replicas": 2, "gpu": 4}],
            "capacity": "spot",
            "workload": {"image": "trainer:1", "command": ["torchrun", "train.py"]},
        }
    )
    assert reply.accepted, reply
    first = await h.wait_event("blip-1", "running")
    home = clusters[first.cluster or ""]
    backend = home.runtime.backend
    assert isinstance(backend, KubeBackend)
    node_name = home.pods_of("blip-1-a1-worker")[0]["spec"]["nodeName"]
    assert h.broker is not None
    scheduler = h.broker.machine.scheduler

    def broker_node() -> Any:
        return scheduler.cluster_states()[home.name].nodes[node_name]

    def set_gpus(n: dict[str, Any], count: int) -> None:
        n["status"]["allocatable"]["nvidia.com/gpu"] = str(count)

    # GPU Operator upgrade: the device plugin restarts, allocatable 8 -> 0 -> 8 in 29 s.
    home.change_node(node_name, lambda n: set_gpus(n, 0))
    await h.wait_for(lambda: backend.node_signals()[node_name].dip_since is not None)
    home.clock.advance(29)
    backend.evaluate_timers()
    home.change_node(node_name, lambda n: set_gpus(n, 8))
    await h.wait_for(lambda: backend.node_signals()[node_name].dip_since is None)

    # NotReady for 10 s: the node takes no new pods meanwhile, then is back.
    def ready(n: dict[str, Any], status: str) -> None:
        n["status"]["conditions"][0].update(
            status=status, lastTransitionTime=rfc3339(home.clock.now)
        )

    home.change_node(node_name, lambda n: ready(n, "False"))
    await h.wait_for(lambda: broker_node().no_new_pods and broker_node().ready, 5)
    home.clock.advance(10)
    backend.evaluate_timers()
    home.change_node(node_name, lambda n: ready(n, "True"))
    await h.wait_for(lambda: not broker_node().no_new_pods, 5)
    assert h.kinds("blip-1").count("running") == 1
    assert not {"preempting", "requeued", "failed"} & set(h.kinds("blip-1"))

    # NotReady past the grace period proves nothing (a partitioned node keeps running its
    # containers) until the node is declared shut down: then the replicas are lost.
    home.change_node(node_name, lambda n: ready(n, "False"))
    await h.wait_for(lambda: broker_node().no_new_pods, 5)
    home.clock.advance(121)
    backend.evaluate_timers()
    assert broker_node().ready and h.kinds("blip-1").count("admitted") == 1

    def out_of_service(n: dict[str, Any]) -> None:
        n["spec"]["taints"] = [
            {"key": "node.kubernetes.io/out-of-service", "value": "x", "effect": "NoExecute"}
        ]

    home.change_node(node_name, out_of_service)
    again = await h.wait_event("blip-1", "admitted", count=2)
    assert again.attempt == 2
    assert "node" in ((await h.wait_event("blip-1", "requeued")).reason or "")
