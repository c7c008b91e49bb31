"""The simulated jobs: Philly rows made into `SimJob`s (seeded, the same under every policy) and
the `JobSpec` and broker settings a policy gives them; the trace loaders, cached per process."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agents.fake.trace import SpotTrace, load_trace
from load import skypilot, traces
from load.sim.policies import (
    Policy,
)
from load.simconfig import (
    SimConfig,
)
from schemas.config import (
    DEFAULT_GPU_SPEEDS,
    BrokerConfig,
    QueueConfig,
    SchedulingConfig,
    Timeouts,
)
from schemas.job import (
    CapacityPreference,
    CheckpointSpec,
    JobSpec,
    PodSet,
    Simulation,
    SpotPolicy,
    Workload,
)


# ------------------------------------------------------------------------------ traces
# Loaders belong to load/traces.py (shared with the core benchmarks); cached here because
# every run of a multi-policy comparison reads the same files.
@lru_cache(maxsize=2)
def load_philly(path: Path) -> tuple[traces.PhillyJob, ...]:
    """All Philly rows sorted by submit time (the file is not sorted)."""
    return tuple(traces.load_philly(traces.require_trace(path.name, path.parent)))


@lru_cache(maxsize=16)
def cached_trace(path: Path) -> SpotTrace:
    """The spot trace at `path` (Bamboo CSV or SkyPilot JSON), parsed once per process
    (agents/fake/trace.py)."""
    return load_trace(path)


# ------------------------------------------------------------------------------ jobs
@dataclass(slots=True)
class SimJob:
    index: int
    job_id: str
    arrival: float  # virtual seconds since the run's start
    duration: int  # seconds of work = steps (1 step per second)
    replicas: int
    gpu_per_replica: int
    queue: str
    capacity: CapacityPreference
    ckpt_every: float | None  # None: the job never checkpoints
    vc: str
    ckpt_cost: float = 0.0  # seconds to write one checkpoint (restore: x restore_factor)
    # Declared relative speeds per GPU type (JobSpec.gpu_speeds); () = learned from its steps.
    gpu_speeds: tuple[tuple[str, float], ...] = ()

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpu_per_replica


def make_jobs(cfg: SimConfig) -> list[SimJob]:
    """The job window; the same seed gives the same jobs under every policy."""
    rows = load_philly(cfg.philly)
    # A window longer than what follows the offset starts earlier: `--jobs 82247` is the
    # whole trace whatever the offset.
    offset = min(cfg.offset, max(0, len(rows) - cfg.jobs))
    window = rows[offset : offset + cfg.jobs]
    if not window:
        return []
    rng = random.Random(f"jobs-{cfg.seed}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.cluster] = counts.get(r.cluster, 0) + 1
    ranked = sorted(counts, key=lambda v: (-counts[v], v))
    queue_of = {vc: cfg.queues[i % len(cfg.queues)] for i, vc in enumerate(ranked)}
    prefs = [p for p, _ in cfg.mix]
    weights = [w for _, w in cfg.mix]
    t0 = window[0].arrival
    cost_rng = random.Random(f"ckpt-cost-{cfg.seed}")  # its own stream: the mix stays put
    lo, hi = cfg.ckpt_cost_s
    declared = () if cfg.learn_speeds else tuple(broker_speeds(cfg).items())
    jobs: list[SimJob] = []
    for i, r in enumerate(window):
        replicas, per = traces.gang_shape(max(1, r.num_gpus))
        ckpt = cfg.checkpoint_every_s if rng.random() < cfg.checkpoint_fraction else None
        jobs.append(
            SimJob(
                index=i,
                job_id=f"p{offset + i:05d}",
                arrival=(r.arrival - t0) / cfg.compress,
                duration=max(1, int(min(r.duration, cfg.max_duration_s))),
                replicas=replicas,
                gpu_per_replica=per,
                queue=queue_of[r.cluster],
                capacity=rng.choices(prefs, weights)[0],
                ckpt_every=ckpt,
                vc=r.cluster,
                ckpt_cost=lo + (hi - lo) * cost_rng.random(),
                gpu_speeds=declared,
            )
        )
    return jobs


def job_spec(job: SimJob, policy: Policy) -> JobSpec:
    capacity = dict(policy.capacity_map).get(job.capacity, job.capacity)
    # With hindsight every job can write the one checkpoint it needs, just before a reclaim.
    ckpt = (job.ckpt_every is not None or policy.foresight) and policy.checkpoints
    per = job.gpu_per_replica
    elastic = policy.elastic and job.replicas > 1
    return JobSpec(
        name=f"philly-{job.index}",
        job_id=job.job_id,
        queue=job.queue,
        gang=[
            PodSet(
                name="worker",
                replicas=job.replicas,
                min_replicas=max(1, job.replicas // 2) if elastic else None,
                max_replicas=job.replicas if elastic else None,
                gpu=per,
                cpu=str(max(1, 4 * per)),
                memory=f"{max(1, 16 * per)}Gi",
            )
        ],
        capacity=capacity,
        gpu_speeds=dict(job.gpu_speeds),
        spot=skypilot.SPOT_POLICY if policy.skypilot else SpotPolicy(),
        checkpoint=CheckpointSpec(
            uri=f"s3://sim-ckpt/{job.job_id}",
            interval_s=job.ckpt_every,
            cost_s=round(job.ckpt_cost, 1),
        )
        if ckpt
        else None,
        workload=Workload(
            kind="pytorchjob" if job.replicas > 1 else "indexed-job",
            simulate=Simulation(
                total_steps=job.duration,
                steps_per_second=1.0,
                checkpoint_every=max(1, int(job.ckpt_every or job.duration)),
            ),
        ),
        labels={"philly-vc": job.vc},
    )


def broker_config(cfg: SimConfig, policy: Policy | None = None) -> BrokerConfig:
    """The broker's settings for a run; a SkyPilot baseline gets SkyPilot's (load/skypilot.py)."""
    config = _broker_config(cfg)
    if policy is not None and policy.skypilot:
        return skypilot.broker_config(config, policy.skypilot)
    return config


def broker_speeds(cfg: SimConfig) -> dict[str, float]:
    """The broker's prior speed per GPU type: the run's `prior_speed`, else the defaults."""
    return {t.lower(): v for t, v in cfg.prior_speed} or dict(DEFAULT_GPU_SPEEDS)


def _broker_config(cfg: SimConfig) -> BrokerConfig:
    return BrokerConfig(
        queues=[QueueConfig(name=q) for q in cfg.queues],
        scheduling=SchedulingConfig(gpu_speeds=broker_speeds(cfg)),
        timeouts=Timeouts(
            heartbeat_s=cfg.heartbeat_s,
            unreachable_after_s=3 * cfg.heartbeat_s,
            lost_after_s=6 * cfg.heartbeat_s,
            start_s=300.0,
            checkpoint_grace_s=30.0,
        ),
    )
