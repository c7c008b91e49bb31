"""Serving again after `kill -9` of a NATS server, on a real three-server cluster with R3 streams.

    python -m load.bench_nats_failover [--runs 3] [--replicas 3] [--json out.json]

Setup per run: three nats-server processes on 127.0.0.1 (`load/natscluster.py`), a broker
with `replication.replicas: 3` (lease TTL 5 s) and two fake clusters in this process, and a
client submitting one job after another (each retried with its id until acknowledged, about
15 a second at most). The server leading the submission stream is killed with SIGKILL, then,
once it is back and every stream has three current replicas again, the server leading the job
bucket, then the JetStream meta leader.

Measured: the seconds from each kill to the first submission the broker acknowledges after it
(`muster_*`). The baseline, in the same run and on the same cluster before Muster starts: a
bare R3 stream with a publisher at the same pace, its leader killed the same way, and the
seconds to the first publish JetStream acknowledges after it (`raw_jetstream_s`): what NATS
itself needs to elect and serve. Prints every run, the medians, and one `RESULT {...}` line.

With `--replicas 1` every stream has one copy, so nothing serves until the killed server is
back: it is started again at once, as a supervisor would restart it, and the figures are the
recovery of a crash and restart with its store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import nats
import structlog
import typer
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from agents.config import AgentConfig, FakeClusterConfig, FakeFlavor
from agents.fleet import Fleet, start_fake_fleet
from broker.service import Broker
from load.command import Count, JsonOut, program, summary
from load.common import emit
from load.natscluster import NatsCluster
from load.waiting import wait_for
from schemas.codec import decode_submit_reply, encode_json
from schemas.config import BrokerConfig, Limits, QueueConfig, Replication, Timeouts
from schemas.subjects import Subjects
from shell.natsio import submit_request

PACE_S = 0.05  # between two submissions (or publishes): about 15 a second at most
SERVE_AGAIN_S = 60.0  # give up on a run after this long without an acknowledgement
FAULTS = ("muster_submission_stream_s", "muster_job_bucket_s", "muster_meta_leader_s")


class Pacer:
    """Sends one thing after another until stopped, retrying each until acknowledged, and
    remembers when each acknowledgement came."""

    def __init__(self, send: Callable[[int], Awaitable[bool]]) -> None:
        self.send = send
        self.acked: list[float] = []
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        for n in range(100_000):  # bounded: hours at this pace
            while not await self.send(n):
                await asyncio.sleep(0.1)
            self.acked.append(time.monotonic())
            await asyncio.sleep(PACE_S)

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def first_after(self, t: float) -> float:
        got = await wait_for(
            lambda: next((a - t for a in self.acked if a > t), None),
            SERVE_AGAIN_S,
            what="an acknowledgement after the kill",
            interval=0.02,
        )
        return float(got)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def kill_leader(
    cluster: NatsCluster,
    js: JetStreamContext,
    pacer: Pacer,
    leader: Callable[[], Awaitable[str]],
    streams: list[str],
    replicas: int,
) -> float:
    """Kill the server `leader` names; the seconds to the first acknowledgement after; then the
    server back and every stream current again. With one replica the server is started again
    at once: nothing else can serve its streams."""
    victim = await leader()
    killed_at = time.monotonic()
    cluster.server(victim).kill9()
    if replicas == 1:
        cluster.start(victim)
    took = await pacer.first_after(killed_at)
    if replicas > 1:
        cluster.start(victim)
    await cluster.ready()
    for stream in streams:
        await cluster.replicas_current(js, stream, replicas)
    await pacer.first_after(time.monotonic())
    return took


async def raw_jetstream(cluster: NatsCluster, nc: Client, replicas: int) -> float:
    """The baseline: a bare stream's leader killed under a paced publisher."""
    js = nc.jetstream()
    name = f"BENCH_{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=name, subjects=[f"bench.{name}.>"], num_replicas=replicas)
    await cluster.replicas_current(js, name, replicas)

    async def publish(n: int) -> bool:
        try:
            await js.publish(f"bench.{name}.{n}", b"x" * 512, timeout=1.0)
        except Exception:
            return False
        return True

    pacer = Pacer(publish)
    pacer.start()
    try:
        await pacer.first_after(0.0)
        return await kill_leader(
            cluster, js, pacer, lambda: cluster.stream_leader(js, name), [name], replicas
        )
    finally:
        await pacer.stop()
        with contextlib.suppress(Exception):
            await js.delete_stream(name)


async def connect(cluster: NatsCluster) -> Client:
    """A connection that knows every member, riding out each kill."""
    return await nats.connect(**cluster.options().connect_kwargs())


def broker_config(prefix: str, replicas: int) -> BrokerConfig:
    """Timeouts that ride out a NATS election (agents reconnect within seconds; a cluster
    is lost only after 30 s), `replicas` copies of every stream."""
    return BrokerConfig(
        subject_prefix=prefix,
        queues=[QueueConfig(name="default")],
        timeouts=Timeouts(
            heartbeat_s=0.2,
            unreachable_after_s=10.0,
            lost_after_s=30.0,
            dispatch_ack_s=1.0,
            dispatch_retries=5,
            start_s=60.0,
            lease_ttl_s=5.0,
        ),
        limits=Limits(submit_stream_max_bytes=8 * 2**20, jobs_bucket_max_bytes=32 * 2**20),
        replication=Replication(replicas=replicas),
    )


async def fleet(nc: Client, subjects: Subjects) -> Fleet:
    flavor = FakeFlavor(
        name="od", capacity_type="on-demand", gpu_type="A100", nodes=4, gpu_per_node=8
    )
    configs = [
        AgentConfig(
            cluster=f"c{i}",
            backend="fake",
            heartbeat_s=0.2,
            subject_prefix=subjects.prefix,
            fake=FakeClusterConfig(flavors=[flavor], time_scale=4.0, start_delay_s=0.2, seed=i),
        )
        for i in range(2)
    ]
    return await start_fake_fleet(nc, configs, subjects)


def job(n: int) -> bytes:
    name = f"f{n:05d}"
    simulate = {"total_steps": 40, "steps_per_second": 20.0, "checkpoint_every": 10}
    return encode_json(
        {
            "name": name,
            "job_id": name,
            "gang": [{"name": "worker", "gpu": 8}],
            "checkpoint": {"uri": f"s3://ckpt/{name}"},
            "workload": {"simulate": simulate},
        }
    )


async def muster(cluster: NatsCluster, replicas: int) -> dict[str, float]:
    config = broker_config(f"b{uuid.uuid4().hex[:10]}", replicas)
    subjects = Subjects(prefix=config.subject_prefix)
    conns = [await connect(cluster) for _ in range(3)]
    client, bnc, fnc = conns
    broker = Broker(config, bnc)
    task = asyncio.create_task(broker.run())
    agents: Fleet | None = None

    async def submit(n: int) -> bool:
        try:
            msg = await submit_request(client, subjects.submit("default"), job(n), 2.0)
        except Exception:  # a timeout or no responders while NATS elects
            return False
        return bool(decode_submit_reply(msg.data).accepted)

    pacer = Pacer(submit)
    try:
        await asyncio.wait_for(broker.leading.wait(), 30)
        agents = await fleet(fnc, subjects)
        pacer.start()
        await pacer.first_after(0.0)
        js = client.jetstream()
        streams = [subjects.submit_stream, f"KV_{subjects.jobs_bucket}"]
        streams.append(f"KV_{subjects.leader_bucket}")
        leaders = (
            lambda: cluster.stream_leader(js, subjects.submit_stream),
            lambda: cluster.stream_leader(js, f"KV_{subjects.jobs_bucket}"),
            cluster.meta_leader,
        )
        return {
            what: await kill_leader(cluster, js, pacer, leader, streams, replicas)
            for what, leader in zip(FAULTS, leaders, strict=True)
        }
    finally:
        await pacer.stop()
        if agents is not None:
            await agents.stop()
        await broker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 20)
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()


async def one_run(replicas: int) -> dict[str, float]:
    cluster = NatsCluster()
    cluster.start_all()
    try:
        await cluster.ready()
        nc = await connect(cluster)
        try:
            baseline = await raw_jetstream(cluster, nc, replicas)
        finally:
            await nc.close()
        return {"raw_jetstream_s": baseline, **await muster(cluster, replicas)}
    finally:
        cluster.cleanup()


app = program()


@app.command(help=summary(__doc__))
def bench_nats_failover(
    runs: Count = 3,
    replicas: Annotated[int, typer.Option(min=1, max=3, help="copies of every stream")] = 3,
    json_out: JsonOut = None,
) -> None:
    run_bench(runs, replicas, json_out)


def run_bench(runs: int, replicas: int, json_out: str | None) -> dict[str, Any]:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # every kill logs reconnects
    results = []
    for r in range(runs):
        out = asyncio.run(one_run(replicas))
        results.append(out)
        shown = ", ".join(f"{k} {v:.2f} s" for k, v in out.items())
        print(f"run {r + 1}: {shown}")
    keys = ["raw_jetstream_s", *FAULTS]
    result: dict[str, Any] = {k: statistics.median(r[k] for r in results) for k in keys}
    result["replicas"] = replicas
    result["runs"] = results
    emit(result, json_out)
    return result


if __name__ == "__main__":
    app()
