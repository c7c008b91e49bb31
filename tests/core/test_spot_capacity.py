"""A spot pool at zero nodes is normal: feasibility judges what a pool can hold, not what it
holds now, so a spot-only job submitted while its pools are empty waits and runs when nodes
return."""

from __future__ import annotations

from broker.core.effects import split_reply
from broker.core.inputs import CYCLE, SubmitJob
from broker.core.machine import Machine
from schemas.agent import (
    CheckpointReport,
    NodeGone,
    NodeUpsert,
    WorkloadStatus,
)
from schemas.job import CheckpointSpec, SpotPolicy
from tests.core.helpers import NOW, nodes
from tests.core.spot_pools import SPOT_OK, Agent, dispatches, setup, spot_job


def test_spot_only_job_waits_for_an_empty_spot_pool_and_runs_when_nodes_return() -> None:
    m, agent = setup()
    reply, _ = split_reply(m.handle(SubmitJob(spot_job("wait-for-spot", replicas=2)), NOW + 2))
    assert reply.accepted, reply.error
    assert dispatches(m.handle(CYCLE, NOW + 3)) == []  # the on-demand node is not for it
    record = m.jobs["wait-for-spot"]
    assert record.state == "queued"
    codes = [r.code for r in m.reasons["wait-for-spot"]]
    assert codes == ["insufficient-capacity"], m.reasons["wait-for-spot"]

    # One spot node back is not enough for a 2-node gang; two are.
    agent.send(NodeUpsert(node=nodes("spot-back", "v100-spot", 1)[0]), now=NOW + 60)
    assert dispatches(m.handle(CYCLE, NOW + 61)) == []
    agent.send(NodeUpsert(node=nodes("spot-again", "v100-spot", 1)[0]), now=NOW + 120)
    sent = dispatches(m.handle(CYCLE, NOW + 121))
    assert [(d.job_id, d.flavor) for d in sent] == [("wait-for-spot", "v100-spot")]
    assert sorted(n for a in sent[0].assignment for n in a.nodes) == ["spot-again-0", "spot-back-0"]


def test_a_gang_bigger_than_the_pool_ever_was_is_still_rejected() -> None:
    m, _ = setup()
    reply, effects = split_reply(m.handle(SubmitJob(spot_job("too-big", replicas=3)), NOW + 2))
    assert not reply.accepted
    assert "never be placed" in (reply.error or "")
    assert effects == [] and "too-big" not in m.jobs
    reply, _ = split_reply(m.handle(SubmitJob(spot_job("too-wide", gpu=16)), NOW + 2))
    assert not reply.accepted


def lose_spot_node_under(m: Machine, agent: Agent, job_id: str, now: float) -> None:
    """Dispatch the job, let it run, then take its spot node away without warning."""
    sent = dispatches(m.handle(CYCLE, now))
    assert [(d.job_id, d.flavor) for d in sent] == [(job_id, "v100-spot")], sent
    d = sent[0]
    node = d.assignment[0].nodes[0]
    agent.send(
        WorkloadStatus(
            job_id=job_id,
            attempt=d.attempt,
            phase="running",
            running_replicas=1,
            total_replicas=1,
            nodes=[node],
        ),
        now=now + 1,
    )
    agent.send(NodeGone(node=node), now=now + 2)
    agent.send(NodeUpsert(node=nodes(f"{node}-new", "v100-spot", 1)[0]), now=now + 3)


def test_a_spot_job_without_progress_stops_retrying_by_its_policy() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    spec = spot_job("no-ckpt")
    reply, _ = split_reply(m.handle(SubmitJob(spec), NOW + 3))
    assert reply.accepted
    now = NOW + 10
    for _ in range(spec.spot.max_preemptions_without_progress or 0):
        assert m.jobs["no-ckpt"].state == "queued"
        lose_spot_node_under(m, agent, "no-ckpt", now)
        now += 1000  # past the lost pool's avoidance
    record = m.jobs["no-ckpt"]
    assert record.state == "failed"
    assert "no progress on spot" in (record.reason or "")
    assert "max_preemptions_without_progress=3" in (record.reason or "")
    assert dispatches(m.handle(CYCLE, now)) == []


def test_a_spot_then_on_demand_job_without_progress_falls_back() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    spec = spot_job(
        "fallback",
        capacity="spot-then-on-demand",
        spot=SpotPolicy(fallback_after_preemptions=100, max_preemptions_without_progress=2),
        labels=SPOT_OK,  # no checkpoint, spot is fine: without it the job is priced off spot
    )
    assert split_reply(m.handle(SubmitJob(spec), NOW + 3))[0].accepted
    now = NOW + 10
    for _ in range(2):
        lose_spot_node_under(m, agent, "fallback", now)
        now += 1000
    record = m.jobs["fallback"]
    assert record.state == "queued" and record.spot_exhausted
    sent = dispatches(m.handle(CYCLE, now))
    assert [(d.job_id, d.flavor) for d in sent] == [("fallback", "v100-od")]


def test_a_checkpoint_between_losses_resets_the_count() -> None:
    m, agent = setup()
    agent.send(NodeUpsert(node=nodes("spot-up", "v100-spot", 1)[0]), now=NOW + 2)
    spec = spot_job(
        "ckpt",
        checkpoint=CheckpointSpec(uri="s3://b/ckpt"),
        spot=SpotPolicy(max_preemptions_without_progress=2),
    )
    assert split_reply(m.handle(SubmitJob(spec), NOW + 3))[0].accepted
    now = NOW + 10
    for step in (100, 200, 300, 400):
        sent = dispatches(m.handle(CYCLE, now))
        assert len(sent) == 1, m.reasons.get("ckpt")
        d = sent[0]
        node = d.assignment[0].nodes[0]
        agent.send(
            WorkloadStatus(
                job_id="ckpt",
                attempt=d.attempt,
                phase="running",
                running_replicas=1,
                total_replicas=1,
                nodes=[node],
            ),
            CheckpointReport(
                job_id="ckpt", attempt=d.attempt, step=step, uri=f"s3://b/ckpt/{step}"
            ),
            now=now + 1,
        )
        agent.send(NodeGone(node=node), now=now + 2)
        agent.send(NodeUpsert(node=nodes(f"{node}-new", "v100-spot", 1)[0]), now=now + 3)
        now += 1000
    assert m.jobs["ckpt"].state == "queued"
    assert m.jobs["ckpt"].preemptions == 4
