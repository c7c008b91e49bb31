"""A workload reports checkpoints straight to the broker; only with its own attempt's token
(MUSTER_CHECKPOINT_TOKEN, handed out in the Dispatch) is the report taken. Another job's
replicas, which hold a different token, cannot move this job's progress."""

from __future__ import annotations

from schemas.agent import CheckpointReport, Dispatch
from schemas.codec import encode_json
from shell.natsio import flush
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import next_item


async def test_a_workload_reports_only_with_its_own_attempts_token(harness: Harness) -> None:
    h = harness
    broker = await h.start_broker()
    agent = await h.agent("c1")
    ckpt = {"checkpoint": {"uri": "s3://x"}}
    victim = (await h.submit(job("victim", replicas=1, gpu=8, **ckpt))).job_id
    intruder = (await h.submit(job("intruder", replicas=1, gpu=8, **ckpt))).job_id
    sent: dict[str, Dispatch] = {}
    while len(sent) < 2:
        d = await next_item(agent.dispatches)
        sent[d.job_id] = d
    await h.wait_event(victim, "running")
    token, stolen = sent[victim].checkpoint_token, sent[intruder].checkpoint_token
    assert token and stolen and token != stolen
    assert broker.machine is not None
    before = broker.refused["checkpoint"]

    async def report(step: int, with_token: str) -> None:
        uri = f"s3://x/attempt-1/{step}"
        body = CheckpointReport(job_id=victim, attempt=1, step=step, uri=uri)
        body.token = with_token
        await h.nc.publish(h.subjects.checkpoint(victim), encode_json(body))
        await flush(h.nc)

    await report(10**9, stolen)
    await report(10**9, "")
    await h.wait_for(lambda: broker.refused["checkpoint"] == before + 2)
    assert broker.machine.jobs[victim].latest_checkpoint is None
    await report(30, token)
    await h.wait_event(victim, "checkpointed")
    latest = broker.machine.jobs[victim].latest_checkpoint
    assert latest is not None and latest.step == 30
    assert broker.refused["checkpoint"] == before + 2
