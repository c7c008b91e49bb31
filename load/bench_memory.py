"""Broker memory per pending job, and where it goes.

    python -m load.bench_memory [--jobs 100000] [--top 25] [--runs 1] [--no-trace]

Submits `--jobs` jobs (the ones `load.bench_scale` submits: no cluster, so all stay pending)
to a broker in its own process and reads its RSS before and after: RSS and bytes per job.
Then the same again with the broker under tracemalloc (`load.memprobe`), which dumps a
snapshot on SIGUSR1 once every job is in: the top allocators by file:line and by file.
Last, the deep size of one job's resident objects (its JobRecord graph, field by field)
as `sys.getsizeof` counts them, shared objects (interned strings, cached defaults) once.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec
import nats
import typer

from broker.core.records import JobRecord
from broker.core.registry import JobRegistry
from broker.embedded import EmbeddedNats
from load.bench_scale import job, submit_durably
from load.command import Count, JsonOut, Options, program, summary
from load.common import BrokerProcess, emit, median
from schemas.codec import decode_jobspec
from schemas.config import BrokerConfig, QueueConfig

SNAPSHOT_WAIT_S = 120.0  # a broker under tracemalloc with 100,000 jobs dumps within this


class ProbedBroker(BrokerProcess):
    """The broker under tracemalloc; `snapshot()` asks it for one."""

    def __init__(self, url: str, config: BrokerConfig, snapshot_path: Path) -> None:
        super().__init__(url, config, program=("-m", "load.memprobe", str(snapshot_path)))
        self.snapshot_path = snapshot_path

    async def snapshot(self) -> tracemalloc.Snapshot:
        assert self.proc is not None
        self.snapshot_path.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        while not self.snapshot_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no tracemalloc snapshot within {SNAPSHOT_WAIT_S:g}s")
            await asyncio.sleep(0.2)
        return tracemalloc.Snapshot.load(str(self.snapshot_path))


async def fill(url: str, broker: BrokerProcess, jobs: int, queues: int) -> tuple[int, int]:
    """Start the broker, read its RSS, submit the jobs; RSS before and after (bytes)."""
    broker.start()
    nc = await nats.connect(url)
    try:
        await broker.wait_leading(nc)
        await asyncio.sleep(1.0)
        before = broker.rss_bytes()
        await submit_durably(nc, broker, jobs, queues, random.Random(7), 1000)
        stats = await broker.stats(nc, timeout=30)
        assert stats["pending"] == jobs, stats
        await asyncio.sleep(1.0)
        return before, broker.rss_bytes()
    finally:
        await nc.close()


def bench_config(queues: int) -> BrokerConfig:
    return BrokerConfig(
        subject_prefix=f"m{uuid.uuid4().hex[:8]}",
        queues=[QueueConfig(name=f"q{i}") for i in range(queues)],
    )


def top_allocators(snapshot: tracemalloc.Snapshot, key: str, top: int) -> list[dict[str, Any]]:
    repo = str(Path(__file__).resolve().parents[1]) + "/"
    stats = snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    out = []
    for stat in stats.statistics(key)[:top]:
        frame = stat.traceback[0]
        where = frame.filename.replace(repo, "").split("site-packages/")[-1]
        out.append(
            {
                "where": f"{where}:{frame.lineno}" if key == "lineno" else where,
                "mib": round(stat.size / 2**20, 2),
                "blocks": stat.count,
            }
        )
    return out


def deep_size(obj: object, seen: set[int]) -> int:
    """`sys.getsizeof` of obj and everything it holds, each object once across calls."""
    size = 0
    for item in _walk(obj, seen):
        size += sys.getsizeof(item)
    return size


def _walk(obj: object, seen: set[int]) -> Iterator[object]:
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, (bool, int, float)):
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, msgspec.Struct):
            stack.extend(getattr(item, f) for f in item.__struct_fields__)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)


def record_breakdown(count: int) -> dict[str, Any]:
    """Bytes of a pending JobRecord built as the broker builds one, per field, averaged over
    `count` bench jobs; objects shared between jobs (cached defaults, interned strings)
    count once, so the average is what each further job adds."""
    rng = random.Random(7)
    seen: set[int] = set()
    fields: dict[str, int] = {}
    registry = JobRegistry()  # registering shares what jobs hold alike, as the broker does
    for i in range(count):
        spec = decode_jobspec(job(i, rng))
        record = JobRecord(
            job_id=spec.job_id or "", spec=spec, queue=f"q{i % 100}", order=i, submitted_at=0.0
        )
        registry.add(record)
        fields["(record itself)"] = fields.get("(record itself)", 0) + sys.getsizeof(record)
        seen.add(id(record))
        for name in record.__struct_fields__:
            fields[name] = fields.get(name, 0) + deep_size(getattr(record, name), seen)
    per_job = {k: round(v / count) for k, v in sorted(fields.items(), key=lambda kv: -kv[1])}
    return {"bytes_per_record": sum(per_job.values()), "fields": per_job}


async def main_async(args: Options) -> dict[str, Any]:
    result: dict[str, Any] = {"figure": "broker memory per pending job", "jobs": args.jobs}
    async with EmbeddedNats() as server:
        runs = []
        for _ in range(args.runs):
            broker = BrokerProcess(server.url, bench_config(args.queues))
            try:
                before, after = await fill(server.url, broker, args.jobs, args.queues)
            finally:
                broker.cleanup()
            runs.append(
                {
                    "rss_empty_mib": round(before / 2**20, 1),
                    "rss_mib": round(after / 2**20, 1),
                    "bytes_per_job": round((after - before) / args.jobs),
                }
            )
            print("  run:", runs[-1])
        result["runs"] = runs
        result["rss_mib_median"] = median([r["rss_mib"] for r in runs])
        result["bytes_per_job_median"] = median([r["bytes_per_job"] for r in runs])
        if args.trace:
            with tempfile.TemporaryDirectory(prefix="muster-mem-") as tmp:
                probed = ProbedBroker(server.url, bench_config(args.queues), Path(tmp) / "snapshot")
                try:
                    await fill(server.url, probed, args.jobs, args.queues)
                    snapshot = await probed.snapshot()
                finally:
                    probed.cleanup()
            traced = sum(s.size for s in snapshot.statistics("filename"))
            result["traced_mib"] = round(traced / 2**20, 1)
            result["top_lines"] = top_allocators(snapshot, "lineno", args.top)
            result["top_files"] = top_allocators(snapshot, "filename", args.top)
    result["record"] = record_breakdown(min(args.jobs, 2000))
    print_summary(result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(
        f"memory: {result['jobs']:,} pending jobs, RSS {result['rss_mib_median']} MiB, "
        f"{result['bytes_per_job_median']:,} bytes/job over the empty broker"
    )
    if "top_lines" in result:
        print(f"traced by tracemalloc: {result['traced_mib']} MiB; top allocators (file:line):")
        for row in result["top_lines"]:
            print(f"  {row['mib']:8.2f} MiB {row['blocks']:9,} blocks  {row['where']}")
        print("by file:")
        for row in result["top_files"]:
            print(f"  {row['mib']:8.2f} MiB {row['blocks']:9,} blocks  {row['where']}")
    record = result["record"]
    print(f"one pending JobRecord graph: {record['bytes_per_record']:,} bytes (sys.getsizeof):")
    for name, size in record["fields"].items():
        print(f"  {size:7,} B  {name}")


app = program()


@app.command(help=summary(__doc__))
def bench_memory(
    jobs: Count = 100_000,
    queues: Count = 100,
    runs: Count = 1,
    top: Annotated[int, typer.Option(min=1, max=200)] = 25,
    trace: Annotated[bool, typer.Option(help="also the tracemalloc breakdown")] = True,
    json_out: JsonOut = None,
) -> None:
    options = Options(jobs=jobs, queues=queues, runs=runs, top=top, trace=trace)
    emit(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_memory")
