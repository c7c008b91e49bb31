"""Runs and what is read from them: one run's summary with its hindsight bound
(load/oracle.py) and the series the plots need, small enough to cross a process boundary."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from load.sim.jobs import SimJob, job_spec
from load.sim.loop import (
    Sim,
)
from load.sim.policies import Policy
from load.sim.world import (
    SimResult,
)
from load.simconfig import (
    SimConfig,
)

if TYPE_CHECKING:
    from load.oracle import Bound


def run(cfg: SimConfig, policy: str) -> SimResult:
    return Sim(cfg, policy).run()


def bound_for(sim: Sim, result: SimResult, *, timed: bool = False) -> Bound:
    """The bound for the jobs a finished run completed, on the capacity that run had; `timed`:
    each job also done no later than the run finished it (the cheapest way to match the
    run's completion times, a tighter bound for that run)."""
    from load import oracle  # SciPy: only when a bound is asked for

    mapped = dict(sim.policy.capacity_map)
    pools = [
        oracle.BoundPool(
            (p.cluster, p.flavor), p.capacity_type, p.price, sim.speed.get(p.gpu_type, 1.0)
        )
        for p in sim.pools
    ]
    jobs = [
        oracle.BoundJob(
            j.arrival,
            j.gpus,
            float(j.gpus * j.duration),
            mapped.get(j.capacity, j.capacity),
            r.finished_at - result.base if timed and r.finished_at is not None else None,
            whole_gpus(j, sim.policy),
        )
        for j in result.jobs
        if (r := result.records.get(j.job_id)) is not None and r.state == "succeeded"
    ]
    spans = sim.capacity_spans()
    capacity = oracle.slot_capacity(spans, result.end)
    return oracle.hindsight_bound(jobs, pools, capacity, result.end, present=oracle.presence(spans))


def whole_gpus(job: SimJob, policy: Policy) -> int:
    """The fewest GPUs the job's gang runs on at once, from the spec the broker was given (an
    elastic podset's minimum)."""
    return sum((p.min_replicas or p.replicas) * p.gpu for p in job_spec(job, policy).gang)


def _run_summary(args: tuple[SimConfig, str]) -> dict[str, Any]:
    """One run's summary row, with the hindsight bound for the jobs it completed."""
    from load.oracle import bound_summary
    from load.report import summarize
    from load.sim.breakdown import breakdown

    sim = Sim(*args)
    result = sim.run()
    summary = summarize(result)
    bound, timed = bound_for(sim, result), bound_for(sim, result, timed=True)
    summary.update(bound_summary(bound, summary, timed))
    work = sum(bound.work_by_pool.values())
    share = {k[1]: float(v) / work for k, v in bound.work_by_pool.items() if v > 0} if work else {}
    parts = breakdown(result, sim.jobs_by_id)
    return {
        "summary": summary,
        "series": _series(result),
        "breakdown": (parts, share),
        "reasons": dict(sim.reasons),
    }


def _series(result: SimResult) -> dict[str, Any]:
    """What the plots need, small enough to send back from a worker process."""
    from load.report import jct_hours, lost_by_job, queue_delays_s

    return {
        "jct_h": jct_hours(result),
        "queue_s": queue_delays_s(result),
        "lost_gpu_h": lost_by_job(result),
        "finish_h": sorted(
            (r.finished_at - result.base) / 3600.0
            for r in result.records.values()
            if r.finished_at is not None
        ),
        "samples": [
            [s.t, s.capacity, s.allocated, s.running, s.spot_capacity, s.pending]
            for s in result.samples
        ],
    }


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
