"""`muster logs` end to end: the broker says where an attempt ran, that cluster's agent (the
fake backend) streams what the simulated workload printed, over a real nats-server."""

from __future__ import annotations

import pytest

from broker.client import MusterClient, MusterError
from broker.logs import read_logs
from schemas.agent import LogChunk
from schemas.codec import json_decoder
from schemas.natsopts import NatsOptions
from tests.ui.conftest import Live
from tests.world import sim_job

_chunk = json_decoder(LogChunk, "LogChunk")


async def _client(live: Live) -> MusterClient:
    h = live.world.harness
    return await MusterClient(NatsOptions(url=h.url), subjects=h.subjects).connect()


async def _all(client: MusterClient, job_id: str, **kw: object) -> list[str]:
    out: list[str] = []
    async for lines in read_logs(client, job_id, **kw):  # type: ignore[arg-type]
        out.extend(lines)
    return out


async def test_logs_follow_a_job_to_its_end(live: Live) -> None:
    h = live.world.harness
    client = await _client(live)
    try:
        job_id = (await h.submit(sim_job("logs", steps=200, every=20))).job_id
        await h.wait_event(job_id, "checkpointed", timeout=20)
        lines = await _all(client, job_id, tail_lines=5)
        assert lines[0].startswith("[worker-0] attempt 1 on ")
        assert any("checkpoint saved at step 20" in line for line in lines)
        assert len(lines) <= 5
        followed = await _all(client, job_id, follow=True, follow_s=60)
        assert followed[-1] == "[worker-0] exiting: succeeded"
        steps = [int(line.split()[2]) for line in followed if " step " in line and "loss" in line]
        assert steps == sorted(steps) and steps[-1] == 200
    finally:
        await client.close()


async def test_logs_of_each_attempt_across_a_spot_move_until_its_pods_are_gone(
    live: Live,
) -> None:
    h, fleet = live.world.harness, live.world.fleet
    assert fleet is not None
    client = await _client(live)
    try:
        job_id = (await h.submit(sim_job("moved", steps=4000, capacity="spot"))).job_id
        await h.wait_event(job_id, "checkpointed", timeout=20)
        first = live.reclaim(job_id, lead_s=600)
        await h.wait_event(job_id, "running", count=2, timeout=20)
        second = fleet.history(job_id)[-1]
        assert second.cluster != first.cluster
        now = await _all(client, job_id)
        assert now[0].startswith(f"[worker-0] attempt 2 on {second.nodes[0]}")
        assert f"starting from step {second.started_from_step}" in now[0]
        before = await _all(client, job_id, attempt=1, podset="worker", replica=0)
        assert before[-1].startswith("[worker-0] exiting: ")
        # The reclaimed node goes, and the first attempt's pods with it.
        fleet[first.cluster].remove_node(first.nodes[0], reason="spot-reclaimed")
        with pytest.raises(MusterError) as gone:
            await _all(client, job_id, attempt=1)
        assert f"cluster {first.cluster}" in str(gone.value) and "gone" in str(gone.value)
        # And when the whole cluster's agent is gone, the error names it.
        await fleet.runtimes[second.cluster].stop()
        with pytest.raises(MusterError) as silent:
            await _all(client, job_id)
        text = str(silent.value)
        assert f"attempt 2 of job {job_id}" in text and repr(second.cluster) in text
    finally:
        await client.close()


async def test_bad_log_requests_say_what_is_wrong(live: Live) -> None:
    h = live.world.harness
    client = await _client(live)
    try:
        with pytest.raises(MusterError, match="unknown job"):
            await _all(client, "no-such-job")
        job_id = (await h.submit(sim_job("bad", steps=4000))).job_id
        await h.wait_event(job_id, "running", timeout=20)
        with pytest.raises(MusterError, match="has no attempt 5; its attempts: 1"):
            await _all(client, job_id, attempt=5)
        with pytest.raises(MusterError, match="no such pod; its pods are: worker-0"):
            await _all(client, job_id, podset="ps")
        with pytest.raises(MusterError, match="tail_lines"):
            await _all(client, job_id, tail_lines=0)
        # Straight to the agent: garbage and oversized requests get an error chunk, no crash.
        cluster = live.world.fleet.history(job_id)[-1].cluster  # type: ignore[union-attr]
        for payload in (b"not json", b'{"job_id": "x"}', b"{" + b" " * 5000 + b"}"):
            msg = await h.nc.request(h.subjects.agent_logs(cluster), payload, timeout=5)
            chunk = _chunk(msg.data)
            assert chunk.eof and chunk.error
        assert await _all(client, job_id)  # the agent still serves
    finally:
        await client.close()
