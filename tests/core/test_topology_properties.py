"""Properties of topology-aware placement over random topology-rich fleets.

- Through the lifecycle machine (submit, cycles, dispatches acked, nodes lost): a gang never
  lands across two domains of the level it requires, nor across zones unless it spreads; and
  the machine's safety checks (`invariants.violations`: whole gangs, no node over-committed,
  quota held) still pass after every step.
- Through the scheduler alone: a gang that only prefers a level either keeps it, or is placed
  across its domains with a note that says so.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.effects import Send
from broker.core.inputs import SubmitJob
from broker.core.invariants import violations
from broker.core.machine import Machine
from broker.core.scheduler import Scheduler
from broker.core.topology import depth_of
from broker.core.types import TopologyNeed
from schemas.agent import ClusterSnapshot, Dispatch, NodeGone, NodeInfo
from schemas.job import GangTopology, JobSpec, PodSet

from .harness import T0, Sim
from .helpers import LEVELS, config, gang, queue, tflavor

PROPS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def topo_fleet(draw: st.DrawFn, cluster: str) -> list[NodeInfo]:
    nodes = []
    for z in range(draw(st.integers(1, 2))):
        for b in range(draw(st.integers(1, 2))):
            for r in range(draw(st.integers(1, 2))):
                for i in range(draw(st.integers(1, 3))):
                    name = f"{cluster}-z{z}-b{b}-r{r}-{i}"
                    gpu = draw(st.sampled_from([4, 8]))
                    nodes.append(
                        NodeInfo(
                            name=name,
                            flavor="od",
                            gpu=gpu,
                            cpu_milli=64_000,
                            memory=2**38,
                            other_gpu=draw(st.sampled_from([0, 0, 0, gpu // 2])),
                            topology=(f"z{z}", f"b{b}", f"r{r}", name),
                        )
                    )
    return nodes


levels = st.sampled_from([None, "zone", "block", "rack", "example.com/rack", "host"])
required = st.sampled_from([None, "zone", "block", "block", "rack", "rack", "example.com/rack"])


@st.composite
def job_specs(draw: st.DrawFn) -> JobSpec:
    gang_ = [
        PodSet(
            name="w",
            replicas=draw(st.integers(1, 6)),
            gpu=draw(st.sampled_from([1, 2, 4, 8])),
            cpu="1",
        )
    ]
    if draw(st.booleans()):
        gang_.append(PodSet(name="launcher", replicas=1, gpu=0, cpu="1"))
    topo = None
    if draw(st.booleans()):
        topo = GangTopology(
            required=draw(required), preferred=draw(levels), spread=draw(st.booleans())
        )
    return JobSpec(name="j", gang=gang_, topology=topo)


class TopoSim(Sim):
    def __init__(self, fleet: dict[str, list[NodeInfo]], gpu_quota: int) -> None:
        cfg = config([queue("q", quotas={"od": {"gpu": (gpu_quota, None, None)}})])
        self.m = Machine(cfg, epoch=1)
        self.now = T0
        self.seq = {}
        for c, ns in fleet.items():
            self.send(c, ClusterSnapshot(flavors=[tflavor()], nodes=ns))

    def submit_spec(self, spec: JobSpec) -> None:
        self.m.handle(SubmitJob(spec, subject_queue="q"), self.now)


def required_depth(spec: JobSpec) -> int:
    """The depth every GPU replica must share: the finest required level, else the zone
    unless the gang spreads (the rule under test, restated from the JobSpec alone)."""
    t = spec.topology
    if t is not None and t.required:
        return depth_of(LEVELS, t.required)
    if t is not None and t.spread:
        return 0
    return 1


def check_dispatches(effects: list[object], paths: dict[str, tuple[str, ...]]) -> None:
    """Every dispatched gang's GPU replicas share one domain of the depth its spec requires."""
    for e in effects:
        if not (isinstance(e, Send) and isinstance(e.command, Dispatch)):
            continue
        cmd = e.command
        gpu_sets = {p.name for p in cmd.spec.gang if p.gpu}
        nodes = [n for a in cmd.assignment if a.podset in gpu_sets for n in a.nodes]
        depth = required_depth(cmd.spec)
        if len(set(nodes)) > 1 and depth:
            domains = {paths[f"{e.cluster}/{n}"][:depth] for n in nodes}
            assert len(domains) == 1, (cmd.job_id, cmd.spec.topology, domains)


@PROPS
@given(
    st.data(),
    st.lists(job_specs(), min_size=1, max_size=6),
    st.integers(8, 96),
)
def test_required_levels_hold_through_the_machine(
    data: st.DataObject, specs: list[JobSpec], quota: int
) -> None:
    fleet = {c: data.draw(topo_fleet(c)) for c in ("a", "b")[: data.draw(st.integers(1, 2))]}
    paths = {f"{c}/{n.name}": n.topology for c, ns in fleet.items() for n in ns}
    sim = TopoSim(fleet, quota)
    for spec in specs:
        sim.submit_spec(spec)
    for step in range(3):
        effects = sim.step(5.0)
        check_dispatches(effects, paths)
        assert violations(sim.m) == []
        if step == 0:  # a node is lost: its gangs move whole, within their domains again
            c = next(iter(fleet))
            effects = sim.send(c, NodeGone(node=fleet[c][0].name))
            check_dispatches(effects, paths)
            assert violations(sim.m) == []


@PROPS
@given(st.data(), st.integers(2, 4), st.sampled_from([4, 8]))
def test_a_preferred_level_is_kept_or_the_placement_says_why(
    data: st.DataObject, replicas: int, gpu: int
) -> None:
    nodes = data.draw(topo_fleet("c"))
    s = Scheduler(config())
    s.apply_snapshot("c", [tflavor()], nodes, T0)
    req = gang("j", (replicas, gpu))
    req.topology = TopologyNeed(preferred=("rack",))
    res = s.schedule([req], T0)
    if not res.admitted:
        return
    ((_, p),) = res.admitted
    topo = {n.name: n.topology for n in nodes}
    racks = {topo[n][:3] for n in p.nodes}
    zones = {topo[n][:1] for n in p.nodes}
    assert len(zones) == 1  # still one zone (the default requirement)
    if len(racks) > 1:
        assert p.note.startswith("preferred one rack"), p.note
    else:
        assert p.note == ""
