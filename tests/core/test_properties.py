"""Property tests over random fleets, queues, gangs and event sequences.

The test keeps its own model (node infos as the agents last reported them, and the admitted
placements) and checks the scheduler against it after every step:
- no placement ever takes more gpu, cpu or memory than a node has free;
- every admitted gang is whole, on one cluster, with its GPU podsets on one flavor, on nodes
  that could take placements, matching the job's GPU types and capacity preference;
- quotas: usage stays within nominal + borrowing limit, and a cohort never lends more than its
  members' lendable quota (so a queue lends at most its lending limit);
- node usage always equals the sum of the live placements (release restores capacity exactly,
  snapshots of the same nodes keep allocations), and the free-GPU index agrees with the nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broker.core.placement import capacity_rank
from broker.core.scheduler import Scheduler
from broker.core.types import GangRequest, Placement
from schemas.agent import FlavorInfo, NodeInfo

from .helpers import NOW, config
from .strategies import CLASSES, class_of, fleets, ops, queue_sets, requests


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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=fleets(), queues=queue_sets(), data=st.data())
def test_random_event_sequences_keep_every_invariant(
    fleet: dict[str, tuple[list[FlavorInfo], list[NodeInfo]]],
    queues: list,
    data: st.DataObject,  # type: ignore[type-arg]
) -> None:
    s = Scheduler(config(queues=queues, classes=CLASSES))
    m = Model()
    now = NOW
    for cname, (flavors, ns) in fleet.items():
        assert s.apply_snapshot(cname, flavors, ns, now) == []
        m.flavors[cname] = {f.name: f for f in flavors}
        for n in ns:
            m.nodes[(cname, n.name)] = n
    qnames = [q.name for q in queues]
    seq = 0
    for _ in range(data.draw(st.integers(1, 16))):
        now += 10
        op = data.draw(ops)
        node_keys = sorted(m.nodes)
        if op == "schedule":
            reqs = []
            for _ in range(data.draw(st.integers(1, 6))):
                seq += 1
                reqs.append(data.draw(requests(f"j{seq}", qnames)))
            res = s.schedule(reqs, now)
            assert len(res.admitted) + len(res.pending) == len(reqs)
            by_id = {r.job_id: r for r in reqs}
            for job, p in res.admitted:
                m.allocs[(job, 1)] = (by_id[job], p)
                check_admission(m, by_id[job], p)
                s.note_progress(job, 1, now - data.draw(st.integers(0, 100)))
            assert all(res.pending.values())
            event(f"admitted {min(len(res.admitted), 3)}+")
            for reasons in res.pending.values():
                event(reasons[0].code)
            if res.preemptions:
                event("preemption planned")
            for pre in res.preemptions:
                assert pre.victims and pre.preemptor in res.pending
        elif op == "release" and m.allocs:
            key = data.draw(st.sampled_from(sorted(m.allocs)))
            del m.allocs[key]
            s.release(*key)
            s.release(*key)
        elif op == "reserve" and m.allocs:
            job, attempt = data.draw(st.sampled_from(sorted(m.allocs)))
            req, _ = m.allocs[(job, attempt)]
            if (job, attempt + 1) not in m.allocs:
                new = dataclasses.replace(req, attempt=attempt + 1)
                got = s.reserve(new, now, replacing_attempt=attempt)
                event(f"reserve {'ok' if isinstance(got, Placement) else 'failed'}")
                if isinstance(got, Placement):
                    m.allocs[(job, attempt + 1)] = (new, got)
                    check_admission(m, new, got)
                else:
                    assert got
        elif op == "spot" and node_keys:
            c, n = data.draw(st.sampled_from(node_keys))
            jobs = s.spot_notice(c, n, now + 120, now)
            m.nodes[(c, n)] = msgspec.structs.replace(m.nodes[(c, n)], spot_deadline=now + 120)
            assert sorted(jobs) == sorted(
                {j for (j, _), (_, p) in m.allocs.items() if p.cluster == c and n in p.nodes}
            )
        elif op == "remove" and node_keys:
            c, n = data.draw(st.sampled_from(node_keys))
            s.remove_node(c, n, now)
            del m.nodes[(c, n)]
        elif op == "gpu" and node_keys:
            c, n = data.draw(st.sampled_from(node_keys))
            healthy = data.draw(st.integers(0, m.nodes[(c, n)].gpu))
            s.set_gpu_health(c, n, healthy, now)
            m.nodes[(c, n)] = msgspec.structs.replace(m.nodes[(c, n)], gpu_healthy=healthy)
        elif op == "upsert" and node_keys:
            c, n = data.draw(st.sampled_from(node_keys))
            info = msgspec.structs.replace(
                m.nodes[(c, n)],
                ready=data.draw(st.booleans()),
                other_gpu=data.draw(st.integers(0, 2)),
            )
            s.upsert_node(c, info, now)
            # spot notices stick to a node until it leaves the inventory
            if m.nodes[(c, n)].spot_deadline is not None and info.spot_deadline is None:
                info = msgspec.structs.replace(info, spot_deadline=m.nodes[(c, n)].spot_deadline)
            m.nodes[(c, n)] = info
        elif op == "snapshot":
            c = data.draw(st.sampled_from(sorted(fleet)))
            same = [info for (cc, _), info in sorted(m.nodes.items()) if cc == c]
            s.apply_snapshot(c, list(m.flavors[c].values()), same, now)
        elif op == "unschedulable":
            c = data.draw(st.sampled_from(sorted(fleet)))
            ok = c in m.unschedulable
            s.set_cluster_schedulable(c, ok)
            if ok:
                m.unschedulable.discard(c)
            else:
                m.unschedulable.add(c)
        check_state(s, m)
    # releasing everything gives back every GPU
    for key in list(m.allocs):
        s.release(*key)
    m.allocs.clear()
    check_state(s, m)
    s.schedule([], now)  # nobody left to place: holds go back
    assert s.held() == {}
    for c in s.cluster_states().values():
        for node in c.nodes.values():
            assert (node.used_gpu, node.used_cpu, node.used_mem) == (0, 0, 0)
