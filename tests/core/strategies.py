"""Random fleets, queue sets, gang requests and scheduler operations for the scheduling core's
property tests, with the flavor classes they are drawn against."""

from __future__ import annotations

from hypothesis import strategies as st

from broker.core.types import GangRequest, PodSetDemand
from schemas.agent import FlavorInfo, NodeInfo
from schemas.config import FlavorClass

from .helpers import GI, queue

GPU_TYPES = ("a", "b")
CLASSES = [
    FlavorClass(name="spot-a", capacity_type="spot", gpu_type="a"),
    FlavorClass(name="od", capacity_type="on-demand"),
]


def class_of(f: FlavorInfo) -> str:
    for fc in CLASSES:
        if fc.capacity_type not in (None, f.capacity_type):
            continue
        if fc.gpu_type not in (None, f.gpu_type):
            continue
        return fc.name
    return f.name


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, tuple[list[FlavorInfo], list[NodeInfo]]]:
    out = {}
    for c in range(draw(st.integers(1, 3))):
        flavors = []
        ns = []
        for f in range(draw(st.integers(1, 3))):
            cap = draw(st.sampled_from(["spot", "on-demand"]))
            fi = FlavorInfo(
                name=f"f{f}",
                capacity_type=cap,
                gpu_type=draw(st.sampled_from(GPU_TYPES)),
                price_per_gpu_hour=draw(st.sampled_from([0.5, 1.0, 3.0])),
            )
            flavors.append(fi)
            for n in range(draw(st.integers(1, 4))):
                gpu = draw(st.sampled_from([0, 1, 2, 4, 8, 8]))
                ns.append(
                    NodeInfo(
                        name=f"c{c}-f{f}-n{n}",
                        flavor=fi.name,
                        gpu=gpu,
                        cpu_milli=draw(st.sampled_from([2000, 8000, 16000])),
                        memory=draw(st.sampled_from([4, 16, 64])) * GI,
                        other_gpu=draw(st.sampled_from([0, 0, 0, 1])) if gpu else 0,
                        other_cpu_milli=draw(st.sampled_from([0, 0, 500])),
                        ready=draw(st.sampled_from([True, True, True, False])),
                    )
                )
        out[f"c{c}"] = (flavors, ns)
    return out


limits = st.tuples(st.integers(0, 12), st.none() | st.integers(0, 6), st.none() | st.integers(0, 6))


@st.composite
def queue_sets(draw: st.DrawFn) -> list:  # type: ignore[type-arg]
    qs = []
    for i in range(draw(st.integers(1, 3))):
        quotas = None
        if draw(st.booleans()):
            quotas = {}
            for cls in ("spot-a", "od", "f0", "f1", "f2"):
                if draw(st.booleans()):
                    per = {"gpu": draw(limits)}
                    if draw(st.booleans()):
                        n, b, lend = draw(limits)
                        per["cpu"] = (n * 1000, None if b is None else b * 1000, lend)
                    quotas[cls] = per
        qs.append(
            queue(
                f"q{i}",
                cohort=draw(st.sampled_from([None, "team"])),
                quotas=quotas,
                strategy=draw(st.sampled_from(["StrictFIFO", "BestEffortFIFO"])),
                weight=draw(st.sampled_from([1.0, 2.0])),
                reclaimable=draw(st.booleans()),
            )
        )
    return qs


@st.composite
def requests(draw: st.DrawFn, job_id: str, queues: list[str]) -> GangRequest:
    podsets = tuple(
        PodSetDemand(
            podset=f"p{i}",
            replicas=draw(st.integers(1, 3)),
            gpu=draw(st.sampled_from([0, 1, 1, 1, 2, 4, 8])),
            cpu_milli=draw(st.sampled_from([100, 1000, 4000])),
            memory=draw(st.sampled_from([1, 2, 8])) * GI,
        )
        for i in range(draw(st.integers(1, 2)))
    )
    return GangRequest(
        job_id=job_id,
        attempt=1,
        queue=draw(st.sampled_from([*queues, *queues, *queues, "ghost"])),
        priority=draw(st.integers(0, 3)),
        order=draw(st.integers(0, 1000)),
        podsets=podsets,
        gpu_types=draw(
            st.sampled_from([frozenset(), frozenset(), frozenset({"a"}), frozenset({"b"})])
        ),
        capacity=draw(st.sampled_from(["any", "spot", "on-demand", "spot-then-on-demand"])),
        spot_exhausted=draw(st.booleans()),
        checkpoint_interval_s=draw(st.sampled_from([None, 600.0])),
    )


ops = st.sampled_from(
    [
        "schedule",
        "schedule",
        "schedule",
        "release",
        "spot",
        "remove",
        "gpu",
        "upsert",
        "snapshot",
        "unschedulable",
        "reserve",
    ]
)
