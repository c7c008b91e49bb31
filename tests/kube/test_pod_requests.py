"""kube-scheduler's effective pod request: one table of cases taken from the upstream tests,
each checked against the agent's function (`pod_usage`, what pods hold on a node), the broker's
demand (`pod_demand`, what a template needs) and the stand-in scheduler, written apart.

Provenance: kubernetes/kubernetes `staging/src/k8s.io/component-helpers/resource/
helpers_test.go` (Apache-2.0); the test function and case name are given per row. Cases from
`TestPodResourceLimits` are given as limits only, as there: the API server defaults a missing
request to the limit, and the aggregation is the one `PodRequests` uses. Plain numbers are
cores for cpu and bytes for memory, as `resource.MustParse` reads them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from agents.kube.decode import KPod, pod_usage
from kinds.demand import pod_demand
from tests.kube.scheduling import pod_requests

Res = dict[str, str]


def c(requests: Res | None = None, limits: Res | None = None, sidecar: bool = False) -> Any:
    out: dict[str, Any] = {"name": "c", "image": "x", "resources": {}}
    if requests:
        out["resources"]["requests"] = requests
    if limits:
        out["resources"]["limits"] = limits
    if sidecar:
        out["restartPolicy"] = "Always"
    return out


def spec(
    containers: list[Any],
    init: list[Any] | None = None,
    overhead: Res | None = None,
    pod_level: Res | None = None,
) -> dict[str, Any]:
    s: dict[str, Any] = {"containers": containers}
    if init:
        s["initContainers"] = init
    if overhead:
        s["overhead"] = overhead
    if pod_level:
        s["resources"] = {"requests": pod_level}
    return {"spec": s}


MI = 2**20
GI = 2**30
CASES: list[tuple[str, dict[str, Any], int, int]] = [
    (
        "TestPodRequestsAndLimits/req-and-overhead",
        spec([c({"cpu": "1", "memory": "10"})], overhead={"cpu": "5", "memory": "5"}),
        6000,
        15,
    ),
    (
        "TestPodRequestsAndLimitsWithoutOverhead/two container with overhead, massive init",
        spec(
            [c({"cpu": "1", "memory": "5"}), c({"cpu": "4", "memory": "12"})],
            [c({"cpu": "1", "memory": "5"}), c({"cpu": "40", "memory": "120"})],
        ),
        40_000,
        120,
    ),
    (
        "TestPodResourceRequests/nil options, larger init container",
        spec([c({"cpu": "1"})], [c({"cpu": "4"})]),
        4000,
        0,
    ),
    (
        "TestPodResourceRequests/nil options, larger containers",
        spec([c({"cpu": "2"}), c({"cpu": "3"})], [c({"cpu": "2"})]),
        5000,
        0,
    ),
    (
        "TestPodResourceRequests/pod overhead included",
        spec(
            [c({"cpu": "2"}), c({"cpu": "3"})],
            [c({"cpu": "2"}, {"cpu": "2"})],
            overhead={"cpu": "1", "memory": "1Gi"},
        ),
        6000,
        GI,
    ),
    (
        "TestPodResourceLimits/multiple restartable init containers",
        spec(
            [c(limits={"cpu": "1"})],
            [
                c(limits={"cpu": "5"}),
                c(limits={"cpu": "1"}, sidecar=True),
                c(limits={"cpu": "2"}, sidecar=True),
                c(limits={"cpu": "3"}, sidecar=True),
            ],
        ),
        7000,
        0,
    ),
    (
        "TestPodResourceLimits/multiple restartable and regular init containers",
        spec(
            [c(limits={"cpu": "1"})],
            [
                c(limits={"cpu": "5"}),
                c(limits={"cpu": "1"}, sidecar=True),
                c(limits={"cpu": "2"}, sidecar=True),
                c(limits={"cpu": "5"}),
                c(limits={"cpu": "3"}, sidecar=True),
            ],
        ),
        8000,
        0,
    ),
    (
        "TestPodResourceLimits/restartable-init, init and regular",
        spec(
            [c(limits={"cpu": "100"})],
            [c(limits={"cpu": "10"}, sidecar=True), c(limits={"cpu": "200"})],
        ),
        210_000,
        0,
    ),
    (
        "TestPodLevelResourceRequests/pod level memory and container level cpu resources",
        spec([c({"cpu": "2m"})], pod_level={"memory": "2Mi"}),
        2,
        2 * MI,
    ),
    (
        "TestPodLevelResourceRequests/pod level unsupported resources set at pod-level",
        spec([c({"memory": "3Mi"})], pod_level={"storage": "2Mi"}),
        0,
        3 * MI,
    ),
]


@pytest.mark.parametrize(("case", "pod", "cpu", "memory"), CASES, ids=[c[0] for c in CASES])
def test_effective_request_matches_kube_scheduler(
    case: str, pod: dict[str, Any], cpu: int, memory: int
) -> None:
    agent = pod_usage(msgspec.convert(pod, KPod))
    assert (agent.cpu_milli, agent.memory) == (cpu, memory), "agent"
    broker = pod_demand(pod, "template")
    assert (broker.cpu, broker.memory) == (cpu, memory), "broker demand"
    stand_in = pod_requests(pod)
    assert (stand_in["cpu"], stand_in["memory"]) == (cpu, memory), "stand-in scheduler"


def test_gpus_of_a_sidecar_and_an_init_container_count_as_the_scheduler_counts_them() -> None:
    """A GPU-holding sidecar runs beside the trainer; an init container after it needs its own
    GPUs on top of the sidecar's (the same rules as cpu, for an extended resource)."""
    gpu = "nvidia.com/gpu"
    pod = spec(
        [c(limits={gpu: "4"})],
        [c(limits={gpu: "1"}, sidecar=True), c(limits={gpu: "8"})],
    )
    assert pod_usage(msgspec.convert(pod, KPod), gpu).gpu == 9
    assert pod_demand(pod, "template").gpu == 9
    assert pod_requests(pod)[gpu] == 9
