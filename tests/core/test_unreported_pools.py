"""Capacity not yet seen: a pool that has never held a node (every spot zone empty at start,
a node pool scaled to zero) is judged by the size its agent declares, and when it declares none
it is not judged at all. A spot-only job submitted then waits for capacity; it is refused as
"can never be placed" only when it exceeds what the pool declares it can reach."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Send, split_reply
from broker.core.inputs import SubmitJob
from schemas.agent import ClusterSnapshot, Dispatch, FlavorInfo, NodeInfo, NodeUpsert
from schemas.job import JobSpec, PodSet
from tests.core.harness import Sim

SPOT = FlavorInfo(name="spot", capacity_type="spot", gpu_type="V100", price_per_gpu_hour=0.9)
OD = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="V100", price_per_gpu_hour=3.0)


def node(name: str, flavor: str) -> NodeInfo:
    return NodeInfo(name=name, flavor=flavor, gpu=8, cpu_milli=64_000, memory=2**40)


def fleet(spot: FlavorInfo) -> Sim:
    """One cluster: an on-demand node, and a spot pool that has not held a node yet."""
    s = Sim(())
    s.send("east", ClusterSnapshot(flavors=[spot, OD], nodes=[node("od-0", "od")]))
    return s


def submit(s: Sim, replicas: int) -> Any:
    spec = JobSpec(
        name="spotty", capacity="spot", gang=[PodSet(name="w", replicas=replicas, gpu=8)]
    )
    reply, _ = split_reply(s.m.handle(SubmitJob(spec, subject_queue="q"), s.now))
    return reply


def test_a_spot_only_job_waits_for_a_pool_that_has_not_reported_nodes_yet() -> None:
    s = fleet(SPOT)
    reply = submit(s, replicas=2)
    assert reply.accepted, reply.error
    s.step(1)
    assert s.m.jobs[reply.job_id].state == "queued"
    codes = [r.code for r in s.m.reasons[reply.job_id]]
    assert codes == ["insufficient-capacity"], s.m.reasons[reply.job_id]
    # The zone comes up: the job runs there.
    s.send("east", NodeUpsert(node=node("spot-0", "spot")), NodeUpsert(node=node("spot-1", "spot")))
    sent = [e.command for e in s.step(1) if isinstance(e, Send) and isinstance(e.command, Dispatch)]
    assert [(d.job_id, d.flavor) for d in sent] == [(reply.job_id, "spot")]


def test_a_declared_size_judges_a_pool_before_its_nodes_come() -> None:
    declared = FlavorInfo(
        name="spot",
        capacity_type="spot",
        gpu_type="V100",
        price_per_gpu_hour=0.9,
        max_nodes=2,
        node_gpu=8,
    )
    s = fleet(declared)
    assert submit(s, replicas=2).accepted  # 2 x 8 GPUs: the declared size holds it
    too_big = submit(s, replicas=3)
    assert not too_big.accepted
    assert "never be placed" in (too_big.error or "")
