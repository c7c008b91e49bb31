"""An operator's cordon, uncordon and drain on a Kubernetes cluster (`muster cordon|uncordon|
drain`), as `kubectl cordon` and `kubectl drain` do them:

- cordon / uncordon: a merge PATCH of the Node's `spec.unschedulable` (true / false). The
  agent's node watch then reports the node `no_new_pods` ("unschedulable"), so the broker
  places nothing there and nothing here needs to tell it.
- drain: cordon, then evict each of Muster's pods on the node through the Eviction API (POST
  `pods/<name>/eviction`, policy/v1), which honours PodDisruptionBudgets: a budget with no
  disruption left answers 429 TooManyRequests, and that pod stays; the operator is told which
  and why, and can drain again later. An evicted pod is deleted gracefully and its attempt
  ends `evicted` (DisruptionTarget `EvictionByEvictionAPI`): an infrastructure loss, so the
  broker moves the job from its latest checkpoint. Pods Muster did not place are left alone:
  the agent is no cluster administrator.

Upstream rules followed (Apache-2.0, kubernetes/kubernetes): the eviction subresource's
answers in pkg/registry/core/pod/storage/eviction.go (201 with a Success Status, 429 with a
`DisruptionBudget` cause, 500 when a pod has more than one budget); kubectl's cordon in
staging/src/k8s.io/kubectl/pkg/drain/cordon.go (spec.unschedulable). The documented
behaviour: kubernetes.io/docs/concepts/scheduling-eviction/api-eviction/ and
kubernetes.io/docs/tasks/administer-cluster/safely-drain-node/ (CC BY 4.0).

The verbs (`patch nodes`, `create pods/eviction`) are granted by the optional ClusterRole in
deploy/agent/optional/nodeops-rbac.yaml; without it the API server's 403 is the answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping

from agents.backend import BackendError, NodeOpResult, pick_nodes
from agents.kube.client import KubeApiError, KubeRest, item_path
from agents.kube.decode import KPod, decode_status
from schemas.agent import NodeOpName

MERGE_PATCH = "application/merge-patch+json"
Key = tuple[str, int]


async def kube_node_op(
    rest: KubeRest,
    cluster: str,
    namespace: str,
    nodes: Iterable[str],
    pods: Mapping[str, KPod],
    pod_key: Mapping[str, Key],
    op: NodeOpName,
    node: str | None,
    reason: str,
) -> NodeOpResult:
    """Carry out `op` on `node` (None: every node the agent sees). `pods` are Muster's pods
    (uid -> pod), `pod_key` their attempts. BackendError says what was refused and why."""
    if op == "notice":
        raise BackendError(
            f"cluster {cluster!r} is a Kubernetes cluster: spot notices come from its cloud "
            "provider, not from Muster; to move what runs on a node, `muster drain` it"
        )
    names = pick_nodes(cluster, nodes, node)
    for name in names:
        await _set_unschedulable(rest, cluster, name, op != "uncordon")
    if op != "drain":
        return NodeOpResult(names, [])
    on_nodes = set(names)
    targets = sorted(
        (p.metadata.name, pod_key[uid])
        for uid, p in pods.items()
        if uid in pod_key
        and p.spec.nodeName in on_nodes
        and p.metadata.deletionTimestamp is None
        and p.status.phase not in ("Succeeded", "Failed")
    )
    results = await asyncio.gather(*(_evict(rest, namespace, pod) for pod, _ in targets))
    blocked = [f"{pod}: {why}" for (pod, _), why in zip(targets, results, strict=True) if why]
    ended = sorted({key for (_, key), why in zip(targets, results, strict=True) if not why})
    if blocked:
        moved = ", ".join(f"{j}/{a}" for j, a in ended) or "none"
        raise BackendError(
            f"cluster {cluster!r}: {', '.join(names)} cordoned; attempts moved: {moved}; "
            f"not evicted: {'; '.join(blocked)}. Run the drain again once the budget allows"
        )
    return NodeOpResult(names, ended)


async def _set_unschedulable(rest: KubeRest, cluster: str, name: str, value: bool) -> None:
    patch = {"spec": {"unschedulable": value}}
    try:
        found = await rest.request(
            "PATCH",
            item_path("/api/v1/nodes", name),
            body=patch,
            content_type=MERGE_PATCH,
            ok_missing=True,
        )
    except KubeApiError as exc:
        raise BackendError(_refusal(cluster, exc)) from None
    if found is None:
        raise BackendError(f"cluster {cluster!r} has no node {name!r} any more")


async def _evict(rest: KubeRest, namespace: str, pod: str) -> str:
    """Evict one pod, once (a 429 is the budget's answer, not a rate limit to wait out); ""
    when it is being deleted, else why not."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": namespace},
    }
    path = f"{item_path(f'/api/v1/namespaces/{namespace}/pods', pod)}/eviction"
    await rest.limit.acquire()
    async with rest.limit.slots:
        rest.sent += 1
        resp = await rest.open("POST", path, body=body)
        try:
            data = await resp.read()
            code = resp.status
        finally:
            resp.release()
    if 200 <= code < 300 or code == 404:  # 404: already gone
        return ""
    detail = decode_status(data)
    causes = _causes(data)
    text = detail.message or detail.reason or f"HTTP {code}"
    if code == 403:
        return f"{text} (grant deploy/agent/optional/nodeops-rbac.yaml)"
    return f"{text} {causes}".strip()


def _causes(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except ValueError:
        return ""
    details = doc.get("details") if isinstance(doc, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    if not isinstance(causes, list):
        return ""
    return " ".join(str(c.get("message", "")) for c in causes if isinstance(c, dict))


def _refusal(cluster: str, exc: KubeApiError) -> str:
    text = exc.detail.message or exc.detail.reason or str(exc)
    if exc.status == 403:
        return (
            f"cluster {cluster!r} refused: {text}. The agent may change nodes only with the "
            "optional ClusterRole in deploy/agent/optional/nodeops-rbac.yaml applied"
        )
    return f"cluster {cluster!r}: {text}"
