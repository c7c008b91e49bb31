"""Spot notice -> new attempt acknowledged on another cluster.

    python -m load.bench_spot [--clusters 50] [--nodes 200] [--jobs 2000] [--notices 300]
                              [--runs 3] [--json out.json]

Setup per run (fresh subject prefix): the broker in its own process, an embedded nats-server,
and in this process `clusters` fake clusters x `nodes` nodes x 8 GPUs, half of each cluster a
spot pool and half on-demand, on one connection. `jobs` Philly-sized jobs (fixed seed) ask for
`capacity: spot` with a checkpoint location; they simulate long trainings (10^9 steps at 100
steps/s, no periodic checkpoint) and the fake clusters write a checkpoint instantly when asked
(`checkpoint_write_s = 0`), so the workload's own checkpoint time is not counted. A cluster
has one spot pool, so the replacement, which avoids the pool just lost, lands on another
cluster.

Notices, one at a time: pick a running attempt that has run for at least a second, call
`FakeCluster.spot_notice(node, lead_s=120)` on one of its nodes (every job on that node is
affected: a small burst), and wait until every affected job's next attempt is dispatched and
acknowledged by a fake agent (bounded by `--notice-timeout`). Time = that dispatch - the
notice call, same process and clock. The broker's path: SpotNotice batch -> reserve a
placement elsewhere + CheckpointNow -> CheckpointReport batch -> cancel the old attempt +
Dispatch the new one with `resume_from`.

Checked and reported: every new attempt is on another cluster and resumes from exactly the
checkpoint written at the notice (step > 0), and no job ever has two live workloads in the
fleet (checked at every dispatch and after every notice).

Baseline, measured in the same run on the same server: one-at-a-time NATS request/reply round
trip (the path above needs four such exchanges plus two event batches and two persists).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Annotated, Any

import typer

from broker.embedded import EmbeddedNats
from load.command import Count, JsonOut, Nodes, Options, program, summary
from load.common import emit_with_detail, median, percentile
from load.fleetbench import (
    Acked,
    CpuMeter,
    GcWatch,
    Setup,
    gang_of,
    gang_sizes,
    half_spot_flavors,
    raw_request_latency,
    sample_sizes,
    start_setup,
)
from schemas.codec import encode_json
from shell.natsio import flush

SIMULATE = {"total_steps": 10**9, "steps_per_second": 100.0, "checkpoint_every": 10**9}
LEAD_S = 120.0
TARGET_P99_S = 1.0


async def submit_all(setup: Setup, count: int, queues: int, seed: int, max_gpus: int) -> None:
    """Publish `count` spot jobs and wait until every one runs (dispatched and a second old)."""
    sizes = sample_sizes(count, seed=seed, max_gpus=max_gpus)
    for i, gpus in enumerate(sizes):
        job_id = f"s-{i}"
        spec = {
            "name": "spot-bench",
            "job_id": job_id,
            "gang": gang_of(gpus),
            "capacity": "spot",
            "checkpoint": {"uri": f"s3://ckpt/{job_id}"},
            "workload": {"simulate": SIMULATE},
        }
        await setup.nc.publish(setup.subjects.submit(f"q{i % queues}"), encode_json(spec))
        if i % 500 == 499:
            await asyncio.sleep(0)
    await flush(setup.nc)
    if not await setup.log.wait_count(count, timeout=60 + count / 50):
        raise RuntimeError(f"only {len(setup.log.acked)} of {count} jobs were dispatched")


def running_candidates(setup: Setup, min_age_s: float) -> list[tuple[str, str, int, str]]:
    """(cluster, job_id, attempt, node) of attempts running for at least `min_age_s`, on nodes
    without a notice yet."""
    now = time.time()
    out = []
    for name, cluster in setup.fleet.clusters.items():
        for job_id, attempt in cluster.live_workloads():
            rec = next((r for r in cluster.history.get(job_id, []) if r.attempt == attempt), None)
            if rec is None or rec.running_at is None or now - rec.running_at < min_age_s:
                continue
            node = rec.nodes[0]
            info = cluster.node_info(node)
            if info is not None and info.spot_deadline is None:
                out.append((name, job_id, attempt, node))
    return out


def on_node(setup: Setup, cluster: str, node: str) -> list[tuple[str, int]]:
    """Live attempts with a replica on `node`."""
    c = setup.fleet[cluster]
    return [
        (job_id, attempt)
        for job_id, attempt in c.live_workloads()
        if any(r.attempt == attempt and node in r.nodes for r in c.history.get(job_id, []))
    ]


class Watch:
    """Follows the jobs hit by the current notice: when each next attempt is acknowledged, and
    whether a job ever has more than one live workload in the fleet (checked at every
    dispatch of a watched job, i.e. exactly when a second copy could appear)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.waiting: dict[str, int] = {}  # job_id -> attempt hit by the notice
        self.arrived: dict[str, Acked] = {}
        self.done = asyncio.Event()
        # (job_id, live copies, when the second copy was dispatched)
        self.two_copies: list[tuple[str, list[tuple[str, int]], float]] = []

    def arm(self, victims: list[tuple[str, int]]) -> None:
        self.waiting = dict(victims)
        self.arrived = {}
        self.done.clear()

    def check(self, job_id: str) -> None:
        copies = self.setup.fleet.live_copies(job_id)
        if len(copies) > 1:
            self.two_copies.append((job_id, copies, time.perf_counter()))

    def overlaps_ms(self) -> list[float]:
        """How long each double copy lasted: from the check that saw it until the older copy
        was cancelled (inf when it never was)."""
        out = []
        for job_id, copies, seen_at in self.two_copies:
            oldest = min(attempt for _, attempt in copies)
            ended = self.setup.log.cancelled.get((job_id, oldest))
            out.append(float("inf") if ended is None else max(0.0, ended - seen_at) * 1000)
        return out

    def on_dispatch(self, acked: Acked) -> None:
        old = self.waiting.get(acked.job_id)
        if old is None or acked.attempt <= old or acked.job_id in self.arrived:
            return
        self.arrived[acked.job_id] = acked
        self.check(acked.job_id)
        if len(self.arrived) == len(self.waiting):
            self.done.set()


async def describe(
    setup: Setup, job_id: str, attempt: int, cluster: str, node: str
) -> dict[str, Any]:
    """What the broker and the fake cluster say about a job that was not moved in time."""
    out: dict[str, Any] = {"job_id": job_id, "attempt": attempt, "cluster": cluster, "node": node}
    with contextlib.suppress(Exception):
        msg = await setup.nc.request(
            setup.subjects.api("why"), encode_json({"job_id": job_id}), timeout=5
        )
        out["why"] = json.loads(msg.data).get("result")
    rec = next(r for r in setup.fleet[cluster].history.get(job_id, []) if r.attempt == attempt)
    out["fake"] = {"last_checkpoint_step": rec.last_checkpoint_step, "end": rec.end_phase}
    return out


async def notices(setup: Setup, args: Options, rng: random.Random) -> dict[str, Any]:
    """Inject notices one at a time; per affected job, the time to its next attempt's ack."""
    watch = Watch(setup)
    setup.log.listeners.append(watch.on_dispatch)
    latencies: list[float] = []
    per_notice: list[int] = []
    problems: dict[str, int] = {
        "timed_out": 0,
        "same_cluster": 0,
        "wrong_resume_step": 0,
        "no_progress_kept": 0,
    }
    stuck: list[dict[str, Any]] = []
    cpu = CpuMeter(setup.pids)
    run_deadline = time.monotonic() + args.max_s
    sent = 0
    try:
        while sent < args.notices and time.monotonic() < run_deadline:
            candidates = running_candidates(setup, min_age_s=1.0)
            if not candidates:
                await asyncio.sleep(0.2)
                continue
            cluster, _, _, node = rng.choice(candidates)
            victims = on_node(setup, cluster, node)
            watch.arm(victims)
            t0 = time.perf_counter()
            if setup.fleet[cluster].spot_notice(node, lead_s=LEAD_S) is None:
                continue
            sent += 1
            per_notice.append(len(victims))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.notice_timeout):
                    await watch.done.wait()
            problems["timed_out"] += len(victims) - len(watch.arrived)
            for job_id, attempt in victims:
                if job_id not in watch.arrived and len(stuck) < 5:
                    stuck.append(await describe(setup, job_id, attempt, cluster, node))
            for job_id, attempt in victims:
                new = watch.arrived.get(job_id)
                if new is None:
                    continue
                latencies.append(new.at - t0)
                if new.cluster == cluster:
                    problems["same_cluster"] += 1
                old = next(r for r in setup.fleet[cluster].history[job_id] if r.attempt == attempt)
                if new.resume_step is None or new.resume_step != old.last_checkpoint_step:
                    problems["wrong_resume_step"] += 1
                if not new.resume_step:
                    problems["no_progress_kept"] += 1
                watch.check(job_id)
            await asyncio.sleep(args.gap_s)
    finally:
        setup.log.listeners.remove(watch.on_dispatch)
    return {
        "notices": sent,
        "replaced": len(latencies),
        "jobs_per_notice_mean": round(sum(per_notice) / max(1, len(per_notice)), 2),
        "p50_s": percentile(latencies, 50),
        "p90_s": percentile(latencies, 90),
        "p99_s": percentile(latencies, 99),
        "max_s": max(latencies) if latencies else float("nan"),
        "problems": problems,
        "two_live_copies": len(watch.two_copies),
        "two_live_copies_max_ms": round(max(watch.overlaps_ms(), default=0.0), 3),
        "two_live_copies_examples": [(j, c) for j, c, _ in watch.two_copies[:3]],
        "timed_out_examples": stuck,
        "cpu": cpu.shares(),
    }


async def one_run(url: str, nats_pid: int, args: Options, run: int) -> dict[str, Any]:
    setup = await start_setup(
        url,
        clusters=args.clusters,
        flavors=half_spot_flavors(args.nodes),
        queues=args.queues,
        fake={"checkpoint_write_s": 0.0, "start_delay_s": 0.5, "spot_notice_s": LEAD_S},
    )
    setup.pids["nats"] = nats_pid
    gcw = GcWatch()
    try:
        await submit_all(setup, args.jobs, args.queues, args.seed + run, args.max_gpus)
        await asyncio.sleep(1.5)  # every job has run for a second: there is work to keep
        gcw.quiet()
        out = await notices(setup, args, random.Random(args.seed + run))
        out["bench_gc"] = gcw.take()
        return out
    finally:
        gcw.close()
        await setup.close()


async def main_async(args: Options) -> dict[str, Any]:
    _, source = gang_sizes()
    print(
        f"spot bench: {args.clusters} clusters x {args.nodes} nodes x 8 GPUs (half spot); "
        f"{args.jobs} running spot jobs; {args.notices} notices; gang sizes from {source}"
    )
    runs: list[dict[str, Any]] = []
    rr: list[dict[str, float]] = []
    async with EmbeddedNats() as server:
        assert server.proc is not None
        for run in range(args.runs):
            rr.append(await raw_request_latency(server.url))
            runs.append(await one_run(server.url, server.proc.pid, args, run))
            r = runs[-1]
            print(
                f"  run {run + 1}: {r['notices']} notices, {r['replaced']} jobs moved "
                f"(~{r['jobs_per_notice_mean']} per notice): p50 {r['p50_s'] * 1000:.0f} ms, "
                f"p90 {r['p90_s'] * 1000:.0f} ms, p99 {r['p99_s'] * 1000:.0f} ms, max "
                f"{r['max_s'] * 1000:.0f} ms; problems {r['problems']}; two live copies "
                f"{r['two_live_copies']} (longest {r['two_live_copies_max_ms']} ms); "
                f"CPU {r['cpu']}; raw request/reply p99 {rr[-1]['p99_ms']:.2f} ms"
            )
    p99s = [r["p99_s"] for r in runs]
    rr_p99 = median([x["p99_ms"] for x in rr])
    problems = {k: sum(r["problems"][k] for r in runs) for k in runs[0]["problems"]}
    result: dict[str, Any] = {
        "bench": "spot",
        "clusters": args.clusters,
        "nodes_per_cluster": args.nodes,
        "jobs": args.jobs,
        "notices": args.notices,
        "runs": args.runs,
        "replaced_total": sum(r["replaced"] for r in runs),
        "p50_ms_median": round(median([r["p50_s"] for r in runs]) * 1000, 1),
        "p90_ms_median": round(median([r["p90_s"] for r in runs]) * 1000, 1),
        "p99_ms_median": round(median(p99s) * 1000, 1),
        "max_ms_median": round(median([r["max_s"] for r in runs]) * 1000, 1),
        "p99_ms": [round(x * 1000, 1) for x in p99s],
        "raw_request_p50_ms": round(median([x["p50_ms"] for x in rr]), 3),
        "raw_request_p99_ms": round(rr_p99, 3),
        "ratio_p99_vs_raw_request_p99": round(median(p99s) * 1000 / rr_p99, 1),
        "problems": problems,
        "resumed_from_checkpoint": problems["wrong_resume_step"] == 0
        and problems["no_progress_kept"] == 0,
        "on_another_cluster": problems["same_cluster"] == 0,
        "two_live_copies": sum(r["two_live_copies"] for r in runs),
        "two_live_copies_max_ms": max(r["two_live_copies_max_ms"] for r in runs),
        "target_p99_ms": TARGET_P99_S * 1000,
        "detail": runs,
    }
    print(
        f"spot: median p50 {result['p50_ms_median']} ms, p99 {result['p99_ms_median']} ms "
        f"(target 1000; raw request p99 {rr_p99:.2f} ms); {result['replaced_total']} jobs moved, "
        f"problems {problems}, two live copies {result['two_live_copies']}"
    )
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_spot(
    clusters: Count = 50,
    nodes: Nodes = 200,
    jobs: Annotated[int, typer.Option(min=1, help="running spot jobs")] = 2000,
    notices: Count = 300,
    queues: Count = 10,
    max_gpus: Annotated[int, typer.Option(min=1, help="largest Philly gang used")] = 64,
    gap_s: Annotated[float, typer.Option(min=0.0, help="pause between notices")] = 0.05,
    notice_timeout: Annotated[float, typer.Option(min=0.0)] = 10.0,
    max_s: Annotated[float, typer.Option(min=0.0, help="time bound per run")] = 300.0,
    runs: Count = 3,
    seed: int = 20171009,
    json_out: JsonOut = None,
) -> None:
    options = Options(**{k: v for k, v in locals().items() if k != "json_out"})
    emit_with_detail(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_spot")
