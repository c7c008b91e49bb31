"""Commands that reach a restarting agent while it is still reading its cluster (after it
subscribed to the command subject, before its first snapshot is learnt), sent over a real
nats-server to an agent on the kube stand-in: a revision of an adopted elastic attempt is a
resize, a plain Dispatch runs and a Cancel ends the attempt, as outside that window; and a
command whose wait outlasts the broker's ack wait is refused, not left unanswered."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client

from agents.kube.backend import KubeBackend
from agents.runtime import HOLD_MAX_S, AgentRuntime
from schemas.agent import Cancel, CommandAck, Dispatch
from tests.agents.helpers import HeldFirstSnapshot, sent_while_starting
from tests.kube.conftest import NOW, Recorder, make_config
from tests.kube.elastic import elastic_dispatch, load_fixture
from tests.kube.fake_apiserver import FakeApiServer

PYTORCHJOBS = ("kubeflow.org/v1", "pytorchjobs")


async def _four_workers(api_client: Any) -> dict[str, Any]:
    """The agent that created the elastic attempt (4 workers) is gone; its object stays."""
    manifest = load_fixture("pytorchjob-elastic-spot.yaml")
    first = KubeBackend("c1", make_config(), api_client=api_client, clock=lambda: NOW)
    await first.start(Recorder())
    await first.dispatch(elastic_dispatch(manifest, {"worker": 4}))
    await first.stop()
    return manifest


async def _sent_in_the_window(
    api_client: Any, nc: Client, cmd: Dispatch | Cancel, *, release: bool = True
) -> tuple[CommandAck, AgentRuntime]:
    """A restarted agent on the stand-in, `cmd` sent while it reads its cluster."""
    backend = KubeBackend("c1", make_config(), api_client=api_client, clock=lambda: NOW)
    runtime = AgentRuntime(backend, nc)
    ack = await sent_while_starting(runtime, HeldFirstSnapshot(backend), cmd, release=release)
    return ack, runtime


async def test_a_resize_sent_while_the_restarted_agent_reads_its_cluster_is_not_lost(
    apiserver: FakeApiServer, api_client: Any, nc: Client
) -> None:
    manifest = await _four_workers(api_client)
    revision = elastic_dispatch(manifest, {"worker": 3}, revision=1)
    ack, runtime = await _sent_in_the_window(api_client, nc, revision)
    assert ack == CommandAck(ok=True)
    (job,) = apiserver.items(*PYTORCHJOBS)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert runtime.live_attempts("j-1") == {1}
    creates = [p for m, p, _ in apiserver.requests if m == "POST" and p.endswith("/pytorchjobs")]
    assert len(creates) == 1  # the first agent's; the revision created nothing


async def test_a_dispatch_sent_while_the_restarted_agent_reads_its_cluster_runs(
    apiserver: FakeApiServer, api_client: Any, nc: Client
) -> None:
    manifest = await _four_workers(api_client)
    fresh = elastic_dispatch(manifest, {"worker": 2}, job_id="j-2")
    ack, runtime = await _sent_in_the_window(api_client, nc, fresh)
    assert ack == CommandAck(ok=True)
    made = {j["metadata"]["name"]: j for j in apiserver.items(*PYTORCHJOBS)}
    assert set(made) == {"j-1-a1", "j-2-a1"}
    assert made["j-2-a1"]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert made["j-1-a1"]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    assert runtime.live_attempts("j-2") == {1}
    assert runtime.live_attempts("j-1") == {1}


async def test_a_cancel_sent_while_the_restarted_agent_reads_its_cluster_ends_the_attempt(
    apiserver: FakeApiServer, api_client: Any, nc: Client
) -> None:
    await _four_workers(api_client)
    cancel = Cancel(job_id="j-1", epoch=1, attempt=1, reason="user cancel")
    ack, runtime = await _sent_in_the_window(api_client, nc, cancel)
    assert ack == CommandAck(ok=True)
    assert apiserver.items(*PYTORCHJOBS) == []
    assert runtime.live_attempts("j-1") == set()


async def test_a_command_held_past_the_ack_wait_is_refused_and_not_carried_out(
    apiserver: FakeApiServer, api_client: Any, nc: Client
) -> None:
    """The first snapshot outlasts the hold: the broker hears a refusal that says why in time
    to act on it, and the resize is not half-done behind its back."""
    manifest = await _four_workers(api_client)
    revision = elastic_dispatch(manifest, {"worker": 3}, revision=1)
    ack, _ = await _sent_in_the_window(api_client, nc, revision, release=False)
    assert not ack.ok and not ack.job_only
    assert "has not read its cluster yet" in ack.error
    assert f"first snapshot took over {HOLD_MAX_S} s" in ack.error
    assert "fix its access to the cluster" in ack.error
    (job,) = apiserver.items(*PYTORCHJOBS)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
