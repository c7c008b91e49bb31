"""Agent event ingest: how many node/GPU events a second the broker applies (batched).

    python -m load.bench_ingest [--clusters 50] [--nodes 200] [--events 500000] [--runs 3]

Fake agents (wire-level, in this process) send a snapshot each, then batches of NodeUpsert and
GpuHealth events; the broker runs in its own process. The rate is events applied by the broker
(its `stats` counter) over wall time. Raw NATS pub→sub throughput on the same server is measured
in the same run as the baseline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

import nats
import typer

from broker.embedded import EmbeddedNats
from load.command import Count, JsonOut, Nodes, Options, program, summary
from load.common import BrokerProcess, emit, median, raw_nats_baseline
from schemas.agent import (
    AgentEvent,
    ClusterSnapshot,
    EventBatch,
    FlavorInfo,
    GpuHealth,
    NodeInfo,
    NodeUpsert,
)
from schemas.codec import encode_msgpack
from schemas.config import BrokerConfig, QueueConfig
from schemas.subjects import Subjects
from shell.natsio import flush

Batch = Annotated[int, typer.Option(min=1, help="events per batch (one message each)")]
FLAVOR = FlavorInfo(name="a100", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3)


def node(cluster: int, i: int, ready: bool = True) -> NodeInfo:
    return NodeInfo(
        name=f"c{cluster}-n{i}",
        flavor="a100",
        gpu=8,
        cpu_milli=96_000,
        memory=768 * 2**30,
        ready=ready,
    )


def snapshot(cluster: int, nodes: int) -> ClusterSnapshot:
    """What cluster `cluster`'s agent reports first: its flavor and `nodes` nodes."""
    return ClusterSnapshot(flavors=[FLAVOR], nodes=[node(cluster, i) for i in range(nodes)])


def delta_events(cluster: int, b: int, batch: int, nodes: int) -> list[AgentEvent]:
    """The `b`-th batch of cluster `cluster`: `batch` events over its nodes in turn, every
    tenth a GpuHealth, the others NodeUpserts."""
    evs: list[AgentEvent] = []
    for k in range(batch):
        i = (b * batch + k) % nodes
        if k % 10 == 9:
            evs.append(GpuHealth(node=f"c{cluster}-n{i}", healthy=8))
        else:
            evs.append(NodeUpsert(node=node(cluster, i)))
    return evs


async def one_run(url: str, clusters: int, nodes: int, events: int, batch: int) -> float:
    prefix = f"b{uuid.uuid4().hex[:8]}"
    config = BrokerConfig(subject_prefix=prefix, queues=[QueueConfig(name="default")])
    subjects = Subjects(prefix=prefix)
    broker = BrokerProcess(url, config)
    broker.start()
    nc = await nats.connect(url, pending_size=512 * 1024 * 1024)
    try:
        await broker.wait_leading(nc)
        instances = [uuid.uuid4().hex[:8] for _ in range(clusters)]
        seqs = [0] * clusters

        async def send(c: int, evs: list) -> None:  # type: ignore[type-arg]
            seqs[c] += 1
            data = EventBatch(
                cluster=f"c{c}", instance=instances[c], seq=seqs[c], events=evs, sent_at=time.time()
            )
            await nc.publish(subjects.agent_events(f"c{c}"), encode_msgpack(data))

        for c in range(clusters):
            await send(c, [snapshot(c, nodes)])
        await flush(nc)
        base = (await broker.stats(nc))["events"]
        # Pre-encode the delta batches so the generator is not what we measure.
        payloads = []
        per_cluster = max(1, events // clusters // batch)
        for c in range(clusters):
            for b in range(per_cluster):
                evs = delta_events(c, b, batch, nodes)
                seqs[c] += 1
                data = EventBatch(
                    cluster=f"c{c}", instance=instances[c], seq=seqs[c], events=evs, sent_at=0.0
                )
                payloads.append((subjects.agent_events(f"c{c}"), encode_msgpack(data)))
        total = len(payloads) * batch
        started = time.perf_counter()
        for subject, payload in payloads:
            await nc.publish(subject, payload)
        await flush(nc)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = await broker.stats(nc, timeout=10)
            if stats["events"] - base >= total:
                break
            await asyncio.sleep(0.02)
        elapsed = time.perf_counter() - started
        stats = await broker.stats(nc, timeout=10)
        assert stats["events"] - base >= total, stats
        assert stats["bad_batches"] == 0, stats
        return total / elapsed
    finally:
        await nc.close()
        broker.cleanup()


async def main_async(args: Options) -> dict[str, object]:
    async with EmbeddedNats() as server:
        baseline = await raw_nats_baseline(server.url)
        rates = []
        for _ in range(args.runs):
            rates.append(
                await one_run(server.url, args.clusters, args.nodes, args.events, args.batch)
            )
            print(f"  run: {rates[-1]:,.0f} events/s")
    result = {
        "figure": "agent event ingest",
        "events_per_s_median": round(median(rates)),
        "runs": [round(r) for r in rates],
        "batch": args.batch,
        "raw_nats_msgs_per_s": round(baseline),
        "ratio_vs_raw_nats_msgs": round(median(rates) / baseline, 3),
        "target_events_per_s": 50_000,
    }
    print(
        f"ingest: median {result['events_per_s_median']:,} events/s "
        f"(raw NATS {baseline:,.0f} msgs/s; target 50,000)"
    )
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_ingest(
    clusters: Count = 50,
    nodes: Nodes = 200,
    events: Count = 500_000,
    batch: Batch = 500,
    runs: Count = 3,
    json_out: JsonOut = None,
) -> None:
    options = Options(clusters=clusters, nodes=nodes, events=events, batch=batch, runs=runs)
    emit(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_ingest")
