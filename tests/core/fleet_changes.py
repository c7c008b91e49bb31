"""Fleet changes drawn for the scheduling core's property tests: node snapshots, upserts,
removals, health, spot notices and lost clusters over two clusters of two flavors, and how
each is applied to a `Scheduler`."""

from __future__ import annotations

from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from schemas.agent import NodeInfo
from tests.core.helpers import GI, NOW, flavor

FLAVORS = [flavor("od", "on-demand", "a100"), flavor("spot", "spot", "t4")]


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
