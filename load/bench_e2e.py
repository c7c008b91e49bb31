"""End-to-end admissions: submit -> dispatch acknowledged by a fake agent.

    python -m load.bench_e2e [--clusters 50] [--nodes 200] [--jobs 20000] [--rate 1000]
                             [--latency-jobs 10000] [--runs 3] [--json out.json]
                             [--fleet in-process|process|both] [--trace] [--stalls-ms MS]
                             [--cpus shared|broker-own-core] [--burners N] [--baseline DIR]
                             [--broker-log-level warning|info]

Setup per run (fresh subject prefix, so fresh streams and buckets): the broker in its own
process (`muster broker`), an embedded nats-server, and in this process 50 fake clusters x 200
nodes x 8 GPUs (half spot, half on-demand) on one connection plus the load generator. Jobs are
plain JSON JobSpecs with client job ids, published to `<prefix>.submit.q<i>`; their gang sizes
are Philly's (a fixed-seed sample of data/traces/philly.csv, mapped as in load/traces.py)
and they simulate long trainings (10^9 steps at 1 step/s, no checkpoint), so nothing finishes
during a run: every job holds its GPUs and capacity only shrinks. Each run admits jobs + latency
jobs (~1.3 GPUs each on average), well under the fleet's 80,000 GPUs, so capacity is never the
limit. The fake clusters mark a workload running 1 s after its dispatch, so the broker also
handles (and persists) those `running` transitions while it admits: the steady-state load.

Figure A (throughput): all `--jobs` are published as fast as one connection can; the time each
Dispatch is carried out by a fake agent is recorded (the agent acks right after). Admissions/s =
jobs / (last dispatch - first publish). The rate between the 10th and 90th percentile dispatch
(`steady`) is also reported.

Figure B (latency): then `--latency-jobs` more are published at `--rate` per second (paced on a
1 ms timer, bounded by count and by time); latency = agent dispatch time - publish time, same
clock. p50/p90/p99/max.

By default the 50 fake agents share this process, so its cycle collector is frozen and off
during each measured window (`fleetbench.GcWatch`): a 150 ms full collection here would stall
every agent at once and be charged to the broker. Even so the fleet's own work (commands,
heartbeats, fences) runs on the loop that paces the publishes and stamps them. `--fleet
process` runs the fleet in a process of its own (load/fleetproc.py), which stamps each Dispatch
with `time.time()` and reports it on a NATS subject; this process then only publishes and
measures, on the same clock. `--fleet both` measures each layout in every run. `--trace`
also splits figure B into stages (publish -> `queued` event -> `admitted` event -> agent
dispatch) from the broker's job events.

Both figures also give the broker's CPU per job (`broker_cpu_ms_per_job`: its CPU seconds over
the window divided by the jobs dispatched in it): on a shared machine the wall-clock figures
mostly measure how long the broker waited for a core, its CPU per job what it cost. How long
each process waited for a core is measured too (`wait_ms_per_job`, from Linux schedstat, with
the VM's steal time), and figure B sets the broker's waits in the 250 ms windows that held the
slowest submissions against those of the others (`broker_wait_ms_per_250ms`).

`--cpus broker-own-core` gives the broker the first core and every other process (nats-server,
this one, a fleet process) the rest, by CPU affinity: the broker of a deployment, whose pod has
a CPU of its own (load/cpus.py), rather than one sharing two cores with its load generator.

`--burners N` runs N busy processes (`load.cpus.burners`) beside all of these, at the same
priority, from before the first baseline to after the last run: the figures "beside two CPU
burners" (`--burners 2`), where every process waits its turn for a core.

`--baseline DIR` runs another checkout's broker alike, run by run, the order alternating; each
run also counts the writes to the job bucket per job (its stream's sequence, read from the
server, so both trees are counted alike).

Baselines, measured in the same run on the same server: raw NATS pub->sub msgs/s
(`load.common.raw_nats_baseline`) and one-at-a-time NATS request/reply round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import os
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any

import nats
import typer

from broker.embedded import EmbeddedNats
from load.command import Baseline, Count, JsonOut, Nodes, Options, program, summary, trees
from load.common import (
    BROKER_PROGRAM,
    REPO,
    bytecode_cached,
    emit_with_detail,
    median,
    percentile,
    raw_nats_baseline,
)
from load.cpus import Placement, burners, pin, split
from load.fleetbench import (
    CpuMeter,
    EventTrace,
    GcWatch,
    Setup,
    gang_of,
    gang_sizes,
    half_spot_flavors,
    proc_wait_s,
    raw_request_latency,
    sample_sizes,
    start_setup,
)
from schemas.codec import encode_json
from schemas.config import Timeouts
from shell.cli import EventLoopFlag, EventLoopOpt, loop_factory
from shell.natsio import flush


class BrokerLogLevel(enum.Enum):
    """The broker process's log level (`muster broker --log-level`)."""

    warning = "warning"
    info = "info"


class FleetLayout(enum.Enum):
    """Where the fake fleet runs: beside the load generator (one event loop and clock for
    both), in a process of its own (load/fleetproc.py), or each in turn."""

    in_process = "in-process"
    process = "process"
    both = "both"

    def layouts(self) -> list[FleetLayout]:
        return [FleetLayout.in_process, FleetLayout.process] if self is FleetLayout.both else [self]


SIMULATE = {"total_steps": 10**9, "steps_per_second": 1.0, "checkpoint_every": 10**9}
TARGET_RATE = 2000.0
TARGET_P99_MS = 50.0


def payloads(setup: Setup, tag: str, sizes: list[int], queues: int) -> list[tuple[str, str, bytes]]:
    """(job_id, subject, JSON) for each job, encoded before the clock starts."""
    out = []
    for i, gpus in enumerate(sizes):
        job_id = f"{tag}-{i}"
        spec = {
            "name": "bench",
            "job_id": job_id,
            "gang": gang_of(gpus),
            "capacity": "any",
            "checkpoint": {"uri": f"s3://ckpt/{job_id}"},
            "workload": {"simulate": SIMULATE},
        }
        out.append((job_id, setup.subjects.submit(f"q{i % queues}"), encode_json(spec)))
    return out


async def burst(setup: Setup, jobs: list[tuple[str, str, bytes]], timeout: float) -> dict[str, Any]:
    """Figure A: publish everything at once, time until the last dispatch is acked."""
    nc, log = setup.nc, setup.log
    base = len(log.acked)
    cpu = CpuMeter(setup.pids)
    started = log.clock()  # the clock the fleet stamps dispatches with
    for k, (_, subject, data) in enumerate(jobs):
        await nc.publish(subject, data)
        if k % 500 == 499:
            await asyncio.sleep(0)  # let the client's flusher and the fleet run
    await flush(nc)
    published = log.clock()
    complete = await log.wait_count(base + len(jobs), timeout)
    shares, used, waits = cpu.shares(), cpu.used(), cpu.waits()
    ids = {job_id for job_id, _, _ in jobs}
    times = sorted(a.at for a in log.acked[base:] if a.job_id in ids and a.attempt == 1)
    n = len(times)
    if n == 0:
        raise RuntimeError("no job was dispatched")
    elapsed = times[-1] - started
    lo, hi = times[int(0.1 * (n - 1))], times[int(0.9 * (n - 1))]
    steady = (int(0.9 * (n - 1)) - int(0.1 * (n - 1))) / (hi - lo) if hi > lo else float("nan")
    return {
        "jobs": len(jobs),
        "admitted": n,
        "complete": complete,
        "publish_s": published - started,
        "elapsed_s": elapsed,
        # How long the first Dispatch took: the burst's start-up, which `steady_per_s` leaves out.
        "first_dispatch_s": times[0] - started,
        "admissions_per_s": n / elapsed,
        "steady_per_s": steady,
        "cpu": shares,
        "broker_cpu_ms_per_job": used["broker"] * 1000 / n,
        "wait_ms_per_job": per_job_ms(waits, n),
    }


MAX_LAG_SAMPLES = 200_000  # bounded like any load loop: 200 s of 1 ms timers


class LoopLag:
    """How late this process's event loop runs a 1 ms timer over figure B's window. Every
    submission is published and every Dispatch stamped on this loop, so its lag is charged
    to the broker's latency. Many short callbacks in a row show here and not in
    `--stalls-ms`, which sees single long ones: the fake agents' fence extensions, back to
    back once a second, were found this way."""

    def __init__(self) -> None:
        self.lags_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while len(self.lags_ms) < MAX_LAG_SAMPLES:
            t = loop.time()
            await asyncio.sleep(0.001)
            self.lags_ms.append((loop.time() - t - 0.001) * 1000)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        lags = self.lags_ms or [0.0]
        return {
            "p50_ms": round(percentile(lags, 50), 2),
            "p99_ms": round(percentile(lags, 99), 2),
            "max_ms": round(max(lags), 2),
            "over_5ms": sum(1 for lag in lags if lag > 5),
            "samples": len(self.lags_ms),
        }


async def paced(
    setup: Setup,
    jobs: list[tuple[str, str, bytes]],
    rate: float,
    timeout: float,
    trace: EventTrace | None = None,
) -> dict[str, Any]:
    """Figure B: publish at `rate`/s; latency = dispatch acked - published, in ms."""
    nc, log = setup.nc, setup.log
    clock = log.clock  # the clock the fleet stamps dispatches with
    sent_at: dict[str, float] = {}
    total = len(jobs)
    cpu = CpuMeter(setup.pids)
    started = clock()
    stop_at = started + total / rate * 2 + 10  # bounded in time even if the loop lags
    sent = 0
    broker = setup.pids["broker"]
    waited = [proc_wait_s(broker)]  # the broker's wait for a core at each 250 ms window's start
    while sent < total and clock() < stop_at:
        if int((clock() - started) * 4) >= len(waited):
            waited.append(proc_wait_s(broker))
        due = min(total, int((clock() - started) * rate) + 1)
        while sent < due:
            job_id, subject, data = jobs[sent]
            sent_at[job_id] = clock()
            await nc.publish(subject, data)
            sent += 1
        await asyncio.sleep(0.001)
    send_s = clock() - started
    await flush(nc)
    deadline = time.monotonic() + timeout
    waiting = [j for j in sent_at if j not in log.first]
    while waiting and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        waiting = [j for j in waiting if j not in log.first]
    shares, used, waits = cpu.shares(), cpu.used(), cpu.waits()
    stages = trace.breakdown(sent_at, log) if trace is not None else {}
    lat = [(log.first[j].at - t) * 1000 for j, t in sent_at.items() if j in log.first]
    # Worst latency per 250 ms of publishing: tells a stall (a few bad windows) from overload.
    windows: dict[int, float] = {}
    for j, t in sent_at.items():
        if j in log.first:
            w = int((t - started) * 4)
            windows[w] = max(windows.get(w, 0.0), (log.first[j].at - t) * 1000)
    return {
        "jobs": total,
        "sent": sent,
        "dispatched": len(lat),
        "offered_per_s": sent / send_s,
        "p50_ms": percentile(lat, 50),
        "p90_ms": percentile(lat, 90),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else float("nan"),
        "cpu": shares,
        "broker_cpu_ms_per_job": used["broker"] * 1000 / max(len(lat), 1),
        "wait_ms_per_job": per_job_ms(waits, len(lat)),
        "stages_ms": stages,
        "worst_ms_per_250ms": [round(windows[w], 1) for w in sorted(windows)],
        "broker_wait_ms_per_250ms": [round((b - a) * 1000, 2) for a, b in pairwise(waited)],
        "broker_wait_in_slow_windows": slow_window_waits(windows, waited),
    }


def per_job_ms(waits: dict[str, float], jobs: int) -> dict[str, float]:
    """Each process's wait for a core, and the VM's steal, in ms per job of the window."""
    return {name: round(s * 1000 / max(jobs, 1), 4) for name, s in waits.items()}


def slow_window_waits(worst: dict[int, float], waited: list[float]) -> dict[str, float]:
    """The broker's median wait for a core (ms) in the 250 ms windows whose slowest
    submission is among the slowest 5 % of windows, and in the other windows: equal when the
    tail is not the broker waiting for a core."""
    spent = {w: (waited[w + 1] - waited[w]) * 1000 for w in worst if w + 1 < len(waited)}
    if len(spent) < 2:
        return {}
    ranked = sorted(spent, key=lambda w: -worst[w])
    cut = max(1, len(ranked) // 20)
    return {
        "slow": round(median([spent[w] for w in ranked[:cut]]), 2),
        "other": round(median([spent[w] for w in ranked[cut:]]), 2),
        "windows": len(ranked),
    }


async def one_run(
    url: str,
    nats_pid: int,
    args: Options,
    run: int,
    fleet: FleetLayout,
    tree: Path | None,
    broker_cores: set[int],
) -> dict[str, Any]:
    """One run of both figures; `broker_cores`: the cores the broker runs on alone (none:
    it shares them all)."""
    probe = StallRecord(args.stalls_ms) if args.stalls_ms else None
    setup = await start_setup(
        url,
        clusters=args.clusters,
        flavors=half_spot_flavors(args.nodes),
        queues=args.queues,
        fleet_process=fleet is FleetLayout.process,
        broker_program=probe.program if probe is not None else BROKER_PROGRAM,
        broker_tree=tree,
        broker_log_level=args.broker_log_level.value,
    )
    setup.pids["nats"] = nats_pid
    window: tuple[float, float] | None = None
    try:
        if broker_cores:
            pin(setup.pids["broker"], broker_cores)  # started on the others, as a child
        sizes = sample_sizes(args.jobs + args.latency_jobs, seed=args.seed + run)
        burst_jobs = payloads(setup, f"a{run}", sizes[: args.jobs], args.queues)
        paced_jobs = payloads(setup, f"b{run}", sizes[args.jobs :], args.queues)
        writes = KvWrites(url, setup)
        before = await writes.count()
        gcw = GcWatch()
        gcw.quiet()
        counted = await broker_stats(setup)
        a = await burst(setup, burst_jobs, timeout=60 + args.jobs / 100)
        a["bench_gc"] = gcw.take()
        burst_counted = await broker_stats(setup)
        a["dispatches_per_request"] = per_request(counted, burst_counted)
        # Let the `running` transitions of the burst settle before measuring latency.
        await asyncio.sleep(args.settle_s)
        trace = await EventTrace.start(setup) if args.trace else None
        gcw.quiet()
        paced_from = time.time()
        lag = LoopLag() if probe is not None else None
        if lag is not None:
            lag.start()
        b = await paced(setup, paced_jobs, args.rate, timeout=30, trace=trace)
        if lag is not None:
            b["bench_loop_lag"] = await lag.stop()
        window = (paced_from, time.time())
        b["dispatches_per_request"] = per_request(burst_counted, await broker_stats(setup))
        b["bench_gc"] = gcw.take()
        gcw.close()
        if trace is not None:
            await trace.stop()
        # The `running` reports (1 s after a dispatch) and writes deferred behind them land.
        await asyncio.sleep(args.settle_s + Timeouts().deferred_write_s)
        jobs = a["admitted"] + b["dispatched"]
        b["kv_puts_per_job"] = per_job(before, await writes.count(), jobs)
        cores = {name: sorted(os.sched_getaffinity(pid)) for name, pid in setup.pids.items()}
        cores["bench"] = sorted(os.sched_getaffinity(0))
        return {"burst": a, "paced": b, "broker": await broker_stats(setup), "cores": cores}
    finally:
        await setup.close()
        if probe is not None and window is not None:
            b["broker_stalls"] = probe.summary(*window)


def _totals(rows: list[dict[str, Any]], key: str, measures: tuple[str, ...]) -> dict[str, Any]:
    """Per value of `key`: how many rows, and the total and largest of each measure."""
    out: dict[str, Any] = {}
    for row in rows:
        agg = out.setdefault(str(row[key]), {"count": 0})
        agg["count"] += 1
        for m in measures:
            agg[f"{m}_total"] = round(agg.get(f"{m}_total", 0.0) + row[m], 1)
            agg[f"{m}_max"] = max(agg.get(f"{m}_max", 0.0), row[m])
    return out


class StallRecord:
    """The broker under `load.stallprobe` for one run: its loop turns longer than `ms` and its
    cycle-collector passes, read back after the broker exits and cut to figure B's window."""

    def __init__(self, ms: float) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="muster-stalls-")
        self.path = Path(self._tmp.name) / "stalls.json"
        script = REPO / "load" / "stallprobe.py"  # any checkout's broker runs under it
        self.program = (str(script), str(self.path), str(ms))  # what runs the broker

    def summary(self, start: float, end: float) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {"error": "the broker wrote no stall record (killed?)"}
        finally:
            self._tmp.cleanup()
        turns = [t for t in data["turns"] if start <= t["at"] <= end]
        gcs = [c for c in data["collections"] if start <= c["at"] <= end]
        bucket = data["call_bucket_s"]
        calls = [kinds for at, kinds in data["calls"] if start <= at and at + bucket <= end]
        covered_s = len(calls) * bucket
        return {
            "threshold_ms": data["threshold_ms"],
            "turns": len(turns),
            "turns_wall_ms": round(sum(t["wall_ms"] for t in turns), 1),
            "turns_cpu_ms": round(sum(t["cpu_ms"] for t in turns), 1),
            "longest": sorted(turns, key=lambda t: -t["wall_ms"])[:8],
            "by_task": _totals(turns, "what", ("wall_ms", "cpu_ms")),
            "gc_by_generation": _totals(gcs, "generation", ("pause_ms", "cpu_ms", "collected")),
            "calls_covered_s": round(covered_s, 1),
            "calls_by_task": _call_rates(calls, covered_s),
        }


def _call_rates(buckets: list[dict[str, list[float]]], covered_s: float) -> dict[str, Any]:
    """Each kind's callbacks and their CPU ms per second over the buckets, most first."""
    totals: dict[str, list[float]] = {}
    for kinds in buckets:
        for name, (n, cpu_ms) in kinds.items():
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += n
            entry[1] += cpu_ms
    if covered_s <= 0:
        return {}
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        name: {"per_s": round(n / covered_s, 1), "cpu_ms_per_s": round(c / covered_s, 2)}
        for name, (n, c) in ranked
    }


def per_request(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """The Dispatches acknowledged per Dispatch request between two of the broker's stats
    (None from a broker that does not count its requests)."""
    if "dispatch_requests" not in before or "dispatch_requests" not in after:
        return None
    requests = after["dispatch_requests"] - before["dispatch_requests"]
    acked = after["dispatch_acked"] - before["dispatch_acked"]
    return round(acked / requests, 2) if requests > 0 else None


async def broker_stats(setup: Setup) -> dict[str, Any]:
    """The broker's stats after a run; on a saturated machine its answer can take longer than
    a request's 10 s, which must not throw away the run's figures."""
    for timeout in (10, 30):
        with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
            return await setup.broker.stats(setup.nc, timeout=timeout)
    return {"event_loop": "unknown (the broker's stats did not come in 40 s)"}


class KvWrites:
    """Writes to the job bucket, counted by the server (its stream's last sequence: one per
    put or delete), so any broker tree is measured alike. Asked on a connection of its own:
    the fleet's, busy with every agent's traffic, answered too late on a loaded machine."""

    def __init__(self, url: str, setup: Setup) -> None:
        self._url = url
        self._stream = f"KV_{setup.subjects.jobs_bucket}"

    async def count(self) -> int | None:
        """The bucket's writes so far; None when the server did not answer in time."""
        try:
            nc = await nats.connect(self._url, connect_timeout=10, max_reconnect_attempts=1)
        except Exception:
            return None
        try:
            info = await nc.jetstream(timeout=30).stream_info(self._stream)
            return int(info.state.last_seq)
        except Exception:
            return None
        finally:
            await nc.close()


def per_job(before: int | None, after: int | None, jobs: int) -> float | None:
    if before is None or after is None:
        return None
    return round((after - before) / max(jobs, 1), 3)


def _fmt_run(r: dict[str, Any]) -> str:
    a, b = r["burst"], r["paced"]
    return (
        f"admissions {a['admissions_per_s']:,.0f}/s ({a['admitted']}/{a['jobs']} in "
        f"{a['elapsed_s']:.2f} s, the first after {a['first_dispatch_s']:.2f} s, steady "
        f"{a['steady_per_s']:,.0f}/s, CPU "
        f"{_cpu(a['cpu'])}, broker {a['broker_cpu_ms_per_job']:.3f} ms CPU/job); latency at "
        f"{b['offered_per_s']:,.0f}/s: p50 "
        f"{b['p50_ms']:.1f} p90 {b['p90_ms']:.1f} p99 {b['p99_ms']:.1f} max {b['max_ms']:.1f} ms "
        f"({b['dispatched']}/{b['jobs']} dispatched, CPU {_cpu(b['cpu'])}, broker "
        f"{b['broker_cpu_ms_per_job']:.3f} ms CPU/job, bench GC "
        f"{b['bench_gc']}, broker waited {b['wait_ms_per_job']['broker']:.3f} ms/job for a core, "
        f"{b['broker_wait_in_slow_windows'].get('slow', 0):.1f} ms in the slowest windows "
        f"against {b['broker_wait_in_slow_windows'].get('other', 0):.1f}); KV puts per job "
        f"{b['kv_puts_per_job']}; Dispatches a request {a['dispatches_per_request']} (burst), "
        f"{b['dispatches_per_request']} (paced)"
        + (f"; stages p50/p99 ms {b['stages_ms']}" if b["stages_ms"] else "")
    )


def latency_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Figure B of some runs: medians and every run, with each run's load and raw p99."""
    paced = [r["paced"] for r in runs]
    stalled = all("broker_stalls" in p for p in paced)
    return (
        {
            f"{q}_ms_median": round(median([p[f"{q}_ms"] for p in paced]), 2)
            for q in ("p50", "p90", "p99")
        }
        | {
            "p99_ms": [round(p["p99_ms"], 2) for p in paced],
            "raw_request_p99_ms": [r["raw_request_p99_ms"] for r in runs],
            "load_average_1m": [r["load_average_1m"] for r in runs],
            "broker_cpu_ms_per_job": [round(p["broker_cpu_ms_per_job"], 4) for p in paced],
            "wait_ms_per_job": [p["wait_ms_per_job"] for p in paced],
            "broker_wait_in_slow_windows": [p["broker_wait_in_slow_windows"] for p in paced],
            "all_dispatched": all_dispatched(runs),
        }
        | (
            {
                "broker_stalls": [
                    stall_digest(p["broker_stalls"], p["offered_per_s"]) for p in paced
                ],
                "bench_loop_lag": [p.get("bench_loop_lag") for p in paced],
            }
            if stalled
            else {}
        )
    )


def stall_digest(stalls: dict[str, Any], offered_per_s: float) -> dict[str, Any]:
    """One run's `--stalls-ms` record in brief: long turns, GC passes per generation, and the
    broker's event-loop callbacks per job (all of them, per second over the paced rate)."""
    gc_passes = stalls.get("gc_by_generation", {})
    calls = stalls.get("calls_by_task", {})
    per_job = sum(c["per_s"] for c in calls.values()) / offered_per_s if calls else None
    return {
        "callbacks_per_job": None if per_job is None else round(per_job, 2),
        "callbacks_per_job_by_task": {
            name: round(c["per_s"] / offered_per_s, 2) for name, c in list(calls.items())[:12]
        },
        "long_turns": stalls.get("turns"),
        "long_turns_cpu_ms": stalls.get("turns_cpu_ms"),
        "gc_passes": {g: v["count"] for g, v in gc_passes.items()},
        "gc_cpu_ms": round(sum(v["cpu_ms_total"] for v in gc_passes.values()), 1),
        "gc_max_cpu_ms": max((v["cpu_ms_max"] for v in gc_passes.values()), default=0.0),
        # objects the passes reclaimed: the cyclic garbage the broker makes (the rest is freed
        # by reference counting)
        "gc_collected": {g: int(v["collected_total"]) for g, v in gc_passes.items()},
    }


def all_dispatched(runs: list[dict[str, Any]]) -> bool:
    return all(
        r["burst"]["complete"] and r["paced"]["dispatched"] == r["paced"]["jobs"] for r in runs
    )


def _cpu(shares: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.0%}" for k, v in shares.items())


async def main_async(args: Options) -> dict[str, Any]:
    _, source = gang_sizes()
    print(
        f"e2e bench: {args.clusters} clusters x {args.nodes} nodes x 8 GPUs; {args.jobs} jobs "
        f"burst, then {args.latency_jobs} at {args.rate:g}/s; gang sizes from {source}"
    )
    layouts = args.fleet.layouts()
    # (checkout, layout) in the order of run 1; later runs alternate it, so neither always
    # follows the other on a machine whose load drifts.
    order = [(c, f) for c in trees(REPO, args.baseline).items() for f in layouts]
    broker_cores: set[int] = set()
    if args.cpus is Placement.broker_own_core:
        broker_cores, others = split()
        pin(os.getpid(), others)  # this process and its children: nats-server, a fleet
    with burners(args.burners) as burning:
        if burning:
            print(f"  beside {len(burning)} CPU burners (pids {', '.join(map(str, burning))})")
        result = await _measure(args, order, broker_cores, layouts)
    return result | {"burners": len(burning), "burner_pids": burning}


async def _measure(
    args: Options,
    order: list[tuple[tuple[str, Path], FleetLayout]],
    broker_cores: set[int],
    layouts: list[FleetLayout],
) -> dict[str, Any]:
    every: list[dict[str, Any]] = []  # each run, in order: checkout, fleet layout, figures
    baselines: list[float] = []
    rr: list[dict[str, float]] = []
    async with EmbeddedNats() as server:
        for run in range(args.runs):
            for (label, tree), fleet in order if run % 2 == 0 else order[::-1]:
                baselines.append(await raw_nats_baseline(server.url, count=args.baseline_msgs))
                rr.append(await raw_request_latency(server.url))
                assert server.proc is not None
                one = await one_run(
                    server.url,
                    server.proc.pid,
                    args,
                    run,
                    fleet,
                    None if label == "this" else tree,
                    broker_cores,
                )
                one |= {
                    "tree": label,
                    "fleet": fleet.value,
                    "load_average_1m": round(os.getloadavg()[0], 2),
                    "raw_nats_msgs_per_s": round(baselines[-1]),
                    "raw_request_p99_ms": round(rr[-1]["p99_ms"], 3),
                }
                every.append(one)
                print(
                    f"  run {run + 1} {label}, fleet {fleet.value}: {_fmt_run(one)}; raw NATS "
                    f"{baselines[-1]:,.0f} msgs/s, request/reply p99 {rr[-1]['p99_ms']:.2f} ms; "
                    f"load average {one['load_average_1m']}"
                )
    # The headline figures are this checkout's in the first layout asked for.
    runs = [r for r in every if r["tree"] == "this" and r["fleet"] == layouts[0].value]
    other = [r for r in every if r["tree"] == "baseline" and r["fleet"] == layouts[0].value]
    rates = [r["burst"]["admissions_per_s"] for r in runs]
    p99s = [r["paced"]["p99_ms"] for r in runs]
    base = median(baselines)
    rr_p99 = median([x["p99_ms"] for x in rr])
    result: dict[str, Any] = {
        "bench": "e2e",
        "clusters": args.clusters,
        "nodes_per_cluster": args.nodes,
        "jobs": args.jobs,
        "latency_jobs": args.latency_jobs,
        "rate": args.rate,
        "runs": args.runs,
        "admissions_per_s_median": round(median(rates)),
        "admissions_per_s": [round(x) for x in rates],
        "steady_admissions_per_s_median": round(median([r["burst"]["steady_per_s"] for r in runs])),
        "latency_p50_ms_median": round(median([r["paced"]["p50_ms"] for r in runs]), 2),
        "latency_p90_ms_median": round(median([r["paced"]["p90_ms"] for r in runs]), 2),
        "latency_p99_ms_median": round(median(p99s), 2),
        "latency_max_ms_median": round(median([r["paced"]["max_ms"] for r in runs]), 2),
        "latency_p99_ms": [round(x, 2) for x in p99s],
        "broker_cpu_ms_per_job_burst_median": round(
            median([r["burst"]["broker_cpu_ms_per_job"] for r in runs]), 4
        ),
        "broker_cpu_ms_per_job_paced_median": round(
            median([r["paced"]["broker_cpu_ms_per_job"] for r in runs]), 4
        ),
        "raw_nats_msgs_per_s": round(base),
        "raw_nats_msgs_per_s_runs": [round(x) for x in baselines],
        "ratio_admissions_vs_raw_nats": round(median(rates) / base, 4),
        "raw_request_p50_ms": round(median([x["p50_ms"] for x in rr]), 3),
        "raw_request_p99_ms": round(rr_p99, 3),
        "ratio_p99_vs_raw_request_p99": round(median(p99s) / rr_p99, 1),
        "all_dispatched": all_dispatched(runs),
        "event_loop": sorted({r["broker"]["event_loop"] for r in runs}),
        "target_admissions_per_s": TARGET_RATE,
        "target_p99_ms": TARGET_P99_MS,
        "kv_puts_per_job": [r["paced"]["kv_puts_per_job"] for r in runs],
        "fleet": args.fleet.value,
        "cpus": args.cpus.value,
        "broker_wait_ms_per_job_paced_median": round(
            median([r["paced"]["wait_ms_per_job"]["broker"] for r in runs]), 4
        ),
        "by_tree_and_fleet": {
            f"{label} {fleet.value}": latency_summary(
                [r for r in every if r["tree"] == label and r["fleet"] == fleet.value]
            )
            for label in trees(REPO, args.baseline)
            for fleet in layouts
        },
        "detail": every,
    }
    if other:
        result["baseline"] = {
            "tree": str(args.baseline),
            "admissions_per_s": [round(r["burst"]["admissions_per_s"]) for r in other],
            "broker_cpu_ms_per_job_burst": [
                round(r["burst"]["broker_cpu_ms_per_job"], 4) for r in other
            ],
            "latency_p99_ms": [round(r["paced"]["p99_ms"], 2) for r in other],
            "kv_puts_per_job": [r["paced"]["kv_puts_per_job"] for r in other],
        }
    print(
        f"e2e ({args.event_loop.value}): median {result['admissions_per_s_median']:,} "
        f"admissions/s (target 2,000; raw NATS "
        f"{base:,.0f} msgs/s, ratio {result['ratio_admissions_vs_raw_nats']}); latency at "
        f"{args.rate:g}/s p99 {result['latency_p99_ms_median']} ms (target 50; raw request "
        f"p99 {rr_p99:.2f} ms)"
    )
    return result


app = program()


@app.command(help=summary(__doc__))
def bench_e2e(
    clusters: Count = 50,
    nodes: Nodes = 200,
    jobs: Annotated[int, typer.Option(min=1, help="figure A burst size")] = 20_000,
    rate: Annotated[float, typer.Option(min=0.001, help="figure B submissions/s")] = 1000.0,
    latency_jobs: Annotated[int, typer.Option(min=1, help="figure B job count")] = 10_000,
    queues: Count = 10,
    settle_s: Annotated[float, typer.Option(min=0.0)] = 3.0,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace", help="figure B: also split latency into stages from the broker's job events"
        ),
    ] = False,
    runs: Count = 3,
    seed: int = 20171009,
    baseline_msgs: Count = 200_000,
    baseline: Baseline = None,
    stalls_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="record the broker's event-loop turns longer than this (load/stallprobe.py) "
            "and its GC passes in figure B's window, and how late this process's loop runs a "
            "1 ms timer meanwhile; 0: off",
        ),
    ] = 0.0,
    fleet: Annotated[
        FleetLayout,
        typer.Option(
            help="where the 50 fake agents run: in this process, in one of their own, or both "
            "(each run measures each layout)"
        ),
    ] = FleetLayout.in_process,
    cpus: Annotated[
        Placement,
        typer.Option(
            help="shared: every process on every core; broker-own-core: the broker on the "
            "first core, nats-server, this process and a fleet process on the others"
        ),
    ] = Placement.shared,
    burners: Annotated[
        int,
        typer.Option(
            min=0,
            max=8,
            help="busy processes at the same priority beside every process of the benchmark "
            "through all its runs and baselines (load/cpus.py): a loaded node",
        ),
    ] = 0,
    event_loop: EventLoopFlag = EventLoopOpt.asyncio,
    broker_log_level: Annotated[
        BrokerLogLevel,
        typer.Option(
            help="the broker's log level: warning, as every figure before 2026-12-05 was "
            "measured, or info, a deployment's default (a line per step of each job)"
        ),
    ] = BrokerLogLevel.warning,
    json_out: JsonOut = None,
) -> None:
    options = Options(**{k: v for k, v in locals().items() if k != "json_out"})
    loop_factory(event_loop)  # uvloop asked for but not installed: say so before any run
    os.environ["MUSTER_EVENT_LOOP"] = event_loop.value  # the broker process runs on it
    with bytecode_cached(True):  # its brokers start as an installed one does
        emit_with_detail(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_e2e")
