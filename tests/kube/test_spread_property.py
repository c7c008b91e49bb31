"""Every placement the real scheduling core makes is schedulable as the agent writes it.

The core places a gang on a fleet where other gangs already run; the agent turns the
placement into pod templates (pinning + spread); the scheduler stand-in
(tests/kube/scheduling.py) binds the pods a controller would create from those templates, in
an arbitrary order and with arbitrary choices among feasible nodes. No pod may stay Pending:
a template that lets one pod take a node another pod of the gang needs would deadlock the gang.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agents.kube.config import FlavorConfig, build_workload
from broker.core.scheduler import Scheduler
from broker.core.types import Placement
from kinds import adapter_of
from schemas.agent import Dispatch, PodSetAssignment
from schemas.job import JobSpec
from tests.core.helpers import GI, NOW, config, flavor, gang, nodes
from tests.kube.scheduling import Cluster, make_node, pods_from_template, unscheduled

FLAVOR = FlavorConfig(name="a100", capacity_type="on-demand", node_labels={"pool": "a100"})
CPU = 16_000  # per replica, millicores
MEM = 64 * GI

podsets = st.lists(
    st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=3
)


def _node_objects(count: int) -> list[dict[str, Any]]:
    return [
        make_node(f"a-{i}", gpu=8, cpu="96", memory="1Ti", labels={"pool": "a100"})
        for i in range(count)
    ]


def _bound_pods(placement: Placement, sets: list[tuple[int, int]], job: str) -> list[Any]:
    """Pods of an already-running gang, bound where the core put them."""
    out = []
    for (name, where), (_, gpu) in zip(placement.assignment, sets, strict=True):
        for i, node in enumerate(where):
            out.append(
                {
                    "metadata": {"name": f"{job}-{name}-{i}", "namespace": "muster-workloads"},
                    "spec": {
                        "nodeName": node,
                        "containers": [
                            {
                                "name": "c",
                                "resources": {
                                    "requests": {"cpu": f"{CPU}m", "memory": str(MEM)},
                                    "limits": {"nvidia.com/gpu": str(gpu)},
                                },
                            }
                        ],
                    },
                }
            )
    return out


def _pods(plan_objects: list[Any], ns: str) -> list[dict[str, Any]]:
    """The pods the controllers create from the planned objects."""
    pods: list[dict[str, Any]] = []
    for obj in plan_objects:
        body = obj.body
        if body["kind"] == "Service":
            continue
        for t in adapter_of(body).patch_templates(body):
            pods += pods_from_template(t.template, t.replicas, f"{obj.name}-{t.role}", ns)
    return pods


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    fleet=st.integers(2, 5),
    others=st.lists(podsets, max_size=3),
    target=podsets,
    kind=st.sampled_from(["indexed-job", "pytorchjob"]),
    seed=st.integers(0, 2**16),
)
# 3 x 4 GPUs on 8-GPU nodes: Master + Worker share a node, another Worker is alone.
@example(fleet=2, others=[], target=[(3, 4)], kind="pytorchjob", seed=1)
# Two podsets of one shape: a 1-pod master and 3 workers, two of which share a node.
@example(fleet=2, others=[], target=[(1, 4), (3, 4)], kind="pytorchjob", seed=2)
# Two podsets of different shapes sharing a node that holds two pods of one of them.
@example(fleet=2, others=[], target=[(1, 2), (3, 2), (2, 4)], kind="indexed-job", seed=2)
@example(fleet=2, others=[], target=[(1, 4), (3, 4)], kind="indexed-job", seed=14)
def test_core_placements_are_schedulable_as_written(
    fleet: int,
    others: list[list[tuple[int, int]]],
    target: list[tuple[int, int]],
    kind: str,
    seed: int,
) -> None:
    if kind == "pytorchjob" and not (len(target) == 1 or (len(target) == 2 and target[0][0] == 1)):
        kind = "indexed-job"
    s = Scheduler(config())
    s.apply_snapshot(
        "c", [flavor("a100")], nodes("a", "a100", fleet, cpu=96_000, mem=1024 * GI), NOW
    )
    cluster = Cluster(_node_objects(fleet))
    for j, sets in enumerate(others):
        placed = s.reserve(gang(f"o{j}", *sets, cpu=CPU, mem=MEM), NOW)
        if isinstance(placed, Placement):
            cluster.schedule(_bound_pods(placed, sets, f"o{j}"))
    placed = s.reserve(gang("t", *target, cpu=CPU, mem=MEM), NOW)
    if not isinstance(placed, Placement):
        return  # the core found no room: nothing to schedule
    spec = msgspec.convert(
        {
            "name": "t",
            "job_id": "t",
            "gang": [
                {"name": f"p{i}", "replicas": r, "gpu": g, "cpu": f"{CPU}m", "memory": str(MEM)}
                for i, (r, g) in enumerate(target)
            ],
            "workload": {"kind": kind, "image": "i", "command": ["python", "t.py"]},
        },
        JobSpec,
    )
    cmd = Dispatch(
        job_id="t",
        attempt=1,
        epoch=1,
        flavor="a100",
        assignment=[PodSetAssignment(podset=p, nodes=list(n)) for p, n in placed.assignment],
        spec=spec,
    )
    plan = build_workload(cmd, FLAVOR, "muster-workloads")
    pods = _pods(plan.objects, "muster-workloads")
    rng = random.Random(seed)
    rng.shuffle(pods)
    result = cluster.schedule(pods, rng)
    stuck = unscheduled(result)
    assert not stuck, (
        placed.assignment,
        [p["status"]["conditions"][0]["message"] for p in stuck],
    )
