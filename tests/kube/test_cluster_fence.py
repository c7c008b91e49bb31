"""Fences that never kill healthy work, on Kubernetes with the fence watchdog on and the
shipped timeouts: a restarted agent adopts every kind, an API-server outage of ten minutes
and an agent restart of minutes end nothing, and a hung agent's attempts still end by the
cluster's own hand. The agent side runs through the runtime's own paths (`adopt` of a
snapshot after a restart, `acknowledged` for each broker acknowledgement); time is the
injected clock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from agents.kube.client import KubeApiError, KubeRest
from agents.kube.watchdog import FenceWatchdog, WatchdogConfig
from agents.runtime import AgentRuntime
from schemas.agent import Applied
from schemas.config import Timeouts
from tests.kube.conftest import NS, Clock, gang_dispatch, manifest_dispatch
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.manifests import JOBSET_YAML, PYTORCHJOB_YAML, VOLCANO_YAML

RAYJOB_YAML = (Path(__file__).parents[2] / "examples" / "jobs" / "rayjob.yaml").read_text()
# The window the broker grants with its shipped defaults (Dispatch.fence_after_s).
WINDOW_S = Timeouts().lost_after_s - Timeouts().fence_lead_s
SKEW_S = 2.0
RENEW_EVERY_S = 5.0  # simulated time between broker acknowledgements in these tests

KINDS = {
    "pytorchjob": PYTORCHJOB_YAML,
    "jobset": JOBSET_YAML,
    "rayjob": RAYJOB_YAML,
    "volcano": VOLCANO_YAML,
}


class Acks:
    """Broker acknowledgements as the runtime receives them: an Applied for a batch that left
    at the test clock's `now`."""

    def __init__(self, runtime: AgentRuntime) -> None:
        self.runtime = runtime
        self.seq = 0
        runtime.instance = "agent-1"

    async def ack(self, now: float) -> None:
        self.seq += 1
        await self.runtime.acknowledged(Applied(epoch=1, instance="agent-1", seq=self.seq), now)


def objects_of(backend: Any, key: tuple[str, int]) -> list[str]:
    objects = backend.attempt_objects(*key)
    return [f"{c}/{n}" for c, n in objects if not c.endswith("/services")]


def alive(server: FakeApiServer, path: str) -> bool:
    obj = server.get(path)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return False
    conditions = (obj.get("status") or {}).get("conditions") or []
    return not any(c.get("type") == "Failed" and c.get("status") == "True" for c in conditions)


def watchdog_of(api_client: Any, clock: Clock) -> FenceWatchdog:
    config = msgspec.convert({"namespace": NS, "skew_s": SKEW_S}, WatchdogConfig)
    return FenceWatchdog(KubeRest(api_client), config, clock=clock)


def test_the_shipped_window_is_minutes() -> None:
    """A control-plane upgrade (about ten minutes) fits inside the fence window."""
    assert WINDOW_S >= 600 + 60


@pytest.mark.parametrize("kind", [*KINDS, "indexed-job"])
async def test_a_restarted_agent_keeps_every_kind_alive(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any, nc: Client, kind: str
) -> None:
    clock = Clock(time.time())  # the stand-in stamps creationTimestamp from the wall clock
    apiserver.run_job_controller(clock)
    first, _ = await make_backend(clock=clock, fence_watchdog=True)
    cmd = (
        gang_dispatch("j1", 1)
        if kind == "indexed-job"
        else manifest_dispatch(KINDS[kind], job_id="j1", attempt=1)
    )
    await first.dispatch(msgspec.structs.replace(cmd, fence_after_s=WINDOW_S))
    paths = objects_of(first, ("j1", 1))
    assert paths and all(alive(apiserver, p) for p in paths)
    await first.stop()

    clock.advance(300)  # the agent is away five minutes (a rollout with its initial lists)
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    runtime = AgentRuntime(backend, nc)
    runtime.adopt(await backend.snapshot())
    assert runtime.live_attempts("j1") == {1}
    acks = Acks(runtime)
    watchdog = watchdog_of(api_client, clock)
    for _ in range(int(2 * WINDOW_S / RENEW_EVERY_S)):  # healthy for twice the window
        await acks.ack(clock.now)
        assert await watchdog.sweep() == 0
        clock.advance(RENEW_EVERY_S)
    assert all(alive(apiserver, p) for p in paths), kind

    # Hung from here: once the window and the skew have passed, the cluster ends it.
    clock.advance(WINDOW_S + SKEW_S)
    assert await watchdog.sweep() >= 1
    assert not any(alive(apiserver, p) for p in paths)
    assert apiserver.rejected == []


async def test_an_api_server_outage_of_ten_minutes_ends_no_attempt(
    apiserver: FakeApiServer, make_backend: Any, api_client: Any, nc: Client
) -> None:
    clock = Clock(time.time())
    apiserver.run_job_controller(clock)
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    runtime = AgentRuntime(backend, nc)
    for cmd in (
        manifest_dispatch(PYTORCHJOB_YAML, job_id="pt", attempt=1),
        gang_dispatch("gang", 1),
    ):
        await backend.dispatch(msgspec.structs.replace(cmd, fence_after_s=WINDOW_S))
        runtime.adopt(await backend.snapshot())
    paths = objects_of(backend, ("pt", 1)) + objects_of(backend, ("gang", 1))
    acks = Acks(runtime)
    watchdog = watchdog_of(api_client, clock)
    await acks.ack(clock.now)

    apiserver.down = True  # ten minutes: the broker still acknowledges, the API server refuses
    for _ in range(int(600 / RENEW_EVERY_S)):
        clock.advance(RENEW_EVERY_S)
        await acks.ack(clock.now)
        with pytest.raises(KubeApiError):
            await watchdog.sweep()
    apiserver.down = False

    for _ in range(3):
        clock.advance(RENEW_EVERY_S)
        await acks.ack(clock.now)
        assert await watchdog.sweep() == 0
    apiserver.enforce_job_deadlines()
    assert all(alive(apiserver, p) for p in paths)
    assert runtime.live_attempts("pt") == {1} and runtime.live_attempts("gang") == {1}


async def test_fence_writes_do_not_grow_with_the_attempts(
    apiserver: FakeApiServer, make_backend: Any, nc: Client
) -> None:
    """One Lease per cluster: a renewal costs one write however many attempts run."""
    clock = Clock(time.time())
    backend, _ = await make_backend(clock=clock, fence_watchdog=True)
    runtime = AgentRuntime(backend, nc)
    for i in range(20):
        cmd = manifest_dispatch(PYTORCHJOB_YAML, job_id=f"pt-{i}", attempt=1)
        await backend.dispatch(msgspec.structs.replace(cmd, fence_after_s=WINDOW_S))
    runtime.adopt(await backend.snapshot())
    acks = Acks(runtime)
    before = len(apiserver.patches)
    minutes = 5
    for _ in range(int(minutes * 60 / RENEW_EVERY_S)):
        clock.advance(RENEW_EVERY_S)
        await acks.ack(clock.now)
    writes = len(apiserver.patches) - before
    assert 0 < writes <= minutes * 60 / backend.fence_state.step_s + 1
    assert {p for p, _, _ in apiserver.patches[before:]} == {
        f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/muster-fence"
    }


def test_the_shipped_broker_config_grants_the_schema_defaults() -> None:
    """deploy/ and schemas agree, so the arithmetic in docs/kubernetes.md holds as shipped."""
    from broker.config import parse_config
    from tests.kube.deploy_tree import configmap_data

    shipped = parse_config(
        configmap_data("muster-broker-config", "broker.yaml"), source="deploy"
    ).config.timeouts
    assert (shipped.lost_after_s, shipped.fence_lead_s) == (
        Timeouts().lost_after_s,
        Timeouts().fence_lead_s,
    )
    assert shipped.fence_window_s == WINDOW_S
