"""Fabric resources (EFA, rdma/..., hugepages) counted per node: a node without enough free
takes fewer replicas or none, what Muster placed is given back when a gang ends or shrinks, and
no node is ever over-committed on one, through admissions, releases, shrinks and snapshots."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import Send
from broker.core.inputs import SubmitJob
from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, PodSetDemand
from schemas.agent import (
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    NodeGone,
    NodeInfo,
    WorkloadStatus,
)
from schemas.config import FlavorQuota, QueueConfig, ResourceQuota
from schemas.job import JobSpec, PodSet

from .harness import T0, Sim
from .helpers import GI, NOW, config

EFA = "vpc.amazonaws.com/efa"
IB = "rdma/ib"


def od(**extended: int) -> FlavorInfo:
    return FlavorInfo("od", "on-demand", "h100", 3.0, node_extended=extended)


def node(name: str, gpu: int = 8, **extended: int) -> NodeInfo:
    ext = {EFA if k == "efa" else IB: v for k, v in extended.items()}
    return NodeInfo(name, "od", gpu, 96_000, 1024 * GI, extended=ext)


def request(
    job: str, replicas: int, gpu: int, efa: int = 0, ib: int = 0, order: int = 1
) -> GangRequest:
    ext = tuple((r, v) for r, v in ((EFA, efa), (IB, ib)) if v)
    demand = PodSetDemand("w", replicas, gpu, 1000, GI, ext)
    return GangRequest(job, 1, "default", 0, order, (demand,))


def test_a_node_without_the_resource_or_with_too_little_free_takes_no_replica() -> None:
    s = Scheduler(config())
    # n0 has GPUs but no EFA; n1 has EFA for one replica only; n2 for two.
    s.apply_snapshot("c", [od()], [node("n0", 16), node("n1", 16, efa=32), node("n2", efa=64)], NOW)
    res = s.schedule([request("j", 3, 4, efa=32)], NOW)
    ((_, p),) = res.admitted
    ((_, placed),) = p.assignment
    assert sorted(placed) == ["n1", "n2", "n2"]
    # Every EFA is taken now: a second gang asking for it waits, with the numbers.
    res = s.schedule([request("k", 1, 1, efa=1, order=2)], NOW)
    assert not res.admitted
    (reason,) = res.pending["k"]
    assert reason.code == "insufficient-capacity"
    assert f"w needs 1 {EFA} per replica, and the most free on one node is 0" in reason.message
    # The gang ends: its EFA is free again.
    s.release("j", 1)
    ((_, p),) = s.schedule([request("k", 1, 1, efa=1, order=2)], NOW).admitted
    assert p.nodes <= {"n1", "n2"}


def test_a_flavor_declares_capacity_for_its_nodes_and_a_node_report_wins() -> None:
    s = Scheduler(config())
    s.apply_snapshot("c", [od(**{EFA: 4})], [node("a"), node("b", ib=1)], NOW)
    ((_, p),) = s.schedule([request("j", 2, 4, efa=2)], NOW).admitted
    assert p.nodes == {"a"}  # b reports its own fabric (rdma only), so it has no EFA
    assert not s.schedule([request("k", 1, 1, efa=1, order=2)], NOW).admitted


def test_usage_survives_a_snapshot_and_a_shrink_gives_it_back() -> None:
    s = Scheduler(config())
    fleet = [node("a", efa=1), node("b", efa=1)]
    s.apply_snapshot("c", [od()], fleet, NOW)
    assert len(s.schedule([request("j", 2, 8, efa=1)], NOW).admitted) == 1
    s.apply_snapshot("c", [od()], fleet, NOW)  # the agent reconnects: nodes re-reported
    extra = request("k", 1, 0, efa=1, order=2)
    assert not s.schedule([extra], NOW).admitted
    assert s.shrink("j", 1, "a")
    ((_, p),) = s.schedule([extra], NOW).admitted
    assert p.nodes == {"a"}


def capped(gpu: int, efa: int, name: str = "default") -> QueueConfig:
    quota = FlavorQuota("od", {"gpu": ResourceQuota(gpu)}, extended={EFA: efa})
    return QueueConfig(name=name, quotas=[quota])


def test_a_queue_caps_a_fabric_resource_in_a_flavor_class() -> None:
    s = Scheduler(config([capped(64, 40)]))
    s.apply_snapshot("c", [od()], [node("a", efa=32), node("b", efa=32)], NOW)
    assert len(s.schedule([request("j", 1, 8, efa=32)], NOW).admitted) == 1
    res = s.schedule([request("k", 1, 8, efa=16, order=2)], NOW)
    (reason,) = res.pending["k"]
    assert reason.code == "quota-exceeded"
    assert reason.message == f"queue default needs 16 {EFA} of od; its cap of 40 leaves 8"
    assert len(s.schedule([request("m", 1, 8, efa=8, order=3)], NOW).admitted) == 1
    s.release("j", 1)
    assert len(s.schedule([request("k", 1, 8, efa=16, order=2)], NOW).admitted) == 1


EXT_PROPS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeInfo]:
    return [
        node(
            f"n{i}",
            draw(st.sampled_from([4, 8])),
            efa=draw(st.sampled_from([0, 0, 1, 4, 32])),
            ib=draw(st.sampled_from([0, 1, 2])),
        )
        for i in range(draw(st.integers(1, 6)))
    ]


gangs = st.tuples(
    st.integers(1, 4),  # replicas
    st.sampled_from([0, 1, 2, 4, 8]),  # GPUs per replica
    st.sampled_from([0, 0, 1, 2, 4, 32]),  # EFA per replica
    st.sampled_from([0, 0, 1]),  # rdma/ib per replica
)


@EXT_PROPS
@given(
    fleets(),
    st.lists(gangs, min_size=1, max_size=8),
    st.lists(st.integers(0, 20), max_size=6),
    st.integers(4, 48),
    st.integers(0, 64),
)
def test_no_node_is_over_committed_on_a_fabric_resource(
    fleet: list[NodeInfo],
    shapes: list[tuple[int, int, int, int]],
    ends: list[int],
    gpu_quota: int,
    efa_cap: int,
) -> None:
    """The held fabric resources are recomputed here from the placements and the requests
    alone, and the GPU quota and the queue's EFA cap from the admitted gangs alone."""
    s = Scheduler(config([capped(gpu_quota, efa_cap)]))
    s.apply_snapshot("c", [od()], fleet, NOW)
    cap = {(n.name, r): n.extended.get(r, 0) for n in fleet for r in (EFA, IB)}
    reqs = {f"j{i}": request(f"j{i}", *shape, order=i) for i, shape in enumerate(shapes)}
    held: dict[str, tuple[str, ...]] = {}  # job -> node per replica
    pending = dict(reqs)
    for step in range(4):
        res = s.schedule(list(pending.values()), NOW + step)
        for job, p in res.admitted:
            ((_, placed),) = p.assignment
            held[job] = placed
            pending.pop(job)
        used: dict[tuple[str, str], int] = {}
        for job, placed in held.items():
            for name in placed:
                for r, v in reqs[job].podsets[0].extended:
                    used[name, r] = used.get((name, r), 0) + v
        for key, amount in used.items():
            assert amount <= cap[key], (key, amount, cap[key], held)
        assert sum(len(p) * reqs[j].podsets[0].gpu for j, p in held.items()) <= gpu_quota
        assert sum(v for (_, r), v in used.items() if r == EFA) <= efa_cap
        if held and step < len(ends):  # a gang ends, or shrinks off one node
            job = sorted(held)[ends[step] % len(held)]
            placed = held[job]
            if ends[step] % 2 and len(set(placed)) > 1 and s.shrink(job, 1, placed[0]):
                held[job] = tuple(n for n in placed if n != placed[0])
            else:
                s.release(job, 1)
                del held[job]


class FabricSim(Sim):
    """The machine with one fleet of nodes offering EFA, a queue capping it."""

    def __init__(self, fleet: list[NodeInfo], efa_cap: int) -> None:
        self.m = Machine(config([capped(1024, efa_cap, "q")]), epoch=1)
        self.now = T0
        self.seq = {}
        self.send("c", ClusterSnapshot(flavors=[od()], nodes=fleet))


@EXT_PROPS
@given(
    fleets(),
    st.lists(gangs, min_size=1, max_size=6),
    st.integers(0, 64),
    st.integers(0, 5),
)
def test_the_machines_checks_hold_with_fabric_resources(
    fleet: list[NodeInfo], shapes: list[tuple[int, int, int, int]], efa_cap: int, lost: int
) -> None:
    """Through submissions, dispatches, a lost node and re-placements, the machine's safety
    checks pass (`fabric_not_overcommitted` among them: the fabric resources recomputed from
    the placements and the podsets' demands, within every node's)."""
    sim = FabricSim(fleet, efa_cap)
    for replicas, gpu, efa, ib in shapes:
        extended = {k: v for k, v in ((EFA, efa), (IB, ib)) if v}
        podset = PodSet(name="w", replicas=replicas, gpu=gpu, cpu="1", extended=extended)
        sim.m.handle(SubmitJob(JobSpec(name="j", gang=[podset]), subject_queue="q"), sim.now)
    dispatched: list[Dispatch] = []
    for step in range(4):
        effects = sim.step(5.0)
        dispatched += [
            e.command for e in effects if isinstance(e, Send) and isinstance(e.command, Dispatch)
        ]
        assert violations(sim.m) == []
        if step == 0:
            sim.send("c", NodeGone(node=fleet[lost % len(fleet)].name))
        elif dispatched:  # a gang ends: what it held is given back
            done = dispatched.pop(lost % len(dispatched))
            sim.send(
                "c", WorkloadStatus(job_id=done.job_id, attempt=done.attempt, phase="succeeded")
            )
            assert violations(sim.m) == []
