"""Container logs of an attempt's pods, read through the Kubernetes API (`pods/<name>/log`).

Pods are found by Muster's labels (job id, attempt, podset) with a fresh list, not the watch
cache, so a pod deleted a moment ago reads as gone rather than as an empty log. A replica is
the pod's completion index (batch Jobs, JobSets) or Kubeflow replica index, else its place in
name order.
"""

from __future__ import annotations

import aiohttp

from agents.backend import BackendError
from agents.kube.client import KubeApiError, KubeRest, item_path
from agents.kube.decode import KPod
from kinds.base import LABEL_ATTEMPT, LABEL_JOB, LABEL_PODSET
from schemas.agent import LogRequest

INDEX_KEYS = ("batch.kubernetes.io/job-completion-index", "training.kubeflow.org/replica-index")


def _replica(pod: KPod, fallback: int) -> int:
    meta = pod.metadata
    for key in INDEX_KEYS:
        raw = meta.labels.get(key) or meta.annotations.get(key) or ""
        if raw.isdigit():
            return int(raw)
    return fallback


async def read_pod_logs(rest: KubeRest, namespace: str, cluster: str, req: LogRequest) -> list[str]:
    """The last `req.tail_lines` lines of each selected pod, as `[podset-replica] line`."""
    where = f"attempt {req.attempt} of job {req.job_id} on cluster {cluster}"
    selector = f"{LABEL_JOB}={req.job_id},{LABEL_ATTEMPT}={req.attempt}"
    if req.podset is not None:
        selector += f",{LABEL_PODSET}={req.podset}"
    collection = f"/api/v1/namespaces/{namespace}/pods"
    try:
        pods, _ = await rest.list_all(collection, KPod, selector, max_pages=20)
    except (KubeApiError, TimeoutError, OSError, aiohttp.ClientError) as exc:
        raise BackendError(f"{where}: cannot list its pods: {exc}") from None
    counters: dict[str, int] = {}
    chosen: list[tuple[str, str]] = []  # (label, pod name)
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        podset = pod.metadata.labels.get(LABEL_PODSET, "pod")
        index = _replica(pod, counters.get(podset, 0))
        counters[podset] = counters.get(podset, 0) + 1
        if req.replica is None or index == req.replica:
            chosen.append((f"{podset}-{index}", pod.metadata.name))
    if not chosen:
        what = "" if req.replica is None else f" replica {req.replica}"
        raise BackendError(f"{where}: its pods{what} are gone (none carries its labels)")
    out: list[str] = []
    budget = req.limit_bytes
    for label, name in chosen:
        query = [("tailLines", str(req.tail_lines)), ("limitBytes", str(max(1, budget)))]
        try:
            data = await rest.request("GET", item_path(collection, name) + "/log", query=query)
        except KubeApiError as exc:
            if exc.status == 404:
                raise BackendError(f"{where}: pod {name} is gone") from None
            raise BackendError(f"{where}: reading pod {name}: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise BackendError(f"{where}: reading pod {name}: {exc!r}") from None
        text = (data or b"").decode("utf-8", errors="replace")
        budget -= len(data or b"")
        out.extend(f"[{label}] {line}" for line in text.splitlines()[-req.tail_lines :])
    return out
