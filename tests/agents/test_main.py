"""Entry points: run_agent / run_fleet until cancelled, over a real nats-server."""

from __future__ import annotations

import asyncio
import gc
import socket

import aiohttp
import pytest
from nats.aio.client import Client

from agents.config import AgentConfig, make_fleet_configs
from agents.fleet import build_backend, run_agent, run_fleet, start_fake_fleet
from agents.main import main
from schemas.agent import ClusterSnapshot
from schemas.natsopts import NatsOptions
from tests.agents.conftest import fast_config
from tests.agents.helpers import BrokerWire, unique


async def test_run_agent_until_cancelled(nc: Client, nats_url: str) -> None:
    cfg = AgentConfig(cluster=unique("m"), backend="fake", heartbeat_s=0.05, fake=fast_config())
    wire = await BrokerWire(nc, cfg.cluster).start()
    task = asyncio.create_task(run_agent(cfg, NatsOptions(url=nats_url)))
    try:
        snap = await wire.wait_snapshot(timeout=5)
        assert len(snap.nodes) == 8
        await wire.wait_for(lambda: len(wire.batches) >= 3)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wire.stop()


async def test_run_fleet_shares_one_connection(nc: Client, nats_url: str) -> None:
    """As `muster agent` runs it: the process's cycle collector paced (shell/gcpacing.py)
    while the fleet runs, and nothing left frozen after."""
    gc.unfreeze()
    cfgs = make_fleet_configs(3, fast_config(), prefix=unique("mf"), heartbeat_s=0.05)
    wires = [await BrokerWire(nc, c.cluster).start() for c in cfgs]
    task = asyncio.create_task(run_fleet(cfgs, NatsOptions(url=nats_url), pace_gc=True))
    try:
        for w in wires:
            await w.wait_snapshot(timeout=5)
        assert gc.get_freeze_count() > 0
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for w in wires:
            await w.stop()
    assert gc.get_freeze_count() == 0


async def test_start_fake_fleet_rejects_kube(nc: Client) -> None:
    cfg = AgentConfig(cluster="k", backend="kube", kube={})
    with pytest.raises(ValueError, match="fake clusters only"):
        await start_fake_fleet(nc, [cfg])


async def test_fleet_snapshot_and_resync_by_subject_prefix(nc: Client) -> None:
    from schemas.agent import Resync
    from schemas.subjects import Subjects

    subjects = Subjects(prefix="acme.muster")
    cfgs = make_fleet_configs(1, fast_config(), prefix=unique("px"), subject_prefix="acme.muster")
    wire = await BrokerWire(nc, cfgs[0].cluster, subjects).start()
    fleet = await start_fake_fleet(nc, cfgs)
    try:
        await wire.wait_snapshot()
        assert (await wire.send(Resync(epoch=0))).ok
        await wire.wait_for(lambda: len(wire.events(ClusterSnapshot)) >= 2)
    finally:
        await fleet.stop()
        await wire.stop()


def test_build_backend_fake() -> None:
    cfg = AgentConfig(cluster="b", backend="fake", fake=fast_config())
    backend = build_backend(cfg)
    assert backend.cluster == "b"


async def test_metrics_port_from_the_config_serves_until_cancelled(
    nc: Client, nats_url: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = AgentConfig(
        cluster=unique("mm"),
        backend="fake",
        heartbeat_s=0.05,
        fake=fast_config(),
        metrics_port=port,
    )
    wire = await BrokerWire(nc, cfg.cluster).start()
    task = asyncio.create_task(run_agent(cfg, NatsOptions(url=nats_url)))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        await wire.wait_snapshot(timeout=5)
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        assert f'muster_agent_runtime_total{{cluster="{cfg.cluster}",counter="snapshots"}}' in text
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wire.stop()
    with pytest.raises(aiohttp.ClientConnectionError):  # closed with the agent
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            await resp.read()


def test_metrics_port_out_of_range_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", "unused.yaml", "--metrics-port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "Invalid value for '--metrics-port'" in err and "65535" in err
