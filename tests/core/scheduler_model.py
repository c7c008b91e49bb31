"""The model the scheduling property tests keep beside the scheduler (node infos as the agents
last reported them, the admitted placements) and the checks of the scheduler against it: an
admission fits the model's nodes, flavors and the request; the scheduler's usage, free-GPU
index and quotas agree with the model's placements."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.core.placement import capacity_rank
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, Placement
from schemas.agent import FlavorInfo, NodeInfo

from .strategies import class_of


@dataclass
class Model:
    nodes: dict[tuple[str, str], NodeInfo] = field(default_factory=dict)
    flavors: dict[str, dict[str, FlavorInfo]] = field(default_factory=dict)
    allocs: dict[tuple[str, int], tuple[GangRequest, Placement]] = field(default_factory=dict)
    unschedulable: set[str] = field(default_factory=set)

    def usage(self) -> dict[tuple[str, str], list[int]]:
        out: dict[tuple[str, str], list[int]] = {}
        for req, p in self.allocs.values():
            demands = {d.podset: d for d in req.podsets}
            for podset, names in p.assignment:
                d = demands[podset]
                for n in names:
                    u = out.setdefault((p.cluster, n), [0, 0, 0])
                    u[0] += d.gpu
                    u[1] += d.cpu_milli
                    u[2] += d.memory
        return out


def usable_gpu(n: NodeInfo) -> int:
    return n.gpu if n.gpu_healthy is None else min(n.gpu, n.gpu_healthy)


def schedulable(n: NodeInfo) -> bool:
    return n.ready and n.spot_deadline is None and usable_gpu(n) >= n.gpu


def check_admission(m: Model, req: GangRequest, p: Placement) -> None:
    assert p.cluster not in m.unschedulable
    demands = {d.podset: d for d in req.podsets}
    assert {ps for ps, _ in p.assignment} == {d.podset for d in req.podsets if d.replicas}
    flavor = m.flavors[p.cluster][p.flavor]
    assert p.flavor_class == class_of(flavor)
    if req.total_gpu:
        assert not req.gpu_types or flavor.gpu_type in req.gpu_types
        assert capacity_rank(req.capacity, req.spot_exhausted, flavor.capacity_type) >= 0
    assert (p.cluster, p.flavor) not in req.avoid_pools
    touched: dict[str, list[int]] = {}
    for podset, names in p.assignment:
        d = demands[podset]
        assert len(names) == d.replicas
        for name in names:
            info = m.nodes[(p.cluster, name)]  # the node exists in that one cluster
            assert schedulable(info)
            if d.gpu:
                assert info.flavor == p.flavor  # GPU podsets on one flavor
            t = touched.setdefault(name, [0, 0, 0])
            t[0] += d.gpu
            t[1] += d.cpu_milli
            t[2] += d.memory
    usage = m.usage()
    for name, add in touched.items():
        info = m.nodes[(p.cluster, name)]
        total = usage[(p.cluster, name)]
        caps = (
            usable_gpu(info) - info.other_gpu,
            info.cpu_milli - info.other_cpu_milli,
            info.memory - info.other_memory,
        )
        for r in range(3):
            if add[r]:
                assert total[r] <= caps[r], (name, r, total, caps)


def check_state(s: Scheduler, m: Model) -> None:
    usage = m.usage()
    # capacity a preemptor's ended victims freed is held for it until its next cycle
    for by_cluster in s.held().values():
        for cname, held in by_cluster.items():
            for name, vec in held.items():
                u = usage.setdefault((cname, name), [0, 0, 0])
                for r in range(3):
                    u[r] += vec[r]
    for cname, c in s.cluster_states().items():
        for name, node in c.nodes.items():
            u = usage.get((cname, name), [0, 0, 0])
            assert [node.used_gpu, node.used_cpu, node.used_mem] == u, (cname, name)
            assert node.free_gpu == max(0, node.usable_gpu - node.other_gpu - node.used_gpu)
        for pool in c.pools.values():
            indexed = [n for b in pool.buckets for n in b.values()]
            assert sorted(n.name for n in indexed) == sorted(
                n.name for n in pool.nodes.values() if n.schedulable
            )
            assert all(n.free_gpu == n.bucket for n in indexed)
            assert pool.free_gpu == sum(n.free_gpu for n in indexed)
    # quota: the newest attempt of each job holds its quota
    newest: dict[str, tuple[GangRequest, Placement]] = {}
    for (job, _attempt), v in sorted(m.allocs.items()):
        newest[job] = v
    used: dict[tuple[str, str], list[int]] = {}
    for req, p in newest.values():
        u = used.setdefault((req.queue, p.flavor_class), [0, 0, 0])
        u[0] += req.total_gpu
        u[1] += req.total_cpu_milli
        u[2] += req.total_memory
    queues = s.queue_states()
    for (q, cls), u in used.items():
        assert queues[q].used(cls) == u
    for qs in queues.values():
        if qs.limits is None:
            continue
        for cls in qs.usage:
            lims = qs.limits.get(cls)
            assert lims is not None or not any(used.get((qs.name, cls), [0, 0, 0]))
            for r, lim in enumerate(lims or ()):
                if lim is None:
                    continue
                u_r = used.get((qs.name, cls), [0, 0, 0])[r]
                if qs.cohort is None:
                    assert u_r <= lim.nominal
                elif lim.borrowing is not None:
                    assert u_r <= lim.nominal + lim.borrowing
    for co in s.cohort_states().values():
        for cls, lend in co.lendable.items():
            for r in range(3):
                borrowed = 0
                for qs in co.members:
                    lims = qs.limits.get(cls) if qs.limits else None
                    lim = lims[r] if lims else None
                    if lim is not None:
                        borrowed += max(0, used.get((qs.name, cls), [0, 0, 0])[r] - lim.guaranteed)
                assert borrowed <= lend[r]


def load_fleet(
    s: Scheduler,
    m: Model,
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    now: float,
) -> list[str]:
    """Report every cluster of `fleet` to the scheduler and file its flavors and nodes in the
    model; what the scheduler returned for the reports, in order."""
    out: list[str] = []
    for cname, (flavors, ns) in fleet.items():
        out.extend(s.apply_snapshot(cname, flavors, ns, now))
        m.flavors[cname] = {f.name: f for f in flavors}
        for n in ns:
            m.nodes[(cname, n.name)] = n
    return out
