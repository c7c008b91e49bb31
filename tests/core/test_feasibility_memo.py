"""`Scheduler.check_feasible` answers alike submissions from a memo: whatever the fleet did in
between (nodes added, replaced, removed, healed, noticed; clusters reported or lost), the
memoised answer is the one a fresh computation gives."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest
from schemas.agent import NodeInfo
from tests.core.helpers import GI, NOW, config, flavor, gang, queue

FLAVORS = [flavor("od", "on-demand", "a100"), flavor("spot", "spot", "t4")]
QUEUES = [
    queue("default"),
    queue("capped", quotas={"od": {"gpu": (8, 4, None)}}),
]


@st.composite
def node_infos(draw: st.DrawFn) -> NodeInfo:
    gpu = draw(st.sampled_from([1, 4, 8]))
    return NodeInfo(
        name=f"n{draw(st.integers(0, 5))}",
        flavor=draw(st.sampled_from(["od", "spot"])),
        gpu=gpu,
        cpu_milli=draw(st.sampled_from([8_000, 96_000])),
        memory=draw(st.sampled_from([64, 1024])) * GI,
        gpu_healthy=draw(st.sampled_from([None, None, 0, gpu // 2])),
    )


clusters = st.sampled_from(["c0", "c1"])
changes = st.one_of(
    st.tuples(st.just("snapshot"), clusters, st.lists(node_infos(), max_size=4)),
    st.tuples(st.just("upsert"), clusters, node_infos()),
    st.tuples(st.just("remove"), clusters, st.sampled_from([f"n{i}" for i in range(6)])),
    st.tuples(st.just("health"), clusters, st.sampled_from(["n0", "n1"]), st.integers(0, 8)),
    st.tuples(st.just("notice"), clusters, st.sampled_from(["n0", "n1"])),
    st.tuples(st.just("lost"), clusters),
)


@st.composite
def requests(draw: st.DrawFn) -> GangRequest:
    sets = draw(
        st.lists(
            st.tuples(st.integers(1, 4), st.sampled_from([0, 1, 2, 4, 8])), min_size=1, max_size=2
        )
    )
    req = gang(
        "j",
        *sets,
        cpu=draw(st.sampled_from([1000, 64_000])),
        capacity=draw(st.sampled_from(["any", "on-demand", "spot", "spot-then-on-demand"])),
        gpu_types=draw(st.sampled_from([(), ("a100",), ("t4",)])),
        spot_exhausted=draw(st.booleans()),
        order=1,
    )
    if draw(st.booleans()):
        req = dataclasses.replace(req, min_replicas={"p0": 1})
    return req


def apply(s: Scheduler, change: tuple[object, ...]) -> None:
    kind, cluster = change[0], str(change[1])
    if kind == "snapshot":
        s.apply_snapshot(cluster, FLAVORS, list(change[2]), NOW)  # type: ignore[call-overload]
    elif kind == "upsert":
        s.upsert_node(cluster, change[2], NOW)  # type: ignore[arg-type]
    elif kind == "remove":
        s.remove_node(cluster, str(change[2]), NOW)
    elif kind == "health":
        s.set_gpu_health(cluster, str(change[2]), int(change[3]), NOW)  # type: ignore[call-overload]
    elif kind == "notice":
        s.spot_notice(cluster, str(change[2]), NOW + 60, NOW)
    else:
        s.remove_cluster(cluster, NOW)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(changes, requests()), min_size=1, max_size=30))
def test_memoised_feasibility_equals_a_fresh_computation(steps: list[object]) -> None:
    s = Scheduler(config(QUEUES))
    asked: list[GangRequest] = []
    for step in steps:
        if isinstance(step, GangRequest):
            asked.append(step)
        else:
            apply(s, step)  # type: ignore[arg-type]
        # every submission so far asked again, in each queue: repeated shapes come from the
        # memo, and a shape alike in two queues may be admissible in one only
        for req in asked:
            for name in ("default", "capped"):
                alike = dataclasses.replace(req, queue=name)
                assert s.check_feasible(alike) == s.check_feasible_fresh(alike)
