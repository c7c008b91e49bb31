"""Watches and credentials against the stand-in API server's faults: resume from the last
resourceVersion (re-list only on 410), resync from the local cache, field selectors, stale
state, 429 Retry-After, token refresh (exec plugin; OIDC in test_oidc.py), an unreachable API
server, bad input."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.kube.backend import KubeBackend
from agents.kube.watches import UNFINISHED_PODS
from schemas.agent import NodeUpsert, WorkloadStatus
from tests.kube.conftest import (
    NODES,
    NS,
    Recorder,
    gang_dispatch,
    make_config,
    node,
    run_job_pod,
)
from tests.kube.exec_auth import expiry, write_kubeconfig
from tests.kube.fake_apiserver import FakeApiServer
from tests.support import ResettingPort, wait_for


def names(rec: Recorder) -> set[str]:
    return {e.node.name for e in rec.of(NodeUpsert)}


async def test_resets_and_5xx_resume_from_the_last_version_without_relisting(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n0"))
    backend, rec = await make_backend()
    nr = backend.node_reflector
    assert nr is not None
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    for i, fault in enumerate(("reset", 500, 504, "reset")):
        if fault == "reset":
            apiserver.reset_watches("nodes")
        else:
            apiserver.fail_next("GET", "/api/v1/nodes", int(fault))
            apiserver.close_watches("nodes")
        apiserver.put(NODES, node(f"n{i + 1}"))  # made while the watch was down
        await rec.wait_for(lambda i=i: f"n{i + 1}" in names(rec))
        await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    assert nr.lists == 1 and nr.gone == 0  # never re-listed: every event came by the watch
    assert nr.resumes >= 4 and nr.errors >= 4
    watches = [q for m, p, q in apiserver.requests if p == NODES and q.get("watch") == "true"]
    assert all(q.get("resourceVersion") for q in watches)


async def test_429_waits_its_retry_after(apiserver: FakeApiServer, make_backend: Any) -> None:
    backend, rec = await make_backend()
    nr = backend.node_reflector
    assert nr is not None
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    apiserver.fail_next("GET", "/api/v1/nodes", 429, retry_after=0.5)
    apiserver.close_watches("nodes")
    t0 = time.monotonic()
    await rec.wait_for(lambda: nr.errors == 1)
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    assert time.monotonic() - t0 >= 0.45  # not the 0.05 s backoff of the test config
    # A 429 on a request (not a watch) is retried after its Retry-After too.
    apiserver.fail_next("POST", f"/api/v1/namespaces/{NS}/services", 429, retry_after=0.1)
    assert await backend.rest.create(
        f"/api/v1/namespaces/{NS}/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s"},
            "spec": {"ports": [{"port": 80}]},
        },
    )
    assert backend.rest.throttled == 1


async def test_lists_and_watches_ask_for_less(apiserver: FakeApiServer, make_backend: Any) -> None:
    backend, rec = await make_backend(resync_period_s=1)
    pr, nr = backend.pod_reflector, backend.node_reflector
    assert pr is not None and nr is not None
    reqs = apiserver.requests
    every = [q for m, p, q in reqs if p == "/api/v1/pods"]
    assert every and all(q.get("fieldSelector") == UNFINISHED_PODS for q in every)
    own = [q for m, p, q in reqs if p == f"/api/v1/namespaces/{NS}/pods"]
    assert own and all("muster.dev/job-id" in q.get("labelSelector", "") for q in own)
    first = [q for m, p, q in reqs if p in (NODES, "/api/v1/pods") and "watch" not in q]
    # Paginated consistent reads: never resourceVersion=0, which the watch cache answers
    # with the whole collection in one body whatever the limit.
    assert first and all("resourceVersion" not in q and q.get("limit") for q in first)
    # The periodic resync replays the local cache: no list request.
    lists_before = sum(1 for m, p, q in reqs if p == NODES and "watch" not in q)
    await rec.wait_for(lambda: nr.resyncs >= 1 and pr.resyncs >= 1, timeout=5)
    assert sum(1 for m, p, q in reqs if p == NODES and "watch" not in q) == lists_before


async def test_failing_watches_make_the_heartbeat_stale_until_they_recover(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    backend, rec = await make_backend(stale_after_s=0.3)
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    assert backend.stale_s() == 0.0
    for _ in range(200):
        apiserver.fail_next("GET", "/api/v1/nodes", 503)
    apiserver.close_watches("nodes")
    await rec.wait_for(lambda: backend.stale_s() > 0.3)
    apiserver.clear_failures()
    await rec.wait_for(lambda: backend.stale_s() == 0.0)


async def test_expired_token_is_refreshed_with_no_lost_watch_events(
    apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig, token_file = write_kubeconfig(tmp_path, apiserver.url)
    token_file.write_text(f"t1 {expiry(3600)}")
    apiserver.tokens = {"t1"}
    apiserver.put(NODES, node("n0"))
    backend = KubeBackend("c1", make_config(kubeconfig=str(kubeconfig)))
    rec = Recorder()
    await backend.start(rec)
    try:
        nr = backend.node_reflector
        assert nr is not None and backend.refresher is not None
        await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
        # The token expires mid-run (the plugin now hands out t2); the open watch drops.
        token_file.write_text(f"t2 {expiry(3600)}")
        apiserver.tokens = {"t2"}
        apiserver.reset_watches("nodes")
        apiserver.put(NODES, node("n1"))  # while the agent holds an expired token
        # (the exec plugin is a new process: slow on a loaded machine, hence the long bound)
        await rec.wait_for(lambda: "n1" in names(rec), timeout=30)
        assert apiserver.unauthorized >= 1 and backend.rest.refreshes >= 1
        assert nr.lists == 1  # resumed from its resourceVersion: nothing re-listed, none lost
        apiserver.put(NODES, node("n2"))
        await rec.wait_for(lambda: "n2" in names(rec), timeout=30)
        # A token close to its expiry is renewed before a request, without any 401: t3
        # expires within the 5-minute skew, so the next request first fetches t4.
        token_file.write_text(f"t3 {expiry(60)}")
        apiserver.tokens = {"t2", "t3"}
        assert await backend.refresher.force()
        token_file.write_text(f"t4 {expiry(3600)}")
        apiserver.tokens = {"t4"}
        refused = apiserver.unauthorized
        await backend.rest.request("GET", NODES)
        assert apiserver.unauthorized == refused
    finally:
        await backend.stop()


async def test_unreachable_api_server_waits_with_one_clear_line(tmp_path: Path) -> None:
    gone = ResettingPort()  # no API server there: every connection is reset
    port = gone.port
    api = ApiClient(configuration=Configuration(host=f"http://127.0.0.1:{port}"))
    backend = KubeBackend("c1", make_config(), api_client=api)
    with structlog.testing.capture_logs() as logs:
        starting = asyncio.create_task(backend.start(Recorder()))
        await Recorder().wait_for(
            lambda: sum(1 for e in logs if "unreachable" in e["event"]) >= 1, timeout=5
        )
        # Several retries (backoff 0.05..0.2 s) after the one that was reported.
        await wait_for(lambda: gone.attempts >= 5, what="four retries")
        gone.close()
        assert not starting.done()
        back = FakeApiServer(port=port)
        await back.start()
        try:
            back.put(NODES, node("n1"))
            await asyncio.wait_for(starting, 10)
            assert [n.name for n in (await backend.snapshot()).nodes] == ["n1"]
        finally:
            await backend.stop()
            await api.close()
            await back.close()
    lines = [e for e in logs if "unreachable" in e["event"]]
    assert len(lines) == 1 and lines[0]["url"] == f"http://127.0.0.1:{port}"
    assert not any(e.get("exc_info") for e in logs)


async def test_bad_input_is_counted_logged_once_and_ends_nothing(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend()
    await rec.wait_for(lambda: apiserver.watch_count("nodes") == 1)
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            apiserver.send_raw(b"this is not json\n", "nodes")
        apiserver.send_raw(b'{"type":"ADDED","object":{"metadata":{"name":7}}}\n', "nodes")
        apiserver.send_raw(
            json.dumps({"type": "ADDED", "object": {"metadata": {}}}).encode() + b"\n", "nodes"
        )
        apiserver.put(NODES, node("n2"))
        await rec.wait_for(lambda: "n2" in names(rec), timeout=30)
    counts = backend.bad_input.counts
    assert counts[("nodes", "undecodable watch line")] == 6
    assert counts[("Node", "no name")] == 1
    assert sum(1 for e in logs if e.get("reason") == "undecodable watch line") == 1
    assert any(k.startswith("bad_input{kind=nodes") for k in backend.counters)
    assert {n.name for n in (await backend.snapshot()).nodes} == {"n1", "n2"}


async def test_a_malformed_pod_in_a_relist_ends_no_attempt(
    apiserver: FakeApiServer, make_backend: Any
) -> None:
    apiserver.put(NODES, node("n1"))
    backend, rec = await make_backend()
    await backend.dispatch(gang_dispatch(replicas=1))
    good = run_job_pod(apiserver, "job-1-a1-worker", "n1")
    await rec.wait_for(lambda: any(s.phase == "running" for s in rec.of(WorkloadStatus)))
    bad = copy.deepcopy(good)
    bad["status"]["containerStatuses"] = "garbage"  # an object that does not decode
    apiserver.put(f"/api/v1/namespaces/{NS}/pods", bad, silent=True)
    apiserver.expire_watches()  # 410: every watch re-lists and meets the bad object
    mr = backend.muster_pod_reflector
    assert mr is not None
    await rec.wait_for(lambda: mr.lists >= 2)
    assert backend.bad_input.counts[("muster-pods", "undecodable list item")] == 1
    assert [s.phase for s in rec.of(WorkloadStatus)] == ["created", "running"]
    assert [(w.phase, w.attempt) for w in (await backend.snapshot()).workloads] == [("running", 1)]
