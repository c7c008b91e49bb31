"""Chaos soak: short jobs through a real nats-server, a real broker process and fake agent
processes, while seeded faults strike at random points.

Faults: `kill -9` of the broker and of nats-server (restarted on the same store), SIGSTOP/
SIGCONT of an agent, a partition (an agent stops publishing and answering), spot notices, a
JetStream store filled to its limit for a while, and poison messages on the submit and agent
subjects. A broker that exits on its own is counted and restarted, as a supervisor would.

Checks, from the wire and from the agents' own records (each agent process writes the history
of its workloads): every accepted job reaches a terminal state, no job runs to completion
twice (but for the at-least-once case, counted apart as `rerun_after_unheard_success`: a
success inside a freeze or partition longer than `lost_after_s`, with the rerun made before
the agent was heard again), never two live copies of a job, every queue's usage back to
zero, and the broker leading at the end. Everything binds 127.0.0.1; counts and time are bounded.

    python -m load.chaos --jobs 60 --seed 1            # about two minutes
    python -m load.chaos --jobs 1000 --faults 40 --duration-s 900   # the long form
    python -m load.chaos --jobs 40 --long-outages 4 --duration-s 900  # outages of minutes
    python -m load.chaos --nats-cluster --seed 1     # three nats-servers, R3 streams

With `--long-outages N` the broker runs with fence windows of minutes (re-dispatch after
300 s of silence, a 240 s fence) and N outages of 60 s to `--long-outage-s` (an agent frozen
or partitioned, the broker or nats-server down) strike among the other faults; jobs run for
minutes. Every outage is shorter than the fence, so no attempt may end by its fence
("nothing healthy fenced"); the result always counts the attempts a fence ended.

With `--nats-cluster` NATS is three servers (`load/natscluster.py`) and every stream R3: the
`nats` fault kills one member at random with SIGKILL, and one time in three wipes its store
before the restart (a lost volume, which R3 must survive), as the `nats-wipe` count shows. The
full-store fault is left out there: each member's store is bounded at 1 GB.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import nats
import typer

from broker.embedded import EmbeddedNats, nats_server_binary
from load.command import program, summary
from load.common import BrokerProcess
from load.natscluster import NatsCluster
from schemas.agent import (
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    Resync,
)
from schemas.api import TERMINAL_STATES
from schemas.codec import decode_command, encode_msgpack
from schemas.config import (
    BrokerConfig,
    FlavorQuota,
    Limits,
    QueueConfig,
    Replication,
    ResourceQuota,
    SchedulingConfig,
    Timeouts,
)
from schemas.subjects import Subjects
from shell.natsio import submit_request

FAULTS = ("broker", "nats", "freeze", "partition", "spot", "store-full", "poison")
# Outages of minutes (`--long-outages`), run with fence windows of minutes (`soak_config`).
LONG_FAULTS = ("long-freeze", "long-partition", "long-broker", "long-nats")
LONG_LOST_AFTER_S = 300.0
LONG_FENCE_LEAD_S = 60.0  # a 240 s fence: every long outage (at most --long-outage-s) is shorter
# Bad actors, opt-in with --only: an agent flooding its own subject with valid snapshots, a
# tenant filling the job bucket, a cluster that acknowledges dispatches and runs nothing.
# While each acts, the others' API latency is measured (`hostile_latency_ms`).
HOSTILE = ("storm", "tenant-flood", "black-hole")
QUEUES = ("team-a", "team-b")
PREFIX = "muster"
STORE_LIMIT = "256MB"
WAVE = 6  # jobs submitted while a black hole is up


# ---------------------------------------------------------------------------- processes


class NatsProc(EmbeddedNats):
    """nats-server with a bounded JetStream file store, so it can be filled."""

    def start_sync(self, timeout: float = 10.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            "max_payload: 8MB\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))}, "
            f"max_file_store: {STORE_LIMIT}, max_memory_store: 64MB }}\n"
        )
        self.extra_args = []
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        raise RuntimeError(f"nats-server did not listen on 127.0.0.1:{self.port}")


class AgentProc:
    """One fake cluster's agent in its own process (`python -m load.chaos agent`)."""

    def __init__(self, cluster: str, url: str, workdir: Path, seed: int) -> None:
        self.cluster = cluster
        self.records = workdir / f"{cluster}.records.json"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "load.chaos", "agent",
                "--cluster", cluster, "--nats", url,
                "--records", str(self.records), "--seed", str(seed),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.stopped = False

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def history(self) -> list[dict[str, Any]]:
        try:
            return list(json.loads(self.records.read_text()))
        except (OSError, ValueError):
            return []


# ---------------------------------------------------------------------------- agent side


async def connect(url: str, **options: Any) -> Any:
    """A connection to one server, or to every member of a cluster (`url` comma-separated),
    reconnecting for ever."""
    return await nats.connect(
        servers=url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2, **options
    )


async def _agent_main(cluster: str, url: str, records: Path, seed: int) -> None:
    """A fake cluster behind the real agent runtime, plus signal hooks for the soak:
    SIGUSR1 toggles a partition, SIGUSR2 gives a spot notice to a busy spot node."""
    from agents.config import AgentConfig, FakeClusterConfig, FakeFlavor
    from agents.fleet import start_fleet

    rng = random.Random(seed)
    cfg = AgentConfig(
        cluster=cluster,
        backend="fake",
        fake=FakeClusterConfig(
            flavors=[
                FakeFlavor(name="spot", capacity_type="spot", price_per_gpu_hour=1.0, nodes=3),
                FakeFlavor(name="od", capacity_type="on-demand", price_per_gpu_hour=3.0, nodes=2),
            ],
            spot_notice_s=4.0,
            start_delay_s=0.3,
            seed=seed,
        ),
    )
    holder: dict[str, Any] = {}

    async def reconnected() -> None:
        if "fleet" in holder:
            await holder["fleet"].on_reconnected()

    nc = await connect(url, reconnected_cb=reconnected)
    fleet = await start_fleet(nc, [cfg])
    holder["fleet"] = fleet
    fake = fleet[cluster]
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def toggle_partition() -> None:
        fake.outage(not fake.partitioned)

    def spot() -> None:
        busy = sorted({n for (j, a) in fake.live_workloads() for n in _nodes_of(fake, j, a)})
        spot_nodes = [n for n in busy if n.startswith(f"{cluster}-spot") or "spot" in n]
        if spot_nodes:
            fake.spot_notice(rng.choice(spot_nodes))

    loop.add_signal_handler(signal.SIGUSR1, toggle_partition)
    loop.add_signal_handler(signal.SIGUSR2, spot)
    loop.add_signal_handler(signal.SIGTERM, done.set)

    def dump() -> None:
        rows = [
            {
                "cluster": cluster,
                "job_id": job_id,
                "attempt": r.attempt,
                "created_at": r.created_at,
                "running_at": r.running_at,
                "ended_at": r.ended_at,
                "end_phase": r.end_phase,
                "reason": r.reason,
            }
            for job_id, recs in fake.history.items()
            for r in recs
        ]
        tmp = records.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.replace(records)

    try:
        while not done.is_set():
            dump()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.25)
    finally:
        dump()
        with contextlib.suppress(Exception):
            await fleet.stop()
        with contextlib.suppress(Exception):
            await nc.close()


def _nodes_of(fake: Any, job_id: str, attempt: int) -> list[str]:
    st = fake.workload(job_id, attempt)
    return list(st.nodes) if st is not None else []


# ---------------------------------------------------------------------------- the soak


def soak_config(long_windows: bool = False, replicas: int = 1) -> BrokerConfig:
    config = msgspec.structs.replace(_soak_config(), replication=Replication(replicas=replicas))
    if long_windows:
        timeouts = msgspec.structs.replace(
            config.timeouts, lost_after_s=LONG_LOST_AFTER_S, fence_lead_s=LONG_FENCE_LEAD_S
        )
        config = msgspec.structs.replace(config, timeouts=timeouts)
    if "limits" in BrokerConfig.__struct_fields__:
        # Streams reserve their max_bytes in the store: keep the reservations well inside it,
        # so that filling the rest exhausts the store without blocking the broker's start.
        limits = msgspec.structs.replace(
            config.limits,
            submit_stream_max_bytes=64 * 2**20,
            jobs_bucket_max_bytes=96 * 2**20,
        )
        config = msgspec.structs.replace(config, limits=limits)
    if "team_store_max_bytes" in Limits.__struct_fields__:
        # A team's share well inside the bucket, so a flooding tenant meets its own limit.
        limits = msgspec.structs.replace(config.limits, team_store_max_bytes=24 * 2**20)
        timeouts = msgspec.structs.replace(config.timeouts, dispatch_report_s=5.0)
        config = msgspec.structs.replace(config, limits=limits, timeouts=timeouts)
    return config


def _soak_config() -> BrokerConfig:
    q = ResourceQuota
    return BrokerConfig(
        subject_prefix=PREFIX,
        queues=[
            QueueConfig(
                name="team-a",
                cohort="ml",
                quotas=[FlavorQuota(flavor="spot", resources={"gpu": q(nominal=24)}),
                        FlavorQuota(flavor="od", resources={"gpu": q(nominal=16)})],
            ),
            QueueConfig(
                name="team-b",
                cohort="ml",
                quotas=[FlavorQuota(flavor="spot", resources={"gpu": q(nominal=24)}),
                        FlavorQuota(flavor="od", resources={"gpu": q(nominal=16)})],
            ),
        ],
        timeouts=Timeouts(
            heartbeat_s=0.5,
            unreachable_after_s=4.0,
            lost_after_s=12.0,
            dispatch_ack_s=1.0,
            dispatch_retries=2,
            start_s=30.0,
            checkpoint_grace_s=4.0,
            lease_ttl_s=2.0,
            fence_lead_s=5.0,
        ),
        scheduling=SchedulingConfig(preemption_min_runtime_s=5.0)
        if "preemption_min_runtime_s" in SchedulingConfig.__struct_fields__
        else SchedulingConfig(),
    )  # fmt: skip


POISON: tuple[bytes, ...] = (
    b'{"name": "p", "gang": [{"name": "w", "replicas": "\xc2\xb2", "gpu": 1}]}',
    b"\xff\xfe not json",
    b'{"name": "p", "gang": [{"name": "w", "replicas": 1, "gpu": [1, 2]}]}',
    b'{"name": "p", "workload": {"manifest": {"kind": "PyTorchJob", "spec": '
    b'{"pytorchReplicaSpecs": {"Worker": {"replicas": "\xc2\xb2"}}}}}}',
    b'{"name": "p", "gang": [{"name": "w", "replicas": 1, "gpu": ' + b"9" * 5000 + b"}]}",
)


@dataclass
class Soak:
    jobs: int
    seed: int
    faults: int
    duration_s: float
    kinds: tuple[str, ...] = FAULTS
    clusters: int = 3
    verbose: bool = False
    long_outages: int = 0  # outages of minutes, each shorter than the fence window
    long_outage_s: float = 120.0
    nats_cluster: bool = False  # three servers and R3 streams instead of one server
    out: dict[str, Any] = field(default_factory=dict)

    def say(self, *parts: object) -> None:
        if self.verbose:
            print(f"[{time.monotonic() - self.t0:7.1f}s]", *parts, file=sys.stderr, flush=True)

    async def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        rng = random.Random(self.seed)
        self.rng = rng
        tmp = tempfile.TemporaryDirectory(prefix="muster-chaos-")
        work = Path(tmp.name)
        self.nats: NatsProc | None = None
        self.cluster: NatsCluster | None = None
        if self.nats_cluster:
            self.cluster = NatsCluster()
            self.cluster.start_all()
            await self.cluster.ready()
            url = self.cluster.url
        else:
            self.nats = NatsProc(store_dir=work / "js")
            self.nats.start_sync()
            url = self.nats.url
        config = soak_config(self.long_outages > 0, replicas=3 if self.nats_cluster else 1)
        self.lost_after_s = config.timeouts.lost_after_s
        self.broker = BrokerProcess(url, config, state_dir=work)
        self.agents: dict[str, AgentProc] = {}
        self.silenced: list[tuple[str, float, float]] = []  # (cluster, from, to): frozen or cut
        self.stats: Counter[str] = Counter()
        self.subjects = Subjects(prefix=PREFIX)
        self.events: dict[str, list[str]] = {}
        self.latency: dict[str, list[float]] = {}
        t0 = time.monotonic()
        try:
            self.broker.start()
            self.nc = await connect(url)
            await self.broker.wait_leading(self.nc)
            self.say("broker leading")
            await self.nc.subscribe(f"{PREFIX}.events.job.>", cb=self._on_event)
            for i in range(self.clusters):
                name = f"c{i}"
                self.agents[name] = AgentProc(name, url, work, self.seed * 100 + i)
            ids = await self._submit_all()
            self.ids = ids  # faults may add jobs (a black hole's wave); all are checked
            self.say("submitted", len(ids))
            plan = sorted(
                (rng.uniform(2.0, self.duration_s * 0.6), rng.choice(self.kinds))
                for _ in range(self.faults)
            )
            plan = sorted(
                plan
                + [
                    (rng.uniform(5.0, self.duration_s * 0.4), rng.choice(LONG_FAULTS))
                    for _ in range(self.long_outages)
                ]
            )
            await self._inject(plan, t0)
            self.say("faults done")
            settled = await self._settle(ids, t0)
            self.say("settled" if settled else "not settled")
            self.out = await self._check(ids, settled)
            self.say("checked")
        finally:
            for a in self.agents.values():
                a.stop()
            self.broker.cleanup()
            with contextlib.suppress(Exception):
                await self.nc.close()
            if self.nats is not None:
                self.nats.cleanup()
            if self.cluster is not None:
                self.cluster.cleanup()
            tmp.cleanup()
        self.out["wall_s"] = round(time.monotonic() - t0, 1)
        return self.out

    async def _on_event(self, msg: Any) -> None:
        with contextlib.suppress(ValueError):
            ev = json.loads(msg.data)
            self.events.setdefault(ev.get("job_id", "?"), []).append(ev.get("kind", "?"))

    async def _submit_all(self) -> list[str]:
        """Jobs go through the JetStream stream with client ids, so none is lost or doubled."""
        ids = []
        for i in range(self.jobs):
            job_id = f"soak-{self.seed}-{i}"
            await self._submit(i, job_id)
            ids.append(job_id)
        return ids

    async def _submit(self, i: int, job_id: str) -> None:
        """One job with a client id, asked for as clients do."""
        subject = self.subjects.submit
        gpu = self.rng.choice([1, 2, 4, 8])
        spec = {
            "name": f"soak{i}",
            "job_id": job_id,
            "priority": self.rng.choice([0, 0, 5]),
            "gang": [{"name": "w", "replicas": self.rng.choice([1, 1, 2]), "gpu": gpu}],
            "capacity": self.rng.choice(["any", "spot-then-on-demand"]),
            "checkpoint": {"uri": f"mem://{job_id}"},
            "workload": {
                "simulate": {
                    # with outages of minutes, jobs of minutes, so outages find them running
                    "total_steps": self.rng.randint(40, 200)
                    if not self.long_outages
                    else self.rng.randint(2000, 6000),
                    "steps_per_second": 20.0,
                    "checkpoint_every": 20,
                }
            },
        }
        queue = QUEUES[i % len(QUEUES)]
        data = json.dumps(spec).encode()
        for _ in range(50):  # as clients do: a request; the stream keeps it either way
            try:
                reply = json.loads((await submit_request(self.nc, subject(queue), data, 2)).data)
                self.stats["submit:accepted" if reply.get("accepted") else "submit:rejected"] += 1
                break
            except (TimeoutError, nats.errors.TimeoutError):
                self.stats["submit:no-reply"] += 1  # the broker is away; JetStream has it
                break
            except Exception:
                await asyncio.sleep(0.2)

    async def _inject(self, plan: list[tuple[float, str]], t0: float) -> None:
        for at, kind in plan:
            await self._sleep_until(t0 + at)
            self.stats[f"fault:{kind}"] += 1
            self.say("fault", kind)
            try:
                await getattr(self, "_fault_" + kind.replace("-", "_"))()
            except Exception as exc:  # a fault that could not be injected is counted, not fatal
                self.stats[f"fault-error:{kind}:{type(exc).__name__}"] += 1
            await self._supervise()

    async def _sleep_until(self, t: float) -> None:
        while time.monotonic() < t:
            await self._supervise()
            await asyncio.sleep(min(0.5, max(0.0, t - time.monotonic())))

    async def _supervise(self) -> None:
        """A broker that exited on its own is restarted, as Kubernetes would, and counted."""
        p = self.broker.proc
        if p is not None and p.poll() is not None and not getattr(self, "_killed", False):
            self.stats[f"broker-exited:{p.returncode}"] += 1
            self.broker.start()
        self._killed = False

    async def _fault_broker(self, down_s: float | None = None) -> None:
        self._killed = True
        self.broker.kill9()
        await asyncio.sleep(down_s or self.rng.uniform(0.2, 3.0))
        self.broker.start()

    async def _fault_nats(self, down_s: float | None = None) -> None:
        if self.cluster is not None:
            await self._fault_nats_member(down_s)
            return
        assert self.nats is not None
        self.nats.kill()
        await asyncio.sleep(down_s or self.rng.uniform(0.2, 3.0))
        self.nats.start_sync()

    async def _fault_nats_member(self, down_s: float | None) -> None:
        """One member killed, sometimes with its store lost; back once the rest is healthy."""
        assert self.cluster is not None
        member = self.rng.choice(self.cluster.servers)
        member.kill9()
        if self.rng.random() < 1 / 3:
            member.wipe()
            self.stats["nats-wipe"] += 1
        await asyncio.sleep(down_s or self.rng.uniform(0.2, 3.0))
        self.cluster.start(member.name)
        await self.cluster.ready(timeout=60)

    async def _fault_freeze(self, down_s: float | None = None) -> None:
        agent = self.agents[self.rng.choice(sorted(self.agents))]
        began = time.time()
        agent.signal(signal.SIGSTOP)
        agent.stopped = True
        await asyncio.sleep(down_s or self.rng.uniform(2.0, 25.0))
        agent.signal(signal.SIGCONT)
        agent.stopped = False
        self.silenced.append((agent.cluster, began, time.time()))

    async def _fault_partition(self, down_s: float | None = None) -> None:
        agent = self.agents[self.rng.choice(sorted(self.agents))]
        began = time.time()
        agent.signal(signal.SIGUSR1)
        await asyncio.sleep(down_s or self.rng.uniform(2.0, 25.0))
        agent.signal(signal.SIGUSR1)
        self.silenced.append((agent.cluster, began, time.time()))

    def unheard_success(self, attempts: list[dict[str, Any]]) -> bool:
        """Whether a job's second completion is the one at-least-once allows (docs/operations.md,
        "At-least-once across long cuts"): its first success came while its agent was frozen
        or cut off for longer than `lost_after_s`, so the broker declared that cluster lost
        and started the job again before the success could reach it, and the second copy was
        made before the agent was heard again."""
        done = sorted(
            (r for r in attempts if r["end_phase"] == "succeeded"), key=lambda r: r["ended_at"]
        )
        first, second = done[0], done[1]
        return any(
            cluster == first["cluster"]
            and began <= first["ended_at"] <= ended
            and ended - began > self.lost_after_s
            and (second["created_at"] or 0.0) <= ended
            for cluster, began, ended in self.silenced
        )

    def _long_s(self) -> float:
        return self.rng.uniform(60.0, self.long_outage_s)

    async def _fault_long_freeze(self) -> None:
        await self._fault_freeze(self._long_s())

    async def _fault_long_partition(self) -> None:
        await self._fault_partition(self._long_s())

    async def _fault_long_broker(self) -> None:
        await self._fault_broker(self._long_s())

    async def _fault_long_nats(self) -> None:
        await self._fault_nats(self._long_s())

    async def _fault_spot(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            self.agents[self.rng.choice(sorted(self.agents))].signal(signal.SIGUSR2)

    async def _fault_store_full(self) -> None:
        js = self.nc.jetstream()
        name = f"CHAOSFILL{self.stats['fault:store-full']}"
        await js.add_stream(name=name, subjects=[f"chaosfill.{name}"], max_bytes=-1)
        blob = os.urandom(1 << 20)
        for _ in range(400):  # bounded: at most 400 MB, more than the store holds
            try:
                await js.publish(f"chaosfill.{name}", blob, timeout=2)
            except Exception:
                break
        await asyncio.sleep(self.rng.uniform(2.0, 10.0))
        for _ in range(50):
            try:
                await js.delete_stream(name)
                return
            except Exception:
                await asyncio.sleep(0.2)

    async def _fault_poison(self) -> None:
        for data in POISON:
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.submit(self.rng.choice(QUEUES)), data)
            with contextlib.suppress(Exception):
                cluster = self.rng.choice(sorted(self.agents))
                await self.nc.publish(f"{PREFIX}.agent.{cluster}.events", data)

    @contextlib.asynccontextmanager
    async def _latency(self, kind: str) -> Any:
        """While a bad actor acts: API calls back to back (3 s deadline each), timed."""
        samples = self.latency.setdefault(kind, [])
        done = asyncio.Event()

        async def probe() -> None:
            for _ in range(100_000):  # bounded
                if done.is_set():
                    return
                started = time.monotonic()
                try:
                    await self.nc.request(self.subjects.api("stats"), b"{}", timeout=3)
                    samples.append(time.monotonic() - started)
                except Exception:
                    samples.append(float("inf"))
                await asyncio.sleep(0.05)  # the probe's rhythm: about 20 calls a second

        task = asyncio.create_task(probe())
        try:
            yield
        finally:
            done.set()
            await task

    async def _fault_storm(self) -> None:
        agent = HostileAgent(self.nc, "hostile-storm", nodes=20_000)
        async with self._latency("storm"):
            await agent.start()
            for _ in range(40):  # bounded: about 48 MB of valid snapshots, back to back
                await agent.send(agent.snapshot())
            await self.nc.flush()
            await asyncio.sleep(self.rng.uniform(3.0, 6.0))  # while the broker works it off
        await agent.stop()

    async def _fault_tenant_flood(self) -> None:
        """team-a submits ~100 KB jobs until its share of the bucket refuses them, then
        cancels them all (cancelling frees the share)."""
        env = {f"CONFIG_{i}": "x" * 1000 for i in range(100)}
        flooded: list[str] = []
        async with self._latency("tenant-flood"):
            for i in range(600):  # bounded: 60 MB
                job_id = f"flood-{self.seed}-{self.stats['fault:tenant-flood']}-{i}"
                spec = {
                    "name": "flood",
                    "job_id": job_id,
                    "gang": [{"name": "w", "replicas": 1, "gpu": 1}],
                    "workload": {"env": env, "simulate": {"total_steps": 10}},
                }
                try:
                    msg = await submit_request(
                        self.nc, self.subjects.submit("team-a"), json.dumps(spec).encode(), 3
                    )
                except Exception:
                    self.stats["tenant-flood:no-reply"] += 1
                    continue
                reply = json.loads(msg.data)
                if not reply.get("accepted"):
                    self.stats["tenant-flood:refused"] += 1
                    break
                flooded.append(job_id)
            for job_id in flooded:
                with contextlib.suppress(Exception):
                    await self._api("cancel", {"job_id": job_id})
        self.stats["tenant-flood:accepted"] += len(flooded)

    async def _fault_black_hole(self) -> None:
        """A cheap cluster that acknowledges every dispatch and runs nothing, for a while;
        then it goes silent (and is declared lost)."""
        n = self.stats["fault:black-hole"]
        agent = HostileAgent(self.nc, f"blackhole{n}", nodes=4)
        async with self._latency("black-hole"):
            await agent.start()
            await agent.send(Heartbeat(at=time.time()))
            # A wave of jobs arrives while it is up, so it is offered work whatever the rest
            # of the soak is doing; they must end on honest clusters like every other job.
            for k in range(WAVE):
                job_id = f"soak-{self.seed}-bh{n}-{k}"
                await self._submit(self.jobs + k, job_id)
                self.ids.append(job_id)
            for _ in range(int(self.rng.uniform(10.0, 30.0) / 0.5)):
                await agent.send(Heartbeat(at=time.time()))
                await asyncio.sleep(0.5)
        self.stats["black-hole:swallowed"] += agent.dispatches
        await agent.stop()

    async def _api(self, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        msg = await self.nc.request(
            self.subjects.api(verb), json.dumps(body or {}).encode(), timeout=3
        )
        return dict(json.loads(msg.data))

    async def _states(self) -> dict[str, str]:
        reply = await self._api("list", {"limit": 10_000})
        return {j["job_id"]: j["state"] for j in reply.get("result", [])}

    async def _settle(self, ids: list[str], t0: float) -> bool:
        """Wait (bounded) until every job is terminal."""
        deadline = t0 + self.duration_s
        while time.monotonic() < deadline:
            await self._supervise()
            with contextlib.suppress(Exception):
                states = await self._states()
                if all(states.get(j) in TERMINAL_STATES for j in ids):
                    return True
            await asyncio.sleep(1.0)
        return False

    async def _check(self, ids: list[str], settled: bool) -> dict[str, Any]:
        await asyncio.sleep(1.5)  # let agents write their last records
        leading = False
        states: dict[str, str] = {}
        queues: list[dict[str, Any]] = []
        for _ in range(20):
            try:
                states = await self._states()
                queues = (await self._api("queues")).get("result", [])
                leading = True
                break
            except Exception:
                await asyncio.sleep(0.5)
        rows = [r for a in self.agents.values() for r in a.history()]
        succeeded: Counter[str] = Counter(
            r["job_id"] for r in rows if r["end_phase"] == "succeeded"
        )
        end = time.time()
        spans: dict[str, list[tuple[float, float, str]]] = {}
        for r in rows:
            start = r["running_at"] or r["created_at"]
            spans.setdefault(r["job_id"], []).append(
                (start, r["ended_at"] or end, f"{r['cluster']}#{r['attempt']}")
            )
        overlaps = []
        for job_id, ss in spans.items():
            ss.sort()
            for (_, a1, an), (b0, _, bn) in itertools.pairwise(ss):
                if b0 < a1 - 0.05:
                    overlaps.append(f"{job_id}: {an} and {bn} for {a1 - b0:.1f}s")
        # Attempts a fence ended (the fake cluster: "evicted: fence lapsed"). With outages of
        # minutes each shorter than the window, every one of them ended healthy work.
        fenced = [
            f"{r['job_id']}#{r['attempt']}@{r['cluster']}"
            for r in rows
            if r["end_phase"] == "evicted" and "fence" in (r.get("reason") or "")
        ]
        not_terminal = [j for j in ids if states.get(j) not in TERMINAL_STATES]
        self.say("states", Counter(states.get(j, "unknown") for j in ids), "records", len(rows))
        if not_terminal and self.verbose:
            with contextlib.suppress(Exception):
                self.say("why", await self._api("why", {"job_id": not_terminal[0]}))
                self.say("clusters", await self._api("clusters"))
        busy = [
            q["name"]
            for q in queues
            if q.get("admitted")
            or any(r.get("used") for f in q.get("flavors", []) for r in f.get("resources", []))
        ]
        repeated = [j for j, n in succeeded.items() if n > 1]
        unheard = [
            j for j in repeated if self.unheard_success([r for r in rows if r["job_id"] == j])
        ]
        twice = [j for j in repeated if j not in unheard]
        res = {
            "jobs": len(ids),
            "faults": dict(sorted((k, v) for k, v in self.stats.items())),
            "succeeded": sum(1 for j in ids if states.get(j) == "succeeded"),
            "failed": sum(1 for j in ids if states.get(j) == "failed"),
            "not_terminal": len(not_terminal),
            "completed_twice": len(twice),
            # allowed: a success its agent, frozen or cut off past lost_after_s, could not
            # report before the broker ran the job again (`unheard_success`)
            "rerun_after_unheard_success": len(unheard),
            "two_live_copies": len(overlaps),
            "fenced": len(fenced),
            "healthy_fenced": len(fenced) if self.long_outages else 0,
            "queues_busy_at_end": busy,
            "broker_leading": leading,
            "broker_exits": sum(v for k, v in self.stats.items() if k.startswith("broker-exited")),
            "attempts_max": max((r["attempt"] for r in rows), default=0),
            "examples": {
                "not_terminal": not_terminal[:5],
                "completed_twice": twice[:5],
                "rerun_after_unheard_success": unheard[:5],
                # every attempt of the first such job, in the order they were created, and
                # the freezes and partitions of the run (unix seconds)
                "completed_twice_attempts": sorted(
                    (
                        (
                            r["created_at"],
                            r["ended_at"],
                            r["cluster"],
                            r["attempt"],
                            r["end_phase"],
                            r["reason"],
                        )
                        for r in rows
                        if twice and r["job_id"] == twice[0]
                    ),
                    key=lambda row: row[0] or 0.0,
                ),
                "silenced": self.silenced if twice else [],
                "two_live_copies": overlaps[:5],
                "fenced": fenced[:5],
            },
        }
        if self.latency:
            res["hostile_latency_ms"] = {
                kind: _latency_summary(samples) for kind, samples in self.latency.items()
            }
        res["ok"] = (
            settled
            and not not_terminal
            and res["completed_twice"] == 0
            and not overlaps
            and res["healthy_fenced"] == 0
            and not busy
            and leading
            and res["broker_exits"] == 0
        )
        return res


async def _cancel_on_sigterm(coro: Any) -> dict[str, Any]:
    """SIGTERM (a timeout, a CI runner) cancels the soak, so it stops every process it started."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return dict(await task)


def _latency_summary(samples: list[float]) -> dict[str, float]:
    answered = sorted(x for x in samples if x != float("inf"))
    if not answered:
        return {"calls": len(samples), "unanswered": len(samples)}
    return {
        "calls": len(samples),
        "unanswered": len(samples) - len(answered),
        "p50": round(answered[len(answered) // 2] * 1000, 1),
        "p99": round(answered[min(len(answered) - 1, int(len(answered) * 0.99))] * 1000, 1),
        "max": round(answered[-1] * 1000, 1),
    }


class HostileAgent:
    """A hand-made agent for the bad actors: valid batches on its own subject, every command
    acknowledged, nothing ever run or reported."""

    def __init__(self, nc: Any, cluster: str, nodes: int) -> None:
        self.nc = nc
        self.cluster = cluster
        self.subjects = Subjects(prefix=PREFIX)
        self.flavors = [
            FlavorInfo(name="spot", capacity_type="spot", price_per_gpu_hour=0.01),
            FlavorInfo(name="od", capacity_type="on-demand", price_per_gpu_hour=0.02),
        ]
        self.nodes = [
            NodeInfo(
                name=f"{cluster}-{i}",
                flavor=("spot", "od")[i % 2],
                gpu=8,
                cpu_milli=96_000,
                memory=2**39,
            )
            for i in range(nodes)
        ]
        self.instance = f"{cluster}-{os.getpid()}-{time.monotonic_ns()}"
        self.seq = 0
        self.dispatches = 0
        self._sub: Any = None

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(flavors=self.flavors, nodes=self.nodes)

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.agent_cmd(self.cluster), cb=self._on_cmd)
        await self.send(self.snapshot())

    async def send(self, *events: Any) -> None:
        self.seq += 1
        batch = EventBatch(
            cluster=self.cluster, instance=self.instance, seq=self.seq, events=list(events)
        )
        await self.nc.publish(self.subjects.agent_events(self.cluster), encode_msgpack(batch))

    async def _on_cmd(self, msg: Any) -> None:
        with contextlib.suppress(Exception):
            cmd = decode_command(msg.data)
            self.dispatches += isinstance(cmd, Dispatch)
            await msg.respond(encode_msgpack(CommandAck(ok=True)))
            if isinstance(cmd, Resync):
                await self.send(self.snapshot())

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


def print_table(res: dict[str, Any]) -> None:
    checks = [
        ("every accepted job terminal", res["not_terminal"] == 0, f"{res['not_terminal']} not"),
        (
            "no job completed twice",
            res["completed_twice"] == 0,
            f"{res['completed_twice']}; allowed (success unheard past lost_after_s): "
            f"{res['rerun_after_unheard_success']}",
        ),
        ("never two live copies", res["two_live_copies"] == 0, str(res["two_live_copies"])),
        ("nothing healthy fenced", res["healthy_fenced"] == 0, f"{res['fenced']} fenced"),
        ("usage back to zero", not res["queues_busy_at_end"], str(res["queues_busy_at_end"])),
        ("broker leading at the end", res["broker_leading"], ""),
        ("broker never exited on its own", res["broker_exits"] == 0, str(res["broker_exits"])),
    ]
    print(f"{'check':34} {'result':6} detail")
    for name, ok, detail in checks:
        print(f"{name:34} {'ok' if ok else 'FAIL':6} {detail}")
    print(f"jobs {res['jobs']}: {res['succeeded']} succeeded, {res['failed']} failed; "
          f"max attempt {res['attempts_max']}; {res['wall_s']}s")  # fmt: skip
    print("faults:", ", ".join(f"{k}={v}" for k, v in res["faults"].items()))
    for k, v in res["examples"].items():
        if v:
            print(f"  {k}: {v}")
    for kind, lat in res.get("hostile_latency_ms", {}).items():
        print(f"API latency while {kind} acted: " + ", ".join(f"{k}={v}" for k, v in lat.items()))


app = program()


@app.callback(invoke_without_command=True, help=summary(__doc__))
def chaos(
    ctx: typer.Context,
    jobs: Annotated[int, typer.Option(min=1)] = 60,
    seed: int = 1,
    faults: Annotated[int, typer.Option(min=0)] = 12,
    duration_s: Annotated[float, typer.Option(min=0.0)] = 120.0,
    long_outages: Annotated[
        int, typer.Option(min=0, help="outages of minutes (agent, partition, broker, NATS)")
    ] = 0,
    long_outage_s: Annotated[float, typer.Option(min=60.0, max=230.0)] = 120.0,
    only: Annotated[
        str, typer.Option(help=f"fault kinds: {','.join(FAULTS + HOSTILE)}")
    ] = ",".join(FAULTS),
    nats_cluster: Annotated[
        bool, typer.Option("--nats-cluster", help="three nats-servers and R3 streams")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose")] = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    kinds = tuple(k for k in only.split(",") if k and not (nats_cluster and k == "store-full"))
    bad = [k for k in kinds if k not in FAULTS + HOSTILE]
    if bad:
        raise typer.BadParameter(
            f"unknown fault kinds {bad}; choose from {','.join(FAULTS + HOSTILE)}",
            param_hint="--only",
        )
    soak = Soak(
        jobs,
        seed,
        faults,
        duration_s,
        kinds,
        verbose=verbose,
        long_outages=long_outages,
        long_outage_s=long_outage_s,
        nats_cluster=nats_cluster,
    )
    res = asyncio.run(_cancel_on_sigterm(soak.run()))
    if as_json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    raise typer.Exit(0 if res["ok"] else 1)


@app.command(hidden=True)
def agent(
    cluster: Annotated[str, typer.Option()],
    nats: Annotated[str, typer.Option()],
    records: Annotated[Path, typer.Option()],
    seed: int = 0,
) -> None:
    """One fake cluster's agent, run by the soak in its own process."""
    from shell.logs import configure_logging

    configure_logging("error")
    asyncio.run(_agent_main(cluster, nats, records, seed))


if __name__ == "__main__":
    app(prog_name="python -m load.chaos")
