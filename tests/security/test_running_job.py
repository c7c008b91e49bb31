"""A real broker and two real agents (fake clusters) behind the generated authorization, each
party on its own credentials, and one team's job running. Whoever is not that job's owner, its
cluster's agent or its attempt's workload tries to move its progress, hear its checkpoint
requests or read its logs, and is refused by NATS or by the broker with nothing changed."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from rich.console import Console

from agents.fake.cluster import FakeCluster
from agents.runtime import AgentRuntime
from agents.sdk import Checkpointer, SdkEnv
from broker.client import MusterClient, MusterError
from broker.logs import read_logs, stream_chunks
from broker.service import Broker
from broker.top import TopView, run_top
from schemas.agent import CheckpointReport, LogRequest
from schemas.api import JobEvent
from shell.natsio import flush
from tests.agents.conftest import fast_config
from tests.e2e.conftest import sim_job
from tests.security.conftest import AuthNats, client_as, options_as, overhear
from tests.support import wait_for

LOCATION = "s3://ckpt/guarded"
PACE = 5.0  # steps per second the job declares


@dataclass
class Running:
    server: AuthNats
    broker: Broker
    job_id: str
    cluster: str
    clusters: dict[str, FakeCluster]
    alpha: MusterClient
    events: list[JobEvent]

    async def wait(self, pred: Any, timeout: float = 10.0) -> None:
        try:
            await wait_for(pred, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; events: {self.events}") from None

    def kinds(self, kind: str) -> list[JobEvent]:
        return [e for e in self.events if e.kind == kind]


@pytest_asyncio.fixture
async def running(auth_nats: AuthNats, broker: Broker) -> AsyncIterator[Running]:
    runtimes: list[AgentRuntime] = []
    clusters: dict[str, FakeCluster] = {}
    for name in ("east", "west"):
        nc = await nats.connect(**options_as(auth_nats, f"agent-{name}").connect_kwargs())
        auth_nats.conns.append(nc)
        clusters[name] = FakeCluster(name, fast_config())
        rt = AgentRuntime(clusters[name], nc, heartbeat_s=0.2, batch_interval_s=0.005)
        await rt.start()
        runtimes.append(rt)
    alpha = await client_as(auth_nats, "team-alpha", "alpha")
    events: list[JobEvent] = []

    async def on_event(msg: Any) -> None:
        events.append(msgspec.json.decode(msg.data, type=JobEvent))

    spec = sim_job("guarded", steps=10**6, rate=1.0, every=10**6)
    spec["checkpoint"] = {"uri": LOCATION, "max_steps_per_s": PACE}
    spec["job_id"] = "guarded-1"
    await alpha.nc.subscribe("muster.events.team.alpha.guarded-1", cb=on_event)
    await flush(alpha.nc)
    job_id = (await alpha.submit(spec, queue="vision")).job_id
    state = Running(auth_nats, broker, job_id, "", clusters, alpha, events)
    try:
        await state.wait(lambda: state.kinds("running"))
        state.cluster = state.kinds("running")[0].cluster or ""
        yield state
    finally:
        await alpha.close()
        for rt in runtimes:
            await rt.stop()


def _workload(r: Running, token: str) -> Checkpointer:
    """The attempt's SDK as its pod runs it: the shared `workload` user, a token, no inbox."""
    host = r.server.url.removeprefix("nats://")
    env = SdkEnv(
        job_id=r.job_id,
        attempt=1,
        checkpoint_uri=LOCATION,
        nats_url=f"nats://workload:pw-workload@{host}",
        checkpoint_token=token,
    )
    return Checkpointer(env)


async def test_only_the_attempts_own_workload_moves_its_progress(running: Running) -> None:
    r = running
    own = r.broker.attempt_token(r.job_id, 1)
    stolen = r.broker.attempt_token("another-job", 1)  # what another job's pods hold
    liar = next(c for name, c in r.clusters.items() if name != r.cluster)
    before = r.broker.refused["checkpoint"]
    # Another job's workload, and one with no token: refused by the broker.
    for token in (stolen, ""):
        ck = _workload(r, token)
        try:
            assert await asyncio.to_thread(ck.report_checkpoint, 3) == "nats"
        finally:
            await asyncio.to_thread(ck.close)
    await r.wait(lambda: r.broker.refused["checkpoint"] == before + 2)
    # The cluster the job does not run on, inside its own (real, authenticated) batch.
    liar.emit(
        CheckpointReport(job_id=r.job_id, attempt=1, step=4, uri=f"{LOCATION}/step-4", at=1.0)
    )
    await r.wait(lambda: len(r.kinds("checkpoint-refused")) == 1)
    # The attempt's own workload, jumping far beyond the pace the job declared.
    ck = _workload(r, own)
    try:
        ck.on_checkpoint_request(sigterm=False)  # hears nothing over NATS, and asks nothing
        assert await asyncio.to_thread(ck.report_checkpoint, 10**9) == "nats"
        await r.wait(lambda: len(r.kinds("checkpoint-refused")) == 2)
        assert r.broker.machine is not None
        assert r.broker.machine.jobs[r.job_id].latest_checkpoint is None
        reasons = [e.reason or "" for e in r.kinds("checkpoint-refused")]
        assert f"cluster {liar.cluster!r} reported" in reasons[0], reasons
        assert "max_steps_per_s" in reasons[1], reasons
        # ... and its honest report is taken.
        assert await asyncio.to_thread(ck.report_checkpoint, 0) == "nats"
        await r.wait(lambda: r.kinds("checkpointed"))
    finally:
        await asyncio.to_thread(ck.close)
    latest = r.broker.machine.jobs[r.job_id].latest_checkpoint
    assert latest is not None and (latest.step, latest.uri) == (0, f"{LOCATION}/step-0")
    assert r.server.errors.get("workload", []) == []
    assert r.broker.refused["checkpoint"] == before + 2


async def test_a_workload_hears_no_checkpoint_requests(running: Running) -> None:
    """Requests go from the agent to the attempt's own pods only (podinfo file, pod
    annotation): NATS carries none, and the shared workload user may subscribe to nothing."""
    r = running
    spy = await r.server.connect("workload")
    wanted = (
        f"muster.checkpoint_request.{r.job_id}",
        "muster.checkpoint_request.*",
        "muster.>",
        ">",
        "_INBOX_workload.>",
        "_INBOX.>",
    )
    heard = await overhear(spy, wanted)
    east = await r.server.connect("agent-east")
    await east.publish(f"muster.checkpoint_request.{r.job_id}", b'{"deadline": 1}')
    await flush(east)
    # The broker asks the job's cluster for a checkpoint (a spot notice on its node).
    cluster = r.clusters[r.cluster]
    cluster.spot_notice(cluster.history[r.job_id][-1].nodes[0])
    await r.wait(lambda: r.kinds("checkpointed"), timeout=20)  # the request was carried out
    await flush(spy)
    assert heard == []
    refused = [str(e) for e in r.server.errors["workload"]]
    assert len(refused) == len(wanted), refused
    assert all("permissions violation for subscription" in e for e in refused), refused
    assert any("muster.checkpoint_request" in str(e) for e in r.server.errors["agent-east"])


async def _lines(client: MusterClient, job_id: str) -> list[str]:
    out: list[str] = []
    async for lines in read_logs(client, job_id, tail_lines=5):
        out.extend(lines)
    return out


async def test_a_team_reads_only_its_own_jobs_logs(running: Running) -> None:
    r = running
    beta = await client_as(r.server, "team-beta", "beta")
    admin = await client_as(r.server, "admin")
    try:
        mine = await _lines(r.alpha, r.job_id)
        assert mine and mine[0].startswith("[worker-0] attempt 1 on ")
        assert (await _lines(admin, r.job_id))[0] == mine[0]
        # Through the broker, as itself: the job is not its own.
        req = LogRequest(job_id=r.job_id, attempt=1)
        with pytest.raises(MusterError, match="unknown job 'guarded-1'"):
            async for _ in stream_chunks(beta.nc, beta.subjects, r.cluster, req, team="beta"):
                pass
        with pytest.raises(MusterError, match="unknown job"):
            await _lines(beta, r.job_id)
        # Straight to the agent: NATS refuses the publish, so the agent never hears it.
        raw: Client = await r.server.connect("team-beta")
        with pytest.raises(MusterError, match="does not answer"):
            async for _ in stream_chunks(raw, beta.subjects, r.cluster, req, first_s=0.5):
                pass
        # Under another team's name: NATS refuses that too.
        await raw.publish("muster.api.alpha.logs", b"{}", reply=raw.new_inbox())
        await flush(raw)
        refused = [str(e) for e in r.server.errors.get("team-beta", [])]
        assert any(f"muster.agent.{r.cluster}.logs" in e for e in refused), refused
        assert any("muster.api.alpha.logs" in e for e in refused), refused
    finally:
        await beta.close()
        await admin.close()


async def test_log_requests_of_a_team_are_checked_before_any_agent_hears_them(
    running: Running,
) -> None:
    """Bad attempts and malformed requests are answered by the broker with the reason."""
    r = running
    req = LogRequest(job_id=r.job_id, attempt=7)
    with pytest.raises(MusterError, match="has no attempt 7; its attempts: 1"):
        async for _ in stream_chunks(r.alpha.nc, r.alpha.subjects, "west", req, team="alpha"):
            pass
    inbox = r.alpha.nc.new_inbox()
    sub = await r.alpha.nc.subscribe(inbox)
    await r.alpha.nc.publish("muster.api.alpha.logs", b'{"job_id": 5}', reply=inbox)
    answer = await sub.next_msg(timeout=5)
    assert b'"eof":true' in answer.data and b"LogRequest" in answer.data


async def test_a_team_sees_only_its_own_jobs_in_top(running: Running) -> None:
    r = running
    beta = await client_as(r.server, "team-beta", "beta")
    theirs = (await beta.submit(sim_job("theirs", steps=10**6, rate=1.0), queue="speech")).job_id
    assert r.broker.machine is not None
    machine = r.broker.machine
    await r.wait(lambda: machine.jobs[theirs].current is not None)
    view = TopView()
    screen = Console(file=io.StringIO(), width=200)
    task = asyncio.create_task(run_top(r.alpha, screen, min_interval_s=0.05, view=view))
    try:
        await r.wait(lambda: [j.job_id for j in view.busiest] == [r.job_id])
        await beta.cancel(theirs)
        await r.alpha.cancel(r.job_id)
        await r.wait(lambda: view.events >= 1 and view.busiest == [])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await beta.close()
    assert view.error is None
    assert view.events == len(r.kinds("cancelled")) == 1  # its own job's event, not beta's


async def test_the_broker_does_its_whole_job_within_its_permissions(running: Running) -> None:
    """The broker's publish rights are its subjects, its JetStream and KV, and the inboxes it
    answers (not `>`): a job's whole life, spot move included, needs nothing more."""
    r = running
    cluster = r.clusters[r.cluster]
    cluster.spot_notice(cluster.history[r.job_id][-1].nodes[0])
    await r.wait(lambda: len(r.kinds("running")) == 2, timeout=20)  # resumed elsewhere
    view = await r.alpha.get(r.job_id)
    assert view.attempt == 2
    await r.alpha.why(r.job_id)
    await r.alpha.cancel(r.job_id, "done")
    await r.wait(lambda: r.kinds("cancelled"))
    assert r.server.errors.get("broker", []) == []
