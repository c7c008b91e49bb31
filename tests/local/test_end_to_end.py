"""Real training through Muster: a real nats-server, the real broker, two `local` agents and
the pure-Python SGD trainer. A spot notice moves the job; it resumes from the exact saved step
and ends with the same model, bit for bit, as a run never interrupted. A restarted agent
adopts its replicas; one gone too long has them fenced before the job starts elsewhere."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest_asyncio

from agents.config import AgentConfig, LocalClusterConfig, LocalFlavor, LocalNode
from agents.local.backend import LocalBackend
from agents.main import Fleet, start_fleet
from agents.runtime import AgentRuntime
from schemas.codec import decode_job_event
from schemas.subjects import Subjects
from tests.broker.conftest import Harness, broker_config
from tests.local.conftest import PY, REPO, group_alive

SGD = REPO / "examples" / "sgd_train.py"
STEPS = 300


@dataclass
class Reference:
    final: str  # the last checkpoint file, byte for byte
    losses: set[str]  # its `step N loss X` lines


def reference_run(tmp: Path, steps: int = STEPS) -> Reference:
    """The same trainer and seed, never interrupted, outside Muster."""
    env = {**os.environ, "MUSTER_CHECKPOINT_URI": str(tmp / "reference")}
    env.pop("MUSTER_RESUME_FROM", None)
    out = subprocess.run(
        [PY, str(SGD), "--steps", str(steps), "--checkpoint-every", "50"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return Reference((tmp / "reference" / f"step-{steps}").read_text(), loss_lines(out.stdout))


def loss_lines(log: str) -> set[str]:
    return {ln for ln in log.splitlines() if ln.startswith("step ")}


def sgd_job(name: str, ckpt: Path, *, step_time: float = 0.01) -> dict[str, Any]:
    return {
        "name": name,
        "gang": [{"name": "worker", "replicas": 1, "gpu": 1}],
        "capacity": "spot",
        "checkpoint": {"uri": str(ckpt)},
        "restart": {"backoff_s": 0.1},
        "workload": {
            "command": [PY, str(SGD)],
            "args": [
                "--steps",
                str(STEPS),
                "--checkpoint-every",
                "50",
                "--step-time",
                str(step_time),
            ],
        },
    }


def local_agent(name: str, workdir: Path, prefix: str, price: float) -> AgentConfig:
    return AgentConfig(
        cluster=name,
        backend="local",
        heartbeat_s=0.2,
        subject_prefix=prefix,
        local=LocalClusterConfig(
            workdir=str(workdir),
            flavors=[
                LocalFlavor(
                    name="spot",
                    capacity_type="spot",
                    price_per_gpu_hour=price,
                    nodes=[LocalNode(gpu=1)],
                    grace_s=2.0,
                )
            ],
            poll_s=0.05,
        ),
    )


@dataclass
class Lab:
    harness: Harness
    tmp: Path
    fleet: Fleet | None = None
    configs: dict[str, AgentConfig] = field(default_factory=dict)
    extra: list[AgentRuntime] = field(default_factory=list)

    async def start(self) -> Fleet:
        h = self.harness
        await h.start_broker()
        self.configs = {
            "a": local_agent("a", self.tmp / "agents", h.prefix, 1.0),
            "b": local_agent("b", self.tmp / "agents", h.prefix, 1.5),
        }
        self.fleet = await start_fleet(h.nc, list(self.configs.values()), h.subjects)
        for name in self.configs:
            await h.wait_for(lambda name=name: h.synced(name))  # type: ignore[misc]
        return self.fleet

    def backend(self, cluster: str) -> LocalBackend:
        assert self.fleet is not None
        return self.fleet.local[cluster]

    async def restart_agent(self, cluster: str) -> LocalBackend:
        """A new agent process for `cluster`: a new backend over the same work directory."""
        cfg = self.configs[cluster]
        backend = LocalBackend(cluster, cfg.local)
        rt = AgentRuntime(backend, self.harness.nc, subjects=self.harness.subjects, heartbeat_s=0.2)
        await rt.start()
        self.extra.append(rt)
        return backend

    async def log_has(self, cluster: str, job_id: str, attempt: int, text: str) -> None:
        path = self.tmp / "agents" / cluster / job_id / f"attempt-{attempt}" / "rank-0.log"
        async with asyncio.timeout(30):
            while not (path.exists() and text in path.read_text()):
                await asyncio.sleep(0.05)

    def log(self, cluster: str, job_id: str, attempt: int) -> str:
        path = self.tmp / "agents" / cluster / job_id / f"attempt-{attempt}" / "rank-0.log"
        return path.read_text()

    async def stop(self) -> None:
        for rt in self.extra:
            await rt.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        for d in (self.tmp / "agents").glob("*"):  # leave no replica behind
            b = LocalBackend(d.name, self.configs[d.name].local)
            b._adopt_orphans()
            for job_id, attempt in b.live_workloads():
                await b.cancel(job_id, attempt, "test over")


@pytest_asyncio.fixture
async def lab(nats_url: str, tmp_path: Path) -> AsyncIterator[Lab]:
    prefix = f"l{uuid.uuid4().hex[:10]}"
    nc = await nats.connect(nats_url)
    config = broker_config(prefix, lost_after_s=4.0, fence_lead_s=2.0, checkpoint_grace_s=10.0)
    h = Harness(nats_url, prefix, Subjects(prefix=prefix), config, nc)

    async def on_event(msg: Any) -> None:
        event = decode_job_event(msg.data)
        h.events[event.job_id].append(event)
        h._changed.set()

    await nc.subscribe(h.subjects.job_events_all, cb=on_event)
    world = Lab(h, tmp_path)
    yield world
    await world.stop()
    await h.stop_broker()
    await nc.close()


async def test_spot_notice_moves_real_training_and_it_ends_bit_for_bit_equal(lab: Lab) -> None:
    reference = reference_run(lab.tmp)
    await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("sgd", ckpt))).job_id
    first = await h.wait_event(job_id, "admitted", timeout=15)
    assert first.cluster == "a"  # the cheaper spot pool
    await lab.log_has("a", job_id, 1, "checkpoint step 100 ")
    a = lab.backend("a")
    pids = a.pids(job_id, 1)
    a.spot_notice(a.nodes_of("spot")[0], lead_s=30)
    second = await h.wait_event(job_id, "admitted", count=2, timeout=20)
    assert second.cluster == "b"
    saved = second.resume_from_step
    assert saved is not None and saved > 100  # saved on request, not the last periodic one
    assert f"checkpoint step {saved} " in lab.log("a", job_id, 1)
    await h.wait_event(job_id, "succeeded", timeout=60)
    resumed = lab.log("b", job_id, 2)
    assert resumed.startswith(f"resumed from step {saved} ({ckpt}/step-{saved})")
    assert f"checkpoint step {saved} " not in resumed  # no step before it was redone
    assert (ckpt / f"step-{STEPS}").read_text() == reference.final
    # The loss curve continues where it left off: every step logged after the move logs
    # the loss the uninterrupted run had at that step.
    after = loss_lines(resumed)
    assert f"step {STEPS} loss" in "".join(after) and after <= reference.losses
    assert loss_lines(lab.log("a", job_id, 1)) <= reference.losses
    assert not any(group_alive(p) for p in pids)  # the first copy is gone
    assert [e.kind for e in h.events[job_id]].count("admitted") == 2


async def test_a_restarted_agent_adopts_its_replica_and_the_job_finishes_once(lab: Lab) -> None:
    reference = reference_run(lab.tmp)
    fleet = await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("adopt", ckpt, step_time=0.02))).job_id
    await lab.log_has("a", job_id, 1, "checkpoint step 50 ")
    pids = lab.backend("a").pids(job_id, 1)
    await fleet.runtimes["a"].stop()  # the agent goes away; the replica keeps training
    assert all(group_alive(p) for p in pids)
    await lab.restart_agent("a")  # back well before the broker would declare it lost
    await h.wait_event(job_id, "succeeded", timeout=60)
    assert [e.kind for e in h.events[job_id]].count("admitted") == 1
    assert (ckpt / f"step-{STEPS}").read_text() == reference.final


async def test_an_agent_gone_too_long_has_its_replica_fenced_before_the_job_moves(
    lab: Lab,
) -> None:
    reference = reference_run(lab.tmp)
    fleet = await lab.start()
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    job_id = (await h.submit(sgd_job("fence", ckpt, step_time=0.03))).job_id
    await lab.log_has("a", job_id, 1, "checkpoint step 50 ")
    pids = lab.backend("a").pids(job_id, 1)
    await fleet.runtimes["a"].stop()
    second = await h.wait_event(job_id, "admitted", count=2, timeout=30)
    assert second.cluster == "b"
    assert not any(group_alive(p) for p in pids)  # fenced before the broker moved the job
    assert "fence lapsed" in lab.log("a", job_id, 1)
    restarted = await lab.restart_agent("a")
    await h.wait_event(job_id, "succeeded", timeout=60)
    assert restarted.live_workloads() == []
    assert (ckpt / f"step-{STEPS}").read_text() == reference.final
    resumed = lab.log("b", job_id, 2)
    assert resumed.startswith(f"resumed from step {second.resume_from_step} ")
