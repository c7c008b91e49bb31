"""A leader's restore, in process: reading the persisted records from the job bucket, decoding
them and rebuilding the core from them (`Machine.handle(Restore)`), the parts of a restart
`load.bench_scale` times only as a whole with a process start around them.

    python -m load.bench_restore [--jobs 100000] [--runs 3] [--baseline DIR] [--json out.json]

The records are the jobs `load.bench_scale` submits (pending, spread over 100 queues), built as
the broker builds them and encoded as the store writes them. Each run is a fresh process with
the cycle collector off, as the broker runs its restore, and reports CPU seconds of its own
(the read's nats-server, on 127.0.0.1, is another process). The read is a never-started
`RecordMirror`'s `caught_up`, what a restarted broker that leads at once runs, over a bucket the
run fills first, from a fresh connection; it includes the records' decode (the restart's own,
`broker.store`'s taker). The core is rebuilt from the records that read returned, as a restart
rebuilds it; `decode` alone is the plain decoder's (`record_decoder`) on the same bytes;
`snapshot read` is the same read once a snapshot of the bucket is written (broker/snapshot.py),
so it takes the snapshot and nothing after it. With
`--baseline DIR` (another checkout, e.g. `git worktree add` of an older commit) every run is
repeated there, interleaved, its own code doing the work. Prints every run, the medians and
one `RESULT {...}` line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from load.command import Baseline, Count, JsonOut, Options, program, summary, trees
from load.common import emit, median

REPO = Path(__file__).resolve().parents[1]
QUEUES = 100
PARTS = ("read_cpu_s", "snapshot_read_cpu_s", "decode_cpu_s", "restore_cpu_s")


def one_run(jobs: int) -> dict[str, float]:
    """CPU seconds to decode `jobs` encoded records (the plain decoder), to read them from a
    bucket (the restart's read, its decode included) and to restore a Machine from the
    records read, in the tree this process imports from."""
    from broker.core.inputs import Restore
    from broker.core.machine import Machine
    from broker.core.records import JobRecord, record_decoder, record_encoder
    from load.bench_scale import job
    from schemas.codec import decode_jobspec
    from schemas.config import BrokerConfig, QueueConfig

    config = BrokerConfig(queues=[QueueConfig(name=f"q{i}") for i in range(QUEUES)])
    rng = random.Random(7)
    blobs = []
    for i in range(jobs):
        spec = decode_jobspec(job(i, rng))
        record = JobRecord(
            job_id=spec.job_id or "", spec=spec, queue=f"q{i % QUEUES}", order=i, submitted_at=0.0
        )
        blobs.append(record_encoder.encode(record))
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    records = [record_decoder.decode(b) for b in blobs]
    t1 = time.process_time()
    gc.enable()
    read, snapshot_read, restored = asyncio.run(read_cpu_s(records))
    gc.collect()
    gc.disable()
    t2 = time.process_time()
    Machine(config, epoch=1).handle(Restore(restored), 1.0)
    t3 = time.process_time()
    gc.enable()
    times = {"read_cpu_s": read, "decode_cpu_s": t1 - t0, "restore_cpu_s": t3 - t2}
    if snapshot_read is not None:
        times["snapshot_read_cpu_s"] = snapshot_read
    return times


async def read_cpu_s(records: list[Any]) -> tuple[float, float | None, list[Any]]:
    """CPU seconds to read these records back from a job bucket, cycle collector off, the
    same from its snapshot, and the records read (what a restart restores the core from)."""
    import nats

    from broker.embedded import EmbeddedNats
    from broker.store import JobStore

    server = EmbeddedNats()
    server.start_sync()
    try:
        writer = await nats.connect(server.url)
        store = await JobStore.open(writer.jetstream(), "jobs", 1, writer)
        for at in range(0, len(records), 1000):
            await store.put_many(records[at : at + 1000])
        await writer.close()
        read_s, read = await timed_read(server.url, len(records))
        snapshot_s = await snapshot_read_s(server.url, len(records))
        return read_s, snapshot_s, read
    finally:
        server.cleanup()


async def timed_read(url: str, expect: int) -> tuple[float, list[Any]]:
    """A never-started mirror's read of the bucket from a fresh connection, cycle collector
    off: its CPU seconds and the records."""
    import nats

    from broker.store import JobStore, RecordMirror

    reader = await nats.connect(url)
    store = JobStore(reader.jetstream(), "jobs", reader)
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    mirror = RecordMirror(store)
    read = await mirror.caught_up(60.0)
    t1 = time.process_time()
    gc.enable()
    assert len(read) == expect, f"read {len(read)} of {expect} records"
    await mirror.stop()
    await reader.close()
    return t1 - t0, read


async def snapshot_read_s(url: str, expect: int) -> float | None:
    """The same read once a snapshot of the bucket is written (broker/snapshot.py; its
    writing not timed), or None in a tree that writes none."""
    import nats

    try:
        from broker.snapshotwriter import write_snapshot
    except ImportError:
        return None
    from broker.store import JobStore

    writer = await nats.connect(url)
    await write_snapshot(JobStore(writer.jetstream(), "jobs", writer))
    await writer.close()
    return (await timed_read(url, expect))[0]


def run_in(tree: Path, jobs: int) -> dict[str, float]:
    """One run in a fresh process that imports `tree`'s code first (this file runs there)."""
    proc = subprocess.run(
        [sys.executable, __file__, "--one", str(jobs)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"restore run in {tree} failed: {proc.stderr[-2000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_restore(
    jobs: Annotated[int, typer.Option(min=1, help="records to restore")] = 100_000,
    runs: Count = 3,
    baseline: Baseline = None,
    json_out: JsonOut = None,
) -> None:
    run_bench(Options(jobs=jobs, runs=runs, baseline=baseline, json=json_out))


def run_bench(args: Options) -> dict[str, Any]:
    checkouts = trees(REPO, args.baseline)
    seen: dict[str, dict[str, list[float]]] = {t: {p: [] for p in PARTS} for t in checkouts}
    for r in range(args.runs):
        for label, tree in checkouts.items():
            one = run_in(tree, args.jobs)
            for part in PARTS:
                if part in one:  # a tree that writes no snapshot reads none
                    seen[label][part].append(round(one[part], 3))
            print(f"run {r + 1} {label}: {_parts(one)}")
    result: dict[str, Any] = {"bench": "restore", "jobs": args.jobs, "runs": args.runs}
    for label, parts in seen.items():
        kept = {p: v for p, v in parts.items() if v}
        result[label] = {
            **{f"{p}_median": median(v) for p, v in kept.items()},
            **{f"{p}_runs": v for p, v in kept.items()},
        }
        medians = {p: median(v) for p, v in kept.items()}
        print(f"{label}: {_parts(medians)} (medians of {args.runs})")
    emit(result, args.json)
    return result


def _parts(cpu_s: dict[str, float]) -> str:
    return ", ".join(
        f"{p.removesuffix('_cpu_s').replace('_', ' ')} {cpu_s[p]:.3f} CPU-s"
        for p in PARTS
        if p in cpu_s
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:  # one run, in the process `run_in` started
        print(json.dumps(one_run(int(sys.argv[2]))))
    else:
        app()
