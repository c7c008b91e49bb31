"""The dashboard's HTTP API and SSE stream against a real broker and fake clusters."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from broker.core.effects import split_reply
from broker.core.inputs import SubmitJob
from broker.ui.live import CLIENT_QUEUE, OVERFLOW, EventHub
from broker.ui.server import Dashboard, RateLimit
from schemas.codec import decode_jobspec, encode_json
from tests.broker.conftest import Harness, broker_config
from tests.ui.conftest import Live
from tests.world import sim_job

QUEUES = ("default", "research")


async def _sse_events(resp: aiohttp.ClientResponse, until: Any, limit: int = 500) -> list[Any]:
    """Reads `data:` events from an SSE response until `until(events)` holds."""
    seen: list[Any] = []
    named = False  # the data of a named event (hello, overflow) is not a job event
    for _ in range(limit):
        line = (await asyncio.wait_for(resp.content.readline(), 15)).decode().rstrip("\n")
        if line.startswith("event: "):
            named = True
        elif not line:
            named = False
        elif line.startswith("data: ") and not named:
            seen.append(json.loads(line[6:]))
            if until(seen):
                return seen
    raise AssertionError(f"condition not met in {limit} lines: {seen}")


async def test_pages_list_filter_and_paginate_on_the_server(live: Live) -> None:
    h = live.world.harness
    ids = []
    for i in range(7):
        reply = await h.submit(sim_job(f"pg-{i}", steps=100_000), queue="research")
        assert reply.accepted, reply.error
        ids.append(reply.job_id)
    status, page = await live.get("/api/jobs?queue=research&limit=3&offset=2")
    assert status == 200 and isinstance(page, dict)
    assert page["total"] == 7 and page["offset"] == 2
    assert [j["job_id"] for j in page["jobs"]] == list(reversed(ids))[2:5]
    # Two clusters of one 8-GPU node: the first two run, the other five wait with a reason.
    await h.wait_event(ids[1], "running", timeout=15)
    machine = h.broker.machine
    assert machine is not None
    await h.wait_for(lambda: all(machine.views.first_reason(j) for j in ids[2:]))
    status, page = await live.get("/api/jobs?state=queued&name=pg-6")
    assert isinstance(page, dict) and page["total"] == 1
    row = page["jobs"][0]
    assert row["job_id"] == ids[6] and row["state"] == "queued"
    assert row["reason"] == machine.views.first_reason(ids[6])
    status, page = await live.get("/api/jobs?state=queued")
    assert isinstance(page, dict) and page["total"] == 5
    status, page = await live.get("/api/jobs?state=running&cluster=a")
    assert isinstance(page, dict) and page["total"] == 1 and page["jobs"][0]["cluster"] == "a"


async def test_fleet_queues_and_job_detail(live: Live) -> None:
    h = live.world.harness
    job_id = (await h.submit(sim_job("detail", steps=2000))).job_id
    await h.wait_event(job_id, "running", timeout=15)
    status, fleet = await live.get("/api/fleet")
    assert status == 200 and isinstance(fleet, dict)
    assert {c["name"] for c in fleet["clusters"]} == {"a", "b"}
    assert fleet["gpu_total"] == 16 and fleet["spot_share"] == 1.0
    used = sum(f["gpu_used"] for c in fleet["clusters"] for f in c["flavors"])
    assert used == 8
    assert all(f["prior_rate_per_node_hour"] > 0 for c in fleet["clusters"] for f in c["flavors"])
    assert all(c["stale_s"] == 0 for c in fleet["clusters"])
    # Cluster b's agent reports stale Kubernetes watches in its heartbeat: the page says so.
    assert live.world.fleet is not None and live.world.harness.broker.machine is not None
    live.world.fleet.clusters["b"].stale_watches(42.0)
    machine = live.world.harness.broker.machine
    await h.wait_for(lambda: any(v.stale_s == 42.0 for v in machine.views.cluster_views(0.0)))
    status, fleet = await live.get("/api/fleet")
    assert isinstance(fleet, dict)
    assert {c["name"]: c["stale_s"] for c in fleet["clusters"]} == {"a": 0.0, "b": 42.0}
    live.world.fleet.clusters["b"].stale_watches(0.0)
    await h.wait_for(lambda: all(v.stale_s == 0 for v in machine.views.cluster_views(0.0)))
    status, queues = await live.get("/api/queues")
    assert status == 200 and isinstance(queues, dict)
    default = next(q for q in queues["queues"] if q["name"] == "default")
    assert default["admitted"] == 1 and default["oldest_wait_s"] is None
    status, detail = await live.get(f"/api/jobs/{job_id}")
    assert status == 200 and isinstance(detail, dict)
    assert detail["job"]["state"] == "running" and detail["job"]["attempts"][0]["running_at"]
    assert detail["why"] is None
    status, logs = await live.get(f"/api/jobs/{job_id}/logs?tail=3")
    assert status == 200 and isinstance(logs, dict), logs
    assert logs["attempt"] == 1 and logs["cluster"] in ("a", "b")
    assert logs["lines"][0].startswith("[worker-0] ") and len(logs["lines"]) <= 3
    status, logs = await live.get(f"/api/jobs/{job_id}/logs?attempt=7")
    assert status == 200 and isinstance(logs, dict)
    assert logs["lines"] == [] and "has no attempt 7" in logs["error"]


async def test_bad_input_is_refused_with_a_clear_message(live: Live) -> None:
    cases = {
        "/api/jobs?state=sleeping": "not a job state",
        "/api/jobs?limit=0": "out of range",
        "/api/jobs?limit=abc": "whole number",
        "/api/jobs?offset=-1": "whole number",
        "/api/jobs?queue=a%20b": "not a valid name",
        "/api/jobs?colour=red": "unknown parameter 'colour'",
        "/api/jobs/bad%20id": "not a job id",
        "/api/events?job=..": "not a job id",
        "/api/interruptions?limit=100000": "out of range",
        "/api/fleet?x=1": "unknown parameter",
        "/api/jobs/x/logs?tail=0": "out of range",
        "/api/jobs/x/logs?attempt=one": "whole number",
        "/api/jobs/x/logs?follow=1": "unknown parameter",
    }
    for path, expected in cases.items():
        status, body = await live.get(path)
        assert status == 400, path
        assert isinstance(body, dict) and expected in body["error"], (path, body)
    for path in ("/api/jobs/no-such-job", "/api/jobs/no-such-job/logs"):
        status, body = await live.get(path)
        assert status == 404 and isinstance(body, dict) and "unknown job" in body["error"]
    async with live.http.post(live.url + "/api/jobs", data=b"{}") as resp:
        assert resp.status == 405
    async with live.http.get(live.url + "/api/jobs?name=" + "x" * 2000) as resp:
        assert resp.status == 414
    async with live.http.get(live.url + "/static/../service.py") as resp:
        assert resp.status == 404
    # Nothing above changed the broker: no job was created.
    status, page = await live.get("/api/jobs")
    assert isinstance(page, dict) and page["total"] == 0


async def test_rate_limit_answers_429_then_recovers() -> None:
    limit = RateLimit(rate=10.0, burst=3.0)
    assert [limit.allow("c", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limit.allow("other", 0.0)
    assert limit.allow("c", 0.1)  # one token back after 0.1 s at 10/s


async def test_rate_limited_client_gets_429(live: Live) -> None:
    live.dashboard.rate = RateLimit(rate=0.001, burst=2.0)
    codes = [(await live.get("/api/fleet"))[0] for _ in range(3)]
    assert codes == [200, 200, 429]


async def test_sse_streams_a_jobs_life_including_a_spot_move(live: Live) -> None:
    h, fleet = live.world.harness, live.world.fleet
    assert fleet is not None
    async with live.http.get(live.url + "/api/events") as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        # Headers arrive after the client joined the hub: no event from here on is missed.
        job_id = (await h.submit(sim_job("live", steps=4000, every=20, capacity="spot"))).job_id
        events = await _sse_events(
            resp, lambda s: any(e["job_id"] == job_id and e["kind"] == "running" for e in s)
        )
        assert next(e["kind"] for e in events if e["job_id"] == job_id) == "queued"
        running = next(e for e in events if e["kind"] == "running")
        assert live.reclaim(job_id).cluster == running["cluster"]
        events = await _sse_events(
            resp,
            lambda s: any(e["kind"] == "admitted" and e["attempt"] == 2 for e in s),
        )
        moved = next(e for e in events if e["kind"] == "admitted")
        assert moved["cluster"] != running["cluster"]
    status, body = await live.get("/api/interruptions")
    assert status == 200 and isinstance(body, dict)
    item = body["items"][0]
    assert item["job_id"] == job_id and item["cause"] == "spot-notice"
    assert item["new_cluster"] == moved["cluster"] and item["latency_s"] >= 0


async def test_a_client_that_does_not_read_is_skipped_ahead(live: Live) -> None:
    """Events published faster than a client reads: its queue stays bounded, it is told to
    reload, and the broker still answers at once."""
    h = live.world.harness
    hub: EventHub = live.dashboard.hub
    stuck = hub.join()
    assert stuck is not None
    try:
        for i in range(CLIENT_QUEUE * 3):
            await h.nc.publish(
                h.subjects.job_events(f"flood-{i}"),
                encode_json(
                    {"job_id": f"flood-{i}", "kind": "queued", "at": 0.0, "state": "queued"}
                ),
            )
        await h.nc.flush()
        await h.wait_for(lambda: hub.events_seen >= CLIENT_QUEUE * 3)
        assert stuck.skipped >= 1
        assert stuck.queue.qsize() <= CLIENT_QUEUE
        items = [stuck.queue.get_nowait() for _ in range(stuck.queue.qsize())]
        assert OVERFLOW in items
        status, _ = await live.get("/api/queues")
        assert status == 200
    finally:
        hub.leave(stuck)


async def test_clients_beyond_the_limit_are_refused(live: Live) -> None:
    hub = live.dashboard.hub
    extra = [hub.join() for _ in range(hub.max_clients - len(hub.clients))]
    try:
        async with live.http.get(live.url + "/api/events") as resp:
            assert resp.status == 503
            assert "too many live clients" in (await resp.json())["error"]
    finally:
        for c in extra:
            if c is not None:
                hub.leave(c)


async def test_pages_of_100k_queued_jobs_page_filter_and_count_them(harness: Harness) -> None:
    """No cluster, so every job stays queued. The jobs are put straight into the leader's
    machine (the wire path, and how long each page takes, is what load/bench_ui.py
    measures); every page pages, filters and counts all of them."""
    # Loading 100,000 jobs holds the loop for seconds: a lease that outlasts it.
    broker = await harness.start_broker(broker_config(harness.prefix, lease_ttl_s=60.0))
    machine = broker.machine
    assert machine is not None
    dashboard = Dashboard(broker)
    await dashboard.start()
    spec = decode_jobspec(encode_json(sim_job("bulk", gpu=8, replicas=2)))
    for i in range(100_000):
        reply, _ = split_reply(
            machine.handle(SubmitJob(spec, order=10_000_000 + i, subject_queue=QUEUES[i % 2]), 0.0)
        )
        assert reply.accepted
        if i % 5000 == 0:
            await asyncio.sleep(0)
    assert broker.machine is machine
    broker.wake()
    # The admission cycle over the new jobs runs first; the pages are timed after it.
    await harness.wait_for(lambda: not machine.wants_cycle, timeout=60)
    # and what it produced has left the effects pipeline (a marker queued behind it).
    await asyncio.wait_for(broker.drained(), 60)
    pages: dict[str, Any] = {}
    for path in (
        "/api/jobs?limit=50",
        "/api/jobs?queue=research&state=queued&offset=40000&limit=200",
        "/api/jobs?name=bulk&offset=99950",
        "/api/queues",
    ):
        async with aiohttp.ClientSession() as http, http.get(dashboard.url + path) as resp:
            assert resp.status == 200, await resp.text()
            pages[path] = await resp.json()
    await dashboard.stop()
    first = pages["/api/jobs?limit=50"]
    assert first["total"] == 100_000 and len(first["jobs"]) == 50
    research = pages["/api/jobs?queue=research&state=queued&offset=40000&limit=200"]
    assert research["total"] == 50_000 and len(research["jobs"]) == 200
    assert {j["queue"] for j in research["jobs"]} == {"research"}
    assert {j["state"] for j in research["jobs"]} == {"queued"}
    tail = pages["/api/jobs?name=bulk&offset=99950"]
    assert tail["total"] == 100_000 and 0 < len(tail["jobs"]) <= 50
    pending = {q["name"]: q.get("pending", 0) for q in pages["/api/queues"]["queues"]}
    assert {q: pending.get(q) for q in QUEUES} == dict.fromkeys(QUEUES, 50_000)


async def test_stopping_the_dashboard_ends_its_open_event_streams(live: Live) -> None:
    """A browser tab left open does not hold the dashboard's shutdown: its stream ends."""
    async with live.http.get(live.dashboard.url + "/api/events") as resp:
        assert resp.status == 200
        assert (await resp.content.readuntil(b"\n\n")).startswith(b"event: hello")
        stopping = asyncio.create_task(live.dashboard.stop())
        # the stream's end, far sooner than a server's shutdown timeout (60 s in aiohttp)
        rest = await asyncio.wait_for(resp.content.read(), 20)
        assert b"data:" not in rest
        await asyncio.wait_for(stopping, 20)
