"""Builders for the scheduling core's tests: small fleets, configs and gang requests."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, PodSetDemand, PoolKey
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import (
    BrokerConfig,
    CohortConfig,
    FlavorClass,
    FlavorQuota,
    PreemptionPolicy,
    QueueConfig,
    ResourceQuota,
    SchedulingConfig,
)
from schemas.job import CapacityPreference

GI = 2**30
NOW = 1_700_000_000.0
# The node labels of a four-level topology, widest first, as a topology-aware flavor lists them.
LEVELS = (
    "topology.kubernetes.io/zone",
    "cloud.google.com/gce-topology-block",
    "example.com/rack",
    "kubernetes.io/hostname",
)


def flavor(
    name: str, capacity: str = "on-demand", gpu_type: str = "a100", price: float = 3.0
) -> FlavorInfo:
    return FlavorInfo(name, capacity, gpu_type, price)


def nodes(
    prefix: str, flavor_name: str, count: int, gpu: int = 8, cpu: int = 96_000, mem: int = 1024 * GI
) -> list[NodeInfo]:
    return [
        NodeInfo(name=f"{prefix}-{i}", flavor=flavor_name, gpu=gpu, cpu_milli=cpu, memory=mem)
        for i in range(count)
    ]


def one_cluster(pools: Iterable[tuple[FlavorInfo, int]], **scheduling: object) -> Scheduler:
    """A scheduler whose cluster "c" holds `count` 8-GPU nodes of each flavor (named after it)."""
    s = Scheduler(config(**scheduling))
    flavors = [f for f, _ in pools]
    s.apply_snapshot("c", flavors, [n for f, k in pools for n in nodes(f.name, f.name, k)], NOW)
    return s


def config(
    queues: Iterable[QueueConfig] | None = None,
    classes: Iterable[FlavorClass] = (),
    cohorts: Iterable[CohortConfig] = (),
    **scheduling: object,
) -> BrokerConfig:
    return BrokerConfig(
        queues=list(queues) if queues is not None else [QueueConfig(name="default")],
        flavors=list(classes),
        cohorts=list(cohorts),
        # Victims may be as young as the test likes unless it sets a minimum runtime.
        scheduling=SchedulingConfig(**{"preemption_min_runtime_s": 0.0, **scheduling}),
    )


def queue(
    name: str,
    cohort: str | None = None,
    quotas: dict[str, dict[str, tuple[int, int | None, int | None]]] | None = None,
    strategy: str = "BestEffortFIFO",
    weight: float = 1.0,
    within: str = "LowerPriority",
    reclaim: str = "Any",
    reclaimable: bool = True,
) -> QueueConfig:
    """quotas: class -> resource -> (nominal, borrowing_limit, lending_limit)."""
    fq = None
    if quotas is not None:
        fq = [
            FlavorQuota(
                flavor=cls,
                resources={
                    res: ResourceQuota(nominal=n, borrowing_limit=b, lending_limit=lend)
                    for res, (n, b, lend) in per.items()
                },
            )
            for cls, per in quotas.items()
        ]
    return QueueConfig(
        name=name,
        cohort=cohort,
        quotas=fq,
        strategy=strategy,
        weight=weight,
        preemption=PreemptionPolicy(within_queue=within, reclaim_within_cohort=reclaim),
        reclaimable=reclaimable,
    )


_ORDER = [0]


def gang(
    job_id: str,
    *sets: tuple[int, int],
    queue: str = "default",
    priority: int = 0,
    attempt: int = 1,
    cpu: int = 1000,
    mem: int = GI,
    capacity: CapacityPreference = "any",
    gpu_types: Iterable[str] = (),
    avoid: Iterable[PoolKey] = (),
    spot_exhausted: bool = False,
    checkpoint_interval_s: float | None = None,
    order: int | None = None,
) -> GangRequest:
    """A gang of podsets given as (replicas, gpus per replica)."""
    if order is None:
        _ORDER[0] += 1
        order = _ORDER[0]
    podsets = tuple(
        PodSetDemand(podset=f"p{i}", replicas=r, gpu=g, cpu_milli=cpu, memory=mem)
        for i, (r, g) in enumerate(sets)
    )
    return GangRequest(
        job_id=job_id,
        attempt=attempt,
        queue=queue,
        priority=priority,
        order=order,
        podsets=podsets,
        gpu_types=frozenset(gpu_types),
        capacity=capacity,
        avoid_pools=frozenset(avoid),
        spot_exhausted=spot_exhausted,
        checkpoint_interval_s=checkpoint_interval_s,
    )


def used_per_node(s: Scheduler) -> dict[tuple[str, str], tuple[int, int, int]]:
    """Recompute every node's Muster usage from the admitted placements (independent check)."""
    out: dict[tuple[str, str], tuple[int, int, int]] = {}
    for a in s.allocations().values():
        for name, vec in a.per_node.items():
            g, c, m = out.get((a.cluster, name), (0, 0, 0))
            out[(a.cluster, name)] = (g + vec[0], c + vec[1], m + vec[2])
    return out


def codes(reasons: object) -> list[str]:
    assert isinstance(reasons, tuple), reasons
    return [r.code for r in reasons]


def quota_broken(s: Scheduler) -> list[str]:
    bad = []
    for q in s.queue_states().values():
        if q.limits is None:
            continue
        for cls, used in q.usage.items():
            lims = q.limits.get(cls)
            for r in range(3):
                lim = lims[r] if lims is not None else None
                if used[r] and lims is None:
                    bad.append(f"{q.name} uses unlisted class {cls}")
                if lim is None or lim.borrowing is None:
                    continue
                if used[r] > lim.nominal + lim.borrowing:
                    bad.append(f"{q.name} {cls}[{r}] {used[r]} over nominal + borrowing")
    for co in s.cohort_states().values():
        for cls, used in co.borrowed.items():
            for r in range(3):
                # The root has only its subtree's quota; an inner cohort may borrow from its
                # parent up to its own borrowing limit (none here: unbounded).
                lim = co.own(cls, r)
                cap = co.lendable[cls][r] if co.parent is None else None
                if co.parent is not None and lim is not None and lim.borrowing is not None:
                    cap = co.lendable[cls][r] + lim.borrowing
                if cap is not None and used[r] > cap:
                    bad.append(f"cohort {co.name} {cls}[{r}] uses {used[r]} of {cap}")
    return bad


def random_fleet_and_rounds(
    draw: st.DrawFn, s: Scheduler, n_queues: int
) -> list[list[GangRequest]]:
    """One or two clusters of 1-3 od nodes of 4 or 8 GPUs, and 2-14 small gangs over the
    queues q0..q<n_queues-1> arriving in up to four rounds (for the reclaim properties)."""
    for c in range(draw(st.integers(1, 2))):
        s.apply_snapshot(
            f"c{c}",
            [flavor("od")],
            nodes(f"c{c}n", "od", draw(st.integers(1, 3)), gpu=draw(st.sampled_from([4, 8]))),
            NOW,
        )
    count = draw(st.integers(2, 14))
    jobs = [
        gang(
            f"j{i}",
            (draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))),
            queue=f"q{draw(st.integers(0, n_queues - 1))}",
            priority=draw(st.sampled_from([0, 0, 5])),
            order=i + 1,
        )
        for i in range(count)
    ]
    arrival = draw(st.permutations(jobs))
    cuts = sorted(draw(st.lists(st.integers(1, count), max_size=3)))
    rounds = [arrival[a:b] for a, b in zip([0, *cuts], [*cuts, count], strict=True)]
    return [r for r in rounds if r]


def tflavor(name: str = "od", price: float = 3.0) -> FlavorInfo:
    """An on-demand a100 flavor whose nodes carry the four `LEVELS` of topology labels."""
    return FlavorInfo(name, "on-demand", "a100", price, topology_levels=LEVELS)
