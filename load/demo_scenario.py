"""What `make demo` runs: three fake clusters, a broker config, the jobs and the trouble.

Kept apart from the orchestration (demo.py) so a newcomer can read the whole scenario on one
screen, and so the test can reason about it (which job gets the spot notice, and so on).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from agents.config import AgentConfig, FakeClusterConfig, FakeFlavor
from schemas.config import BrokerConfig, QueueConfig, SchedulingConfig, Timeouts

PREFIX = "muster"
TIME_SCALE = 10.0  # simulated seconds per real second: a 5-minute run takes 30 s
START_DELAY_S = 8.0  # simulated: pods pull images and start in 0.8 s of real time
CHECKPOINT_WRITE_S = 15.0  # simulated: an on-demand checkpoint takes 1.5 s of real time
SPOT_LEAD_S = 60.0  # simulated: the notice comes 6 s of real time before the reclaim


@dataclass(frozen=True)
class ClusterPlan:
    name: str
    blurb: str  # what kind of cluster, for the demo's opening lines
    flavors: tuple[FakeFlavor, ...]


CLUSTERS: tuple[ClusterPlan, ...] = (
    ClusterPlan(
        "spot-east",
        "spot-heavy",
        (
            FakeFlavor(
                name="a100-spot",
                capacity_type="spot",
                gpu_type="A100",
                price_per_gpu_hour=1.10,
                nodes=6,
            ),
            FakeFlavor(
                name="a100-od",
                capacity_type="on-demand",
                gpu_type="A100",
                price_per_gpu_hour=3.00,
                nodes=2,
            ),
        ),
    ),
    ClusterPlan(
        "ondemand-west",
        "on-demand",
        (
            FakeFlavor(
                name="h100-od",
                capacity_type="on-demand",
                gpu_type="H100",
                price_per_gpu_hour=6.50,
                nodes=4,
            ),
        ),
    ),
    ClusterPlan(
        "mixed-central",
        "mixed",
        (
            FakeFlavor(
                name="t4-spot",
                capacity_type="spot",
                gpu_type="T4",
                price_per_gpu_hour=0.25,
                nodes=6,
                gpu_per_node=4,
                cpu="48",
                memory="192Gi",
            ),
            FakeFlavor(
                name="a100-od",
                capacity_type="on-demand",
                gpu_type="A100",
                price_per_gpu_hour=3.20,
                nodes=4,
            ),
        ),
    ),
)


def flavor_table() -> dict[tuple[str, str], FakeFlavor]:
    """(cluster, flavor) -> the flavor, for labels such as 'spot A100 $1.10'."""
    return {(c.name, f.name): f for c in CLUSTERS for f in c.flavors}


def agent_configs(seed: int) -> list[AgentConfig]:
    """No random spot arrivals: the demo injects its trouble on purpose, at chosen moments."""
    return [
        AgentConfig(
            cluster=c.name,
            backend="fake",
            heartbeat_s=0.5,
            subject_prefix=PREFIX,
            fake=FakeClusterConfig(
                flavors=list(c.flavors),
                time_scale=TIME_SCALE,
                spot_notice_s=SPOT_LEAD_S,
                start_delay_s=START_DELAY_S,
                checkpoint_write_s=CHECKPOINT_WRITE_S,
                seed=seed + i,
            ),
        )
        for i, c in enumerate(CLUSTERS)
    ]


def broker_config() -> BrokerConfig:
    """Two queues in one cohort, no quotas, and timeouts short enough to watch."""
    return BrokerConfig(
        subject_prefix=PREFIX,
        queues=[
            QueueConfig(name="research", cohort="ml", weight=1.0),
            QueueConfig(name="prod", cohort="ml", weight=2.0),
        ],
        timeouts=Timeouts(
            heartbeat_s=0.5,
            unreachable_after_s=1.5,
            lost_after_s=4.0,
            dispatch_ack_s=1.0,
            dispatch_retries=2,
            start_s=15.0,
            checkpoint_grace_s=8.0,
            lease_ttl_s=10.0,  # one broker, no failover shown: a busy machine must not flap it
        ),
        scheduling=SchedulingConfig(avoid_lost_pool_s=120.0),
    )


# -- jobs ------------------------------------------------------------------------------------


def _job(
    name: str,
    queue: str,
    gang: list[dict[str, Any]],
    *,
    gpu_types: list[str],
    capacity: str,
    steps: int,
    rate: float,
    every: int,
    priority: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A plain-JSON JobSpec, exactly what any NATS client would publish."""
    job: dict[str, Any] = {
        "name": name,
        "queue": queue,
        "priority": priority,
        "gang": gang,
        "gpu_types": gpu_types,
        "capacity": capacity,
        "checkpoint": {"uri": f"s3://ckpt/{name}"},
        "restart": {"backoff_s": 1.0},
        "workload": {
            "kind": "pytorchjob",
            "image": f"ghcr.io/example/{name}:latest",
            "simulate": {"total_steps": steps, "steps_per_second": rate, "checkpoint_every": every},
        },
    }
    job.update(extra or {})
    return job


def _workers(replicas: int, gpu: int, cpu: str = "16", memory: str = "128Gi") -> dict[str, Any]:
    return {"name": "worker", "replicas": replicas, "gpu": gpu, "cpu": cpu, "memory": memory}


MASTER = {"name": "master", "replicas": 1, "gpu": 0, "cpu": "4", "memory": "16Gi"}
LAUNCHER = {"name": "launcher", "replicas": 1, "gpu": 0, "cpu": "2", "memory": "4Gi"}


def jobs(fast: bool, seed: int) -> list[dict[str, Any]]:
    """The jobs to submit. Steps are simulated; at TIME_SCALE 10, `rate` 10 steps/s is 100
    steps per real second. `--seed` jitters each job's length by up to +-8%."""
    rng = random.Random(seed)
    k = 0.4 if fast else 1.0

    def n(steps: int) -> int:
        return max(100, int(steps * k * rng.uniform(0.92, 1.08)))

    spot_fallback = {"spot": {"fallback_after_preemptions": 1}}
    out = [
        _job(
            "llama-finetune",
            "research",
            [MASTER, _workers(3, 8)],
            gpu_types=["A100"],
            capacity="spot-then-on-demand",
            steps=n(3000),
            rate=10,
            every=400,
            priority=10,
            extra=spot_fallback,
        ),
        _job(
            "prod-ranker",
            "prod",
            [_workers(2, 8)],
            gpu_types=["H100"],
            capacity="on-demand",
            steps=n(2400),
            rate=10,
            every=300,
            priority=100,
        ),
        _job(
            "prod-embed",
            "prod",
            [_workers(1, 8)],
            gpu_types=["A100"],
            capacity="on-demand",
            steps=n(2800),
            rate=10,
            every=350,
            priority=50,
        ),
        _job(
            "bert-sweep",
            "research",
            [_workers(1, 4, cpu="8", memory="32Gi")],
            gpu_types=["T4"],
            capacity="spot",
            steps=n(1500),
            rate=6,
            every=300,
        ),
    ]
    if not fast:
        out += [
            _job(
                "resnet-ablation",
                "research",
                [_workers(2, 8)],
                gpu_types=["A100", "H100"],
                capacity="spot",
                steps=n(2000),
                rate=8,
                every=400,
            ),
            _job(
                "vit-pretrain",
                "research",
                [LAUNCHER, _workers(2, 4, cpu="8", memory="32Gi")],
                gpu_types=["T4"],
                capacity="spot-then-on-demand",
                steps=n(2000),
                rate=8,
                every=400,
            ),
            _job(
                "diffusion-eval",
                "research",
                [_workers(1, 8)],
                gpu_types=["A100", "H100"],
                capacity="any",
                steps=n(1800),
                rate=8,
                every=300,
            ),
        ]
    return out


# -- trouble ---------------------------------------------------------------------------------

TroubleKind = Literal["spot-notice", "gpu-failure", "outage"]


@dataclass(frozen=True)
class Trouble:
    """Inject `kind` under job `job` once it runs with at least `fraction` of its steps done
    and `not_before` real seconds have passed since the jobs were submitted."""

    kind: TroubleKind
    job: str
    fraction: float
    not_before: float
    heal_after: float = 0.0  # outage only: real seconds until the cluster comes back


def troubles(fast: bool) -> list[Trouble]:
    if fast:
        return [
            Trouble("spot-notice", "llama-finetune", 0.2, 2.0),
            Trouble("gpu-failure", "prod-embed", 0.35, 4.0),
        ]
    return [
        Trouble("spot-notice", "llama-finetune", 0.15, 5.0),
        Trouble("gpu-failure", "prod-embed", 0.3, 11.0),
        Trouble("outage", "prod-ranker", 0.35, 16.0, heal_after=7.0),
    ]
