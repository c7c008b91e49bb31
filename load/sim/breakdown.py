"""Where one run's cost and time went (`python -m load.sim --breakdown`): what each pool was
paid for the completed jobs, by capacity preference; what their paid GPU-time did; whose work
was lost; how long each preference waited for its first dispatch; the job with the most
attempts. Read from the simulated clusters' attempt logs, like the report, so the goals'
misses can be traced to jobs and pools (docs/simulation.md "Where the cost and time go")."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import inf

from load.report import percentile
from load.sim.jobs import SimJob
from load.sim.world import AttemptLog, SimResult


@dataclass(slots=True)
class Breakdown:
    """One run's breakdown, over the jobs it completed unless a field says otherwise."""

    policy: str
    # (pool flavor, capacity preference) -> dollars paid, and V100-GPU-hours the time could do
    paid_usd: dict[tuple[str, str], float] = field(default_factory=dict)
    paid_work_h: dict[tuple[str, str], float] = field(default_factory=dict)
    # What the paid GPU-time did, in V100-GPU-hours: useful, first start-up, start-up and
    # restore of later attempts, checkpoint stalls, work done again after a loss, and the
    # rest ("other": negative where a notice checkpoint's write overlapped work done again).
    time_h: dict[str, float] = field(default_factory=dict)
    # ("checkpoints" | "no checkpoints", preference) -> V100-GPU-hours of work lost
    lost_h: dict[tuple[str, str], float] = field(default_factory=dict)
    # preference -> submit-to-first-dispatch waits (s), every job that started
    waits_s: dict[str, list[float]] = field(default_factory=dict)
    # the job with the most attempts: id, GPUs, preference, attempts per flavor, and how
    # many of its ended attempts the next one resumed from no later step
    worst: tuple[str, int, str, dict[str, int], int] | None = None
    # every job: (preference, JCT in h (inf: unfinished), first-dispatch wait in s (inf: never
    # started), GPU type of its first attempt); paired with another policy's run by `jct_gap`
    jobs: dict[str, tuple[str, float, float, str]] = field(default_factory=dict)


TIME_PARTS = ("useful", "first start-up", "later start-up + restore", "checkpoint stalls")


def breakdown(result: SimResult, jobs: Mapping[str, SimJob]) -> Breakdown:
    out = Breakdown(result.policy)
    end = result.base + result.end
    time_h: defaultdict[str, float] = defaultdict(float)
    lost: defaultdict[tuple[str, str], float] = defaultdict(float)
    paid: defaultdict[tuple[str, str], float] = defaultdict(float)
    work: defaultdict[tuple[str, str], float] = defaultdict(float)
    waits: defaultdict[str, list[float]] = defaultdict(list)
    most = 0
    for job_id, job in jobs.items():
        rec = result.records.get(job_id)
        jct = wait = inf
        if rec is not None and rec.attempts:
            wait = rec.attempts[0].dispatched_at - rec.submitted_at
        if rec is not None and rec.state == "succeeded" and rec.finished_at is not None:
            jct = (rec.finished_at - rec.submitted_at) / 3600.0
        first = result.logs.get(job_id)
        out.jobs[job_id] = (job.capacity, jct, wait, first[0].gpu_type.upper() if first else "")
    for job_id, logs in result.logs.items():
        job, rec = jobs[job_id], result.records.get(job_id)
        if rec is not None and rec.attempts:
            waits[job.capacity].append(rec.attempts[0].dispatched_at - rec.submitted_at)
        if rec is not None and len(logs) > most:
            most = len(logs)
            per_flavor = dict(Counter(x.flavor for x in logs))
            out.worst = (job_id, job.gpus, job.capacity, per_flavor, _no_progress(logs))
        if rec is None or rec.state != "succeeded":
            continue
        time_h["useful"] += job.gpus * job.duration / 3600.0
        for i, log in enumerate(logs):
            held = log.held_s(end)
            gpus = log.gpu_s(end) / held if held > 0 else 0.0
            key = (log.flavor, job.capacity)
            paid[key] += log.gpu_s(end) / 3600.0 * log.price
            work[key] += log.gpu_s(end) / 3600.0 * log.speed
            time_h["paid"] += log.gpu_s(end) / 3600.0 * log.speed
            ran = log.running_at if log.running_at is not None else log.ended_at or end
            part = "first start-up" if i == 0 else "later start-up + restore"
            time_h[part] += (ran - log.dispatched_at) * gpus * log.speed / 3600.0
            stalls = len(log.ckpt_steps) * job.ckpt_cost
            time_h["checkpoint stalls"] += stalls * gpus * log.speed / 3600.0
            if not log.succeeded and i + 1 < len(logs):
                redone = max(0, log.end_step - logs[i + 1].start_step) * job.gpus / 3600.0
                lost[("checkpoints" if job.ckpt_every else "no checkpoints", job.capacity)] += (
                    redone
                )
    time_h["work done again"] = sum(lost.values())
    time_h["other"] = time_h["paid"] - sum(time_h[k] for k in (*TIME_PARTS, "work done again"))
    out.paid_usd, out.paid_work_h, out.lost_h = dict(paid), dict(work), dict(lost)
    out.time_h, out.waits_s = dict(time_h), dict(waits)
    return out


def _no_progress(logs: Sequence[AttemptLog]) -> int:
    """Ended attempts the next one resumed from no later step than they started at."""
    return sum(1 for a, b in itertools.pairwise(logs) if b.start_step <= a.start_step)


def format_breakdown(b: Breakdown, head: str, bound_share: Mapping[str, float]) -> str:
    """The breakdown as text; `bound_share`: the hindsight bound's share of work per flavor."""
    total = sum(b.paid_usd.values())
    paid_h = b.time_h.get("paid", 0.0)
    lines = [f"{head}: ${total:,.0f} paid for the completed jobs"]
    for key, usd in sorted(b.paid_usd.items(), key=lambda kv: -kv[1]):
        h = b.paid_work_h[key]
        lines.append(
            f"  {key[0]:<16} {key[1]:<20} ${usd:>8,.0f} {usd / total:>6.1%}  "
            f"{h:>7,.0f} V100-h  ${usd / h if h else 0.0:.2f}/V100-h"
        )
    shares = ", ".join(
        f"{k} {v:.1%}" for k, v in sorted(bound_share.items(), key=lambda kv: -kv[1])
    )
    lines.append(f"  hindsight bound, work by pool: {shares or '-'}")
    parts = [*TIME_PARTS, "work done again", "other"]
    lines.append(
        "  paid GPU-time: "
        + ", ".join(f"{k} {b.time_h.get(k, 0.0) / paid_h:.1%}" for k in parts if paid_h)
    )
    lost = sorted(b.lost_h.items(), key=lambda kv: -kv[1])[:4]
    lines.append(
        "  work done again, by class: "
        + (", ".join(f"{c}/{p} {h / paid_h:.2%}" for (c, p), h in lost if paid_h) or "-")
    )
    for pref, waits in sorted(b.waits_s.items()):
        lines.append(
            f"  first dispatch, {pref}: wait p50 {percentile(waits, 50):.0f} s, "
            f"p90 {percentile(waits, 90):.0f} s ({len(waits)} jobs)"
        )
    if b.worst is not None:
        job_id, gpus, pref, per_flavor, stuck = b.worst
        pools = ", ".join(f"{f} {n}" for f, n in sorted(per_flavor.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"  most attempts: {job_id} ({gpus} GPUs, {pref}) {sum(per_flavor.values())} "
            f"attempts: {pools}; {stuck} resumed no further than they started"
        )
    return "\n".join(lines)


def jct_gap(run: Breakdown, base: Breakdown) -> str:
    """Where a run's JCT p50 above `base`'s (on-demand-only's, same jobs) comes from: the
    ratio if one preference's jobs had their JCT in `base`, and, among the jobs whose JCT in
    `base` is within 3x of its median, how many took over 1.2x as long after a first wait
    under 60 s (a slower run: another GPU type, restarts) or of 60 s or more (a wait)."""
    p50 = percentile([j[1] for j in base.jobs.values()], 50)
    mine = percentile([j[1] for j in run.jobs.values()], 50)
    lines = [f"  JCT p50 {mine:.3f} h against {base.policy}'s {p50:.3f} h: {mine / p50:.2f}x"]
    swaps = []
    for pref in sorted({j[0] for j in run.jobs.values()}):
        swapped = [
            base.jobs[k][1] if j[0] == pref else j[1] for k, j in run.jobs.items() if k in base.jobs
        ]
        swaps.append(f"{pref} {percentile(swapped, 50) / p50:.2f}x")
    lines.append("  ... with one preference's JCT as there: " + ", ".join(swaps))
    near = [k for k, j in base.jobs.items() if p50 / 3 < j[1] < 3 * p50 and k in run.jobs]
    slow = [k for k in near if run.jobs[k][1] > 1.2 * base.jobs[k][1]]
    by_run = sum(1 for k in slow if run.jobs[k][2] < 60.0)
    types = Counter(run.jobs[k][3] for k in near)
    there = Counter(base.jobs[k][3] for k in near)
    lines.append(
        f"  jobs near the median: {len(near)}; over 1.2x as long by a slower run {by_run}, "
        f"by a wait {len(slow) - by_run}; first GPU type {dict(sorted(types.items()))} "
        f"({base.policy}: {dict(sorted(there.items()))})"
    )
    return "\n".join(lines)
