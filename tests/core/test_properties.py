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

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broker.core.scheduler import Scheduler
from broker.core.types import Placement
from schemas.agent import FlavorInfo, NodeInfo

from .helpers import NOW, config
from .scheduler_model import Model, check_admission, check_state, load_fleet
from .strategies import CLASSES, fleets, ops, queue_sets, requests


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
    assert load_fleet(s, m, fleet, now) == []
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
