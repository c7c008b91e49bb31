"""What the end-to-end benchmarks share: a broker process and a fake fleet on one embedded
nats-server, Philly gang sizes, and a hook that timestamps every Dispatch a fake agent carries
out, on the same clock as the load generator (so latency needs no clock sync).

The fleet runs in the benchmark process over one NATS connection, as `start_fake_fleet` does
for demos; the hook wraps each FakeCluster's `dispatch` on the instance only (no change to the
agents' code). A dispatch that the fake cluster refuses raises and is not recorded, so a
recorded dispatch is one the agent acknowledged as ok. With `fleet_process` the same fleet and
hook run in a child (`FleetProcess`, load/fleetproc.py) that stamps each dispatch with
`time.time()` and reports it over NATS; the benchmark stamps its publishes with that clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client

from agents.config import (
    AgentConfig,
    FakeClusterConfig,
    FakeFlavor,
    FleetConfig,
    make_fleet_configs,
)
from agents.fleet import Fleet, start_fake_fleet
from load.common import (
    BROKER_PROGRAM,
    REPO,
    BrokerProcess,
    end_process,
    percentile,
    proc_cpu_s,
)
from load.traces import default_traces_dir, gang_shape, philly_gang_sizes
from schemas.agent import Dispatch
from schemas.codec import decode_job_event
from schemas.config import BrokerConfig, QueueConfig, Timeouts
from schemas.subjects import Subjects
from shell.logs import configure_logging
from shell.natsio import flush

SEED = 20171009
# Used only when data/traces/philly.csv is absent (an installed package): Philly in miniature.
FALLBACK_SIZES = [1] * 93 + [2, 2, 4, 4, 8, 8, 16]


@functools.cache
def half_spot_flavors(nodes: int) -> list[FakeFlavor]:
    """Each benchmark cluster: half its nodes A100 spot, half on-demand (AWS p4d prices)."""
    spot = nodes // 2
    return [
        FakeFlavor(name="a100-spot", capacity_type="spot", gpu_type="a100",
                   price_per_gpu_hour=1.47, nodes=spot),
        FakeFlavor(name="a100-od", capacity_type="on-demand", gpu_type="a100",
                   price_per_gpu_hour=3.67, nodes=nodes - spot),
    ]  # fmt: skip


def _philly() -> tuple[tuple[int, ...], str]:
    philly = default_traces_dir() / "philly.csv"
    if philly.exists():
        return tuple(philly_gang_sizes(philly)), "philly.csv"
    return tuple(FALLBACK_SIZES), "built-in Philly-like mix"


def gang_sizes(max_gpus: int | None = None) -> tuple[list[int], str]:
    """GPU counts of Philly jobs (arrival order) and where they came from (the trace is read
    once per process: parsing 82,000 timestamps takes seconds)."""
    all_sizes, source = _philly()
    sizes = list(all_sizes)
    if max_gpus is not None:
        sizes = [s for s in sizes if s <= max_gpus]
    return sizes, source


def sample_sizes(n: int, seed: int = SEED, max_gpus: int | None = None) -> list[int]:
    """`n` gang sizes drawn from Philly with a fixed seed (the same jobs every run)."""
    sizes, _ = gang_sizes(max_gpus)
    rng = random.Random(seed)
    return [rng.choice(sizes) for _ in range(n)]


def gang_of(gpus: int) -> list[dict[str, Any]]:
    """A Philly job as a JSON podset list (see load/traces.py for the mapping)."""
    replicas, per = gang_shape(gpus)
    return [
        {
            "name": "worker",
            "replicas": replicas,
            "gpu": per,
            "cpu": str(max(1, per) * 8),
            "memory": f"{max(1, per) * 64}Gi",
        }
    ]


@dataclass(slots=True)
class Acked:
    """One Dispatch a fake agent carried out."""

    job_id: str
    attempt: int
    cluster: str
    at: float  # DispatchLog.clock() where the agent ran
    resume_step: int | None


@dataclass
class DispatchLog:
    """Every Dispatch carried out by the fleet, in order, with a waiter for a count."""

    acked: list[Acked] = field(default_factory=list)
    first: dict[str, Acked] = field(default_factory=dict)  # job_id -> attempt 1's ack
    by_key: dict[tuple[str, int], Acked] = field(default_factory=dict)
    listeners: list[Callable[[Acked], None]] = field(default_factory=list)
    cancelled: dict[tuple[str, int], float] = field(default_factory=dict)  # clock()
    # perf_counter for a fleet in this process; wall time (time.time) when the fleet runs in
    # a process of its own (load/fleetproc.py), as one machine's processes all read it alike.
    clock: Callable[[], float] = time.perf_counter
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def hook(self, fleet: Fleet) -> None:
        for name, cluster in fleet.clusters.items():
            cluster.dispatch = self._wrap(name, cluster.dispatch)  # type: ignore[method-assign,assignment]
            cluster.cancel = self._wrap_cancel(cluster.cancel)  # type: ignore[method-assign,assignment]

    def _wrap_cancel(
        self, inner: Callable[[str, int | None, str], Awaitable[None]]
    ) -> Callable[[str, int | None, str], Awaitable[None]]:
        async def cancel(job_id: str, attempt: int | None, reason: str) -> None:
            await inner(job_id, attempt, reason)
            if attempt is not None:
                self.cancelled.setdefault((job_id, attempt), self.clock())

        return cancel

    def _wrap(
        self, name: str, inner: Callable[[Dispatch], Awaitable[None]]
    ) -> Callable[[Dispatch], Awaitable[None]]:
        async def dispatch(cmd: Dispatch) -> None:
            await inner(cmd)  # raises when the fake cluster refuses: not an ok ack
            step = cmd.resume_from.step if cmd.resume_from is not None else None
            self.add(Acked(cmd.job_id, cmd.attempt, name, self.clock(), step))

        return dispatch

    def add(self, rec: Acked) -> None:
        """Record one carried-out Dispatch (the first report of each attempt counts)."""
        key = (rec.job_id, rec.attempt)
        if key in self.by_key:
            return
        self.by_key[key] = rec
        self.acked.append(rec)
        self.first.setdefault(rec.job_id, rec)
        for listener in self.listeners:
            listener(rec)
        self._changed.set()

    async def wait_count(self, count: int, timeout: float) -> bool:
        """Until `count` dispatches are recorded (True) or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while len(self.acked) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
        return True


# One carried-out Dispatch on the wire from load/fleetproc.py: job_id, attempt, cluster,
# time.time() when carried out, resume step.
Report = tuple[str, int, str, float, int | None]


def encode_reports(recs: list[Acked]) -> bytes:
    return msgspec.json.encode(
        [(r.job_id, r.attempt, r.cluster, r.at, r.resume_step) for r in recs]
    )


def decode_reports(data: bytes) -> list[Acked]:
    return [Acked(*r) for r in msgspec.json.decode(data, type=list[Report])]


class FleetProcess:
    """The fake fleet in a child process (`python -m load.fleetproc`), started like the broker
    (`load.common.BrokerProcess`): its carried-out Dispatches arrive on a subject of the run's
    prefix and fill `log`, stamped with the child's `time.time()`."""

    def __init__(self, url: str, configs: Sequence[AgentConfig], prefix: str) -> None:
        self.url = url
        self.acks = f"{prefix}.bench.acked"
        self.log = DispatchLog(clock=time.time)
        self._tmp = tempfile.TemporaryDirectory(prefix="muster-fleet-")
        self.config_path = Path(self._tmp.name) / "fleet.json"
        self.config_path.write_bytes(msgspec.json.encode(FleetConfig(clusters=list(configs))))
        self.proc: subprocess.Popen[bytes] | None = None
        self._sub: Any = None

    async def start(self, nc: Client) -> None:
        """Listen for reports first (none is missed), then start the child."""

        async def on_reports(msg: Any) -> None:
            for rec in decode_reports(msg.data):
                self.log.add(rec)

        self._sub = await nc.subscribe(
            self.acks, cb=on_reports, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        await flush(nc)
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "load.fleetproc", "--nats", self.url,
             "--config", str(self.config_path), "--acks", self.acks],
            env={**os.environ, "MUSTER_LOG_LEVEL": "warning"},
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip

    async def stop(self) -> None:
        """SIGTERM (the fleet stops its agents), SIGKILL if it does not exit in time."""
        end_process(self.proc, 15.0)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        self._tmp.cleanup()


@dataclass
class Setup:
    """A broker process, its fake fleet and a client connection, all on one prefix. The fleet
    runs in this process (`local_fleet`) or in a child of its own (`remote_fleet`)."""

    broker: BrokerProcess
    nc: Client
    local_fleet: Fleet | None
    log: DispatchLog
    subjects: Subjects
    pids: dict[str, int] = field(default_factory=dict)  # processes to meter (CpuMeter)
    remote_fleet: FleetProcess | None = None

    @property
    def fleet(self) -> Fleet:
        """The in-process fleet (its clusters' injection API and history)."""
        if self.local_fleet is None:
            raise RuntimeError("the fleet runs in a process of its own; start it in this one")
        return self.local_fleet

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.local_fleet is not None:
                await asyncio.wait_for(self.local_fleet.stop(), 15)
            if self.remote_fleet is not None:
                await self.remote_fleet.stop()
        with contextlib.suppress(Exception):
            await self.nc.close()
        self.broker.cleanup()


async def start_setup(
    url: str,
    *,
    clusters: int,
    flavors: Sequence[FakeFlavor],
    queues: int,
    fake: dict[str, Any] | None = None,
    timeouts: Timeouts | None = None,
    fleet_timeout_s: float = 120.0,
    fleet_process: bool = False,
    broker_program: tuple[str, ...] = BROKER_PROGRAM,
    broker_tree: Path | None = None,
    broker_log_level: str = "warning",
) -> Setup:
    """A fresh prefix, a broker process leading on it, and a fake fleet whose snapshots the
    broker has applied (its `clusters` counter reaches `clusters`). `fleet_process`: the fleet
    runs in a child process (`FleetProcess`), so this one only publishes and measures.
    `broker_program`, `broker_tree`, `broker_log_level`: what runs the broker, from which
    checkout, logging at which level (BrokerProcess)."""
    configure_logging("warning")  # the fleet's per-command logs are debug; keep them cheap
    prefix = f"e{uuid.uuid4().hex[:8]}"
    config = BrokerConfig(
        subject_prefix=prefix,
        queues=[QueueConfig(name=f"q{i}") for i in range(queues)],
        timeouts=timeouts or Timeouts(),
    )
    broker = BrokerProcess(
        url, config, program=broker_program, tree=broker_tree, log_level=broker_log_level
    )
    broker.start()
    nc = await nats.connect(
        url, pending_size=512 * 1024 * 1024, max_reconnect_attempts=3, connect_timeout=5
    )
    try:
        await broker.wait_leading(nc)
        fake_cfg = FakeClusterConfig(flavors=list(flavors), seed=SEED, **(fake or {}))
        configs = make_fleet_configs(clusters, fake_cfg, prefix="c", subject_prefix=prefix)
        fleet, remote = None, None
        if fleet_process:
            remote = FleetProcess(url, configs, prefix)
            await remote.start(nc)
            log = remote.log
        else:
            fleet = await start_fake_fleet(nc, configs, Subjects(prefix=prefix))
            log = DispatchLog()
            log.hook(fleet)
    except BaseException:
        await nc.close()
        broker.cleanup()
        raise
    assert broker.proc is not None
    setup = Setup(
        broker=broker,
        nc=nc,
        local_fleet=fleet,
        log=log,
        subjects=Subjects(prefix=prefix),
        pids={"broker": broker.proc.pid},
        remote_fleet=remote,
    )
    if remote is not None and remote.proc is not None:
        setup.pids["fleet"] = remote.proc.pid
    deadline = time.monotonic() + fleet_timeout_s
    while time.monotonic() < deadline:
        stats = await broker.stats(nc, timeout=10)
        if stats["clusters"] >= clusters:
            break
        await asyncio.sleep(0.1)
    else:
        await setup.close()
        raise TimeoutError(f"the broker did not hear from {clusters} clusters in time")
    return setup


def _machine_ticks() -> list[int] | None:
    """The all-cores line of /proc/stat in clock ticks since boot (user, nice, system, idle,
    iowait, irq, softirq, steal, ...); None where it cannot be read."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (Linux /proc/stat, all cores)."""
    fields = _machine_ticks()
    if fields is None:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def proc_wait_s(pid: int) -> float:
    """Seconds the process's threads have spent runnable but waiting for a core (Linux
    schedstat, its second field): the part of a latency that no code of the process spent.
    Threads that have exited no longer count."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return float("nan")
    waited = 0
    for tid in tids:
        try:
            waited += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return waited / 1e9


def machine_steal_s() -> float:
    """CPU seconds the hypervisor gave this VM's cores to others since boot (/proc/stat)."""
    fields = _machine_ticks()
    if fields is None or len(fields) < 8:
        return float("nan")
    return fields[7] / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU shares of the broker, nats-server and this process over a window: on a shared
    2-core machine this tells whether the broker was starved or simply busy; and how long
    each waited for a core, which says how much of a latency was the wait for one."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start()

    def _read(self) -> dict[str, float]:
        out = {name: proc_cpu_s(pid) for name, pid in self.pids.items()}
        out["bench"] = time.process_time()
        out["machine"] = machine_busy_s()
        return out

    def _read_waits(self) -> dict[str, float]:
        out = {name: proc_wait_s(pid) for name, pid in self.pids.items()}
        out["bench"] = proc_wait_s(os.getpid())
        out["steal"] = machine_steal_s()
        return out

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._c0 = self._read()
        self._w0 = self._read_waits()

    def waits(self) -> dict[str, float]:
        """Seconds each process waited for a core since start(), and `steal`: the seconds
        of both cores the hypervisor gave to other machines meanwhile."""
        now = self._read_waits()
        return {k: now[k] - self._w0[k] for k in now}

    def shares(self) -> dict[str, float]:
        """CPU seconds per wall second of each process since start(); 1.0 = one full core.
        `machine` is every process on the machine (2.0 = both cores busy): what is left
        after broker, nats and bench is other people's load."""
        wall = time.perf_counter() - self._t0
        return {k: round(v / wall, 3) for k, v in self.used().items()}

    def used(self) -> dict[str, float]:
        """CPU seconds of each process since start(): divided by the jobs handled meanwhile,
        the CPU per job, which a shared machine's contention does not inflate as it does
        wall-clock figures."""
        now = self._read()
        return {k: now[k] - self._c0[k] for k in now}


async def raw_request_latency(url: str, count: int = 2000) -> dict[str, float]:
    """Round trip of a small NATS request/reply between two connections through the same
    server, one at a time: the floor under any submit -> dispatch latency (ms)."""
    server = await nats.connect(url)
    client = await nats.connect(url)
    try:

        async def echo(msg: Any) -> None:
            await msg.respond(b"ok")

        await server.subscribe("bench.echo", cb=echo)
        await flush(server)
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            await client.request("bench.echo", b"x" * 64, timeout=5)
            samples.append((time.perf_counter() - t0) * 1000)
    finally:
        await client.close()
        await server.close()
    return {
        "p50_ms": percentile(samples, 50),
        "p99_ms": percentile(samples, 99),
    }


class EventTrace:
    """Receipt times of the broker's `queued` and `admitted` job events, to split a submit ->
    dispatch latency into stages (submission persisted, admitted and persisted, dispatch
    carried out). Optional: receiving the events costs the benchmark process CPU."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.seen: dict[str, dict[str, float]] = {}

    @classmethod
    async def start(cls, setup: Setup) -> EventTrace:
        trace = cls(None)

        async def on_event(msg: Any) -> None:
            at = setup.log.clock()
            event = decode_job_event(msg.data)
            trace.seen.setdefault(event.job_id, {}).setdefault(event.kind, at)

        trace.sub = await setup.nc.subscribe(
            setup.subjects.job_events_all,
            cb=on_event,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        await flush(setup.nc)
        return trace

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()

    def breakdown(self, sent_at: dict[str, float], log: DispatchLog) -> dict[str, list[float]]:
        """p50 and p99 (ms) of: publish -> queued event, queued -> admitted event, admitted
        event -> agent dispatch."""
        parts: dict[str, list[float]] = {"queued": [], "admitted": [], "dispatched": []}
        for job_id, t0 in sent_at.items():
            seen = self.seen.get(job_id, {})
            acked = log.first.get(job_id)
            if "queued" not in seen or "admitted" not in seen or acked is None:
                continue
            parts["queued"].append((seen["queued"] - t0) * 1000)
            parts["admitted"].append((seen["admitted"] - seen["queued"]) * 1000)
            parts["dispatched"].append((acked.at - seen["admitted"]) * 1000)
        return {
            k: [round(percentile(v, 50), 1), round(percentile(v, 99), 1)] for k, v in parts.items()
        }


class GcWatch:
    """This process's cycle-collector pauses. The 50 fake agents share the benchmark process
    (a real agent has one cluster to itself), so their heap is 50 times a real agent's and a
    full collection here (150 ms) would stall every agent at once and be charged to the
    broker. `quiet()` collects, freezes what exists and turns the collector off for the
    measured window (bounded in count and time, so memory stays bounded); `close()` turns it
    back on. Pauses that still happen are reported with the figures."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif info.get("generation") == 2:
            self.pauses_ms.append((time.perf_counter() - self._t0) * 1000)

    def quiet(self) -> None:
        gc.enable()
        gc.collect()
        gc.freeze()
        gc.disable()
        self.pauses_ms = []

    def take(self) -> dict[str, float]:
        """Full collections since the last take(): count and longest pause (ms)."""
        pauses, self.pauses_ms = self.pauses_ms, []
        return {"full_collections": len(pauses), "max_pause_ms": round(max(pauses, default=0), 1)}

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._cb)
        gc.enable()
        gc.unfreeze()
