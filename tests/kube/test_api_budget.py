"""Lists as a big cluster needs them (consistent pages, an expired continue token) and the
agent's API budget (concurrent, bounded checkpoint requests; 429s honoured by every request)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from kubernetes_asyncio.client import ApiClient

from agents.kube.backend import KubeBackend
from agents.kube.client import GoneError, KubeApiError, KubeRest, Reflector
from agents.kube.decode import KPod
from kinds.base import ANN_CHECKPOINT_REQUEST, ANN_JOB, LABEL_ATTEMPT, LABEL_JOB
from schemas.agent import AgentEvent, WorkloadStatus
from tests.kube.conftest import NOW, NS, PODS, gang_dispatch, make_config, node, pod
from tests.kube.fake_apiserver import EXPIRED, FakeApiServer
from tests.kube.helpers import JOBS


def fill(apiserver: FakeApiServer, count: int) -> None:
    apiserver.put("/api/v1/nodes", node("n1"))
    for i in range(count):
        apiserver.put("/api/v1/namespaces/default/pods", pod(f"p{i:03d}", "n1"))


async def test_pages_are_one_consistent_read_with_real_tokens(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    fill(apiserver, 25)
    rest = KubeRest(api_client)
    pages = rest.list_pages("/api/v1/pods", KPod, page_size=10)
    first, rv = await anext(pages)
    # A change between pages is not in this list: every page is the first one's snapshot.
    apiserver.put("/api/v1/namespaces/default/pods", pod("late", "n1"))
    rest_pages = [p async for p in pages]
    names = [p.metadata.name for page in [first, *(p for p, _ in rest_pages)] for p in page]
    assert names == [f"p{i:03d}" for i in range(25)]
    assert {page_rv for _, page_rv in rest_pages} == {rv}
    queries = [q for m, p, q in apiserver.requests if p == "/api/v1/pods"]
    assert [q.get("limit") for q in queries] == ["10", "10", "10"]
    assert all("resourceVersion" not in q for q in queries)
    token = json.loads(base64.urlsafe_b64decode(queries[1]["continue"]))
    assert token["v"] == "meta.k8s.io/v1" and token["rv"] == int(rv)


async def test_a_continue_token_older_than_a_compaction_is_the_real_410(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    fill(apiserver, 25)
    pages = KubeRest(api_client).list_pages("/api/v1/pods", KPod, page_size=10)
    await anext(pages)
    apiserver.put("/api/v1/namespaces/default/pods", pod("late", "n1"))
    apiserver.compact()
    try:
        await anext(pages)
        raise AssertionError("the expired token was served")
    except GoneError as exc:
        assert exc.status == 410
        assert exc.detail.reason == "Expired" and exc.detail.message == EXPIRED


async def test_resource_version_0_is_one_body_whatever_the_limit(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    """What the agent must not ask for: the watch cache ignores the limit."""
    fill(apiserver, 25)
    data = await KubeRest(api_client).request(
        "GET", "/api/v1/pods", query=[("limit", "10"), ("resourceVersion", "0")]
    )
    body = json.loads(data or b"{}")
    assert len(body["items"]) == 25 and "continue" not in body["metadata"]


async def test_a_list_that_outlives_its_token_starts_over_and_misses_nothing(
    apiserver: FakeApiServer, api_client: Any
) -> None:
    fill(apiserver, 25)
    seen_pages: list[list[str]] = []
    listed: list[tuple[set[str], bool]] = []

    async def on_page(items: list[KPod]) -> None:
        seen_pages.append([p.metadata.name for p in items])
        if len(seen_pages) == 1:  # the server compacts while the agent reads page one
            apiserver.put("/api/v1/namespaces/default/pods", pod("late", "n1"))
            apiserver.compact()

    async def on_listed(keys: set[str], complete: bool) -> None:
        listed.append((keys, complete))

    reflector = Reflector(
        KubeRest(api_client),
        "/api/v1/pods",
        KPod,
        None,
        lambda kind, obj: None,
        on_page=on_page,
        on_listed=on_listed,
        page_size=10,
    )
    await reflector.list_once()
    assert reflector.gone == 1 and reflector.lists == 1
    assert len(listed) == 1 and listed[0][1]
    assert len(listed[0][0]) == 26  # the whole list, "late" included, from the second try
    assert reflector.cache == {}  # streamed: no copy of the pods is kept


def gang(apiserver: FakeApiServer, job_id: str, count: int) -> None:
    apiserver.put("/api/v1/nodes", node("n1", gpu=8))
    for i in range(count):
        p = pod(f"{job_id}-w{i}", "n1", namespace=NS, gpu=0)
        p["metadata"]["labels"] = {LABEL_JOB: job_id, LABEL_ATTEMPT: "1"}
        p["metadata"]["annotations"] = {ANN_JOB: job_id}
        apiserver.put(PODS, p)


async def test_checkpoint_requests_fan_out_concurrently_within_the_bound(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    gang(apiserver, "big", 200)
    backend, rec = await make_backend(api_inflight=16)
    await rec.wait_for(lambda: len(backend.attempt_pods("big", 1)) == 200)
    apiserver.latency_s = 0.02  # a real API server is milliseconds away
    await backend.checkpoint_now("big", 1, NOW + 30)
    # One merged PATCH per pod, many in flight at once, never more than the agent's bound.
    assert len(apiserver.patches) == 200
    assert len({path for path, _, _ in apiserver.patches}) == 200
    assert 1 < apiserver.peak_inflight <= 16
    stored = apiserver.get(f"{PODS}/big-w199")
    assert stored is not None
    assert stored["metadata"]["annotations"][ANN_CHECKPOINT_REQUEST] == f"{NOW + 30:.3f}"


async def test_an_apf_429_holds_every_request_for_its_retry_after(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    gang(apiserver, "big", 12)
    backend, rec = await make_backend(api_inflight=8)
    await rec.wait_for(lambda: len(backend.attempt_pods("big", 1)) == 12)
    # The priority level admits 4 at once; beyond that the real APF 429, Retry-After 1 s.
    apiserver.max_inflight = 4
    apiserver.latency_s = 0.05
    t0 = time.monotonic()
    await backend.checkpoint_now("big", 1, NOW + 30)
    assert apiserver.throttled > 0 and backend.rest.throttled > 0
    # The agent waited as a whole: no wave of retries before the first Retry-After passed.
    assert time.monotonic() - t0 >= 1.0
    names = {path.rsplit("/", 1)[1] for path, _, _ in apiserver.patches}
    assert names == {f"big-w{i}" for i in range(12)}  # every pod got its request in the end
    sent = sum(1 for method, _, _ in apiserver.requests if method == "PATCH")
    assert sent <= 12 * 2  # not a retry storm: each wave waits for the Retry-After
    # The refusal is the real APF Status, and it ends a request retried too often.
    apiserver.max_inflight, apiserver.retry_after_s = 0, 0
    try:
        await backend.rest.request("GET", "/api/v1/nodes")
        raise AssertionError("a refused request succeeded")
    except KubeApiError as exc:
        assert exc.status == 429 and exc.detail.reason == "TooManyRequests"
        assert exc.retry_after == 0


async def test_deletes_of_many_objects_go_out_concurrently(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    gang(apiserver, "many", 60)
    backend, _ = await make_backend(api_inflight=8)
    apiserver.latency_s = 0.02
    refs = [(PODS, f"many-w{i}") for i in range(60)]
    await backend.objects.delete(refs)
    deleted = [path for path, _ in apiserver.deletes]
    assert sorted(deleted) == sorted(f"{PODS}/many-w{i}" for i in range(60))
    assert 1 < apiserver.peak_inflight <= 8


async def test_a_burst_of_dispatches_is_carried_out_a_few_at_a_time(
    apiserver: FakeApiServer, api_client: ApiClient
) -> None:
    """Begun all at once, every Dispatch's requests queued behind every other's at the token
    bucket and none was done until nearly all were (the broker then heard no progress and
    asked them all again). At most `api_inflight` attempts are created at once: the first is
    done, and reported, before the later ones have made anything."""
    config = make_config(api_qps=20.0, api_burst=2, api_inflight=2)
    backend = KubeBackend("c1", config, api_client=api_client, clock=lambda: NOW)
    jobs_made_when_reported: dict[str, int] = {}

    def emit(ev: AgentEvent) -> None:
        if isinstance(ev, WorkloadStatus):
            made = sum(1 for m, path, _ in apiserver.requests if (m, path) == ("POST", JOBS))
            jobs_made_when_reported.setdefault(ev.job_id, made)

    await backend.start(emit)
    try:
        apiserver.latency_s = 0.01
        await asyncio.gather(*(backend.dispatch(gang_dispatch(f"j{i}", 1, 1)) for i in range(10)))
    finally:
        await backend.stop()
    assert sorted(jobs_made_when_reported) == sorted(f"j{i}" for i in range(10))
    # When the k-th attempt is reported, the k - 1 before it are done and at most
    # `api_inflight` are being made: no Job beyond those was asked for yet.
    made = list(jobs_made_when_reported.values())  # in the order they were reported
    assert all(n <= k - 1 + config.api_inflight for k, n in enumerate(made, 1)), made
