"""Submission by subject, replies, events and bad input, over a real nats-server with raw
nats-py clients (no Muster client code)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from nats.aio.msg import Msg

from broker.core.records import record_decoder
from broker.store import JobStore
from schemas.agent import Dispatch, WorkloadStatus
from schemas.codec import decode_submit_reply, encode_json
from schemas.job import PodSet
from shell.natsio import flush
from tests.broker.conftest import Harness
from tests.broker.jobs import job
from tests.broker.wire import next_item
from tests.support import wait_for


def pytorchjob(name: str, **container: Any) -> dict[str, Any]:
    """A one-master PyTorchJob asking for 8 GPUs; `container` adds fields to its container."""
    limits = {"nvidia.com/gpu": 8}
    pod = {"containers": [{"name": "pytorch", "image": "t:1", "resources": {"limits": limits}}]}
    pod["containers"][0].update(container)
    master = {"replicas": 1, "template": {"spec": pod}}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Master": master}},
    }


def carrying(manifest: dict[str, Any]) -> dict[str, Any]:
    """A JobSpec that names no gang and carries a manifest to derive it from."""
    return {"name": "carried", "workload": {"kind": "manifest", "manifest": manifest}}


async def test_plain_json_submit_reply_and_lifecycle_events(harness: Harness) -> None:
    await harness.start_broker()
    agent = await harness.agent("c1")
    reply = await harness.submit(job("train", replicas=2, gpu=8))
    assert reply.accepted and reply.job_id
    job_id = reply.job_id
    dispatch: Dispatch = await next_item(agent.dispatches)
    assert dispatch.job_id == job_id and dispatch.attempt == 1
    assert dispatch.epoch == harness.broker.lease.epoch  # type: ignore[union-attr]
    # Whole gang, one node per replica, no node used beyond its 8 GPUs.
    (assignment,) = dispatch.assignment
    assert len(assignment.nodes) == 2 and len(set(assignment.nodes)) == 2
    await harness.wait_event(job_id, "running")
    await agent.send(WorkloadStatus(job_id=job_id, attempt=1, phase="succeeded"))
    done = await harness.wait_event(job_id, "succeeded")
    assert done.state == "succeeded" and done.cluster == "c1"
    assert harness.kinds(job_id) == ["queued", "admitted", "running", "succeeded"]
    got = await harness.api("get", {"job_id": job_id})
    assert got["ok"] and got["result"]["state"] == "succeeded"
    assert got["result"]["accounting"]["attempts"] == 1


async def test_an_idle_broker_writes_a_new_job_once_admitted_before_its_dispatch(
    harness: Harness,
) -> None:
    """A job that can run at once is written once, submitted and admitted: its first record
    in the bucket is already the admitted one (one put, not a queued one and then an admitted
    one), written before its Dispatch leaves."""
    await harness.start_broker()
    agent = await harness.agent("c1")
    written: list[str] = []

    async def on_put(msg: Msg) -> None:
        written.append(record_decoder.decode(msg.data).state)

    await harness.nc.subscribe(f"$KV.{harness.subjects.jobs_bucket}.solo", cb=on_put)
    await flush(harness.nc)
    reply = await harness.submit(job("solo", job_id="solo", gpu=8))
    assert reply.accepted and reply.job_id == "solo"
    dispatch: Dispatch = await next_item(agent.dispatches)
    assert dispatch.job_id == "solo"
    await wait_for(lambda: bool(written), 10, what="the job's record on the wire")
    assert written[0] == "admitted", written


async def test_bad_input_is_answered_and_changes_nothing(harness: Harness) -> None:
    await harness.start_broker()
    await harness.agent("c1", count=2)
    cases: list[tuple[bytes | dict[str, Any], str, str]] = [
        (b"{not json", "default", "malformed"),
        ({"name": "x", "gang": [{"name": "w", "replicas": "two"}]}, "default", "replicas"),
        (job("ok-name"), "nosuchqueue", "unknown queue"),
        ({"name": "UPPER", "gang": [{"name": "w"}]}, "default", "name"),
        ({"name": "x", "gang": [{"name": "w"}], "colour": "red"}, "default", "colour"),
        (b"{" + b'"name": "' + b"a" * 2_000_000 + b'"}', "default", "limit"),
        (job("huge", replicas=1, gpu=16), "default", "never be placed"),
        (job("many", replicas=9, gpu=8), "default", "never be placed"),
        (b"[]", "default", "object"),
        # A manifest inside a JobSpec is checked as strictly as one sent on its own.
        (carrying(pytorchjob("typo", imagePullPolicyy="Always")), "default", "imagePullPolicyy"),
        (
            carrying(pytorchjob("priv", securityContext={"privileged": True})),
            "default",
            "privileged",
        ),
        (
            carrying({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}),
            "default",
            "Secret",
        ),
    ]
    for payload, queue, needle in cases:
        reply = await harness.submit(payload, queue=queue)
        assert not reply.accepted, payload
        assert needle in (reply.error or ""), (needle, reply.error)
    listed = await harness.api("list", {})
    assert listed["ok"] and listed["result"] == []
    good = await harness.submit(job("fine"))
    assert good.accepted
    carried = await harness.submit(carrying(pytorchjob("ok")))
    assert carried.accepted, carried.error
    got = await harness.api("get", {"job_id": carried.job_id})
    gang = msgspec.convert(got["result"]["spec"]["gang"], list[PodSet])
    assert [(p.name, p.replicas, p.gpu) for p in gang] == [("master", 1, 8)]


async def test_duplicate_job_id_is_acknowledged_never_run_twice(harness: Harness) -> None:
    await harness.start_broker()
    agent = await harness.agent("c1")
    first = await harness.submit(job("dup", job_id="my-id-1"))
    second = await harness.submit(job("dup", job_id="my-id-1"))
    assert first.accepted and not first.duplicate and first.job_id == "my-id-1"
    assert second.accepted and second.duplicate and second.job_id == "my-id-1"
    await harness.wait_event("my-id-1", "running")
    listed = await harness.api("list", {})
    assert [j["job_id"] for j in listed["result"]] == ["my-id-1"]
    assert len([c for c in agent.commands if isinstance(c, Dispatch)]) == 1


async def test_jobs_published_while_broker_down_are_admitted_later(harness: Harness) -> None:
    broker = await harness.start_broker()
    await harness.stop_broker()  # the stream and consumer now exist; nobody consumes
    del broker
    for i in range(5):
        await harness.nc.publish(harness.subjects.submit("default"), _enc(job(f"offline-{i}", 1)))
    await flush(harness.nc)
    await harness.start_broker()
    await harness.agent("c1")
    await harness.wait_for(
        lambda: sum(1 for k in list(harness.events) if harness.kinds(k)[-1:] == ["running"]) == 5
    )
    listed = await harness.api("list", {"state": "running"})
    assert sorted(j["name"] for j in listed["result"]) == [f"offline-{i}" for i in range(5)]


async def test_api_errors_are_replies(harness: Harness) -> None:
    await harness.start_broker()
    assert not (await harness.api("get", {"job_id": "nope"}))["ok"]
    bad = await harness.api("frobnicate", {})
    assert not bad["ok"] and "unknown API verb" in bad["error"]
    wrong = await harness.api("get", {"jobid": "x"})
    assert not wrong["ok"] and "jobid" in wrong["error"]
    assert (await harness.api("queues"))["ok"]
    assert (await harness.api("clusters"))["ok"]


def _enc(obj: Any) -> bytes:
    from schemas.codec import encode_json

    return encode_json(obj)


async def test_queue_alias_feeds_its_queue(harness: Harness) -> None:
    import msgspec

    config = msgspec.structs.replace(harness.config, queue_aliases={"team-a": "research"})
    await harness.start_broker(config)
    reply = await harness.submit(job("aliased", replicas=1, gpu=1), queue="team-a")
    assert reply.accepted
    got = await harness.api("get", {"job_id": reply.job_id})
    assert got["result"]["queue"] == "research"


async def test_prometheus_metrics_follow_the_broker(harness: Harness) -> None:
    from prometheus_client import generate_latest

    broker = await harness.start_broker()
    await harness.agent("c1")
    reply = await harness.submit(job("metered", replicas=1, gpu=8))
    await harness.wait_event(reply.job_id, "running")
    await harness.submit(b"{bad")
    text = generate_latest(broker.metrics.registry).decode()
    assert 'muster_submissions_total{outcome="accepted"} 1.0' in text
    assert 'muster_submissions_total{outcome="rejected"} 1.0' in text
    assert 'muster_dispatches_total{outcome="acked"} 1.0' in text
    assert 'muster_jobs{state="running"} 1.0' in text
    assert 'muster_clusters{health="healthy"} 1.0' in text
    assert "muster_leader 1.0" in text
    assert "muster_pool_provisions_total 0.0" in text  # no autoscaled pool here
    assert "muster_pool_stockouts_total 0.0" in text


async def test_a_copy_of_a_known_job_is_acked_only_once_the_job_is_durable(
    harness: Harness,
) -> None:
    """A second copy of a job in the submission stream (a retry under another request id, or
    a redelivery) is acked, and so leaves the stream, only after the job's record is in the
    bucket: acked earlier, a crash would lose the job. The bucket is away for a while here."""
    broker = await harness.start_broker()
    js = harness.nc.jetstream()
    store = JobStore(js, harness.subjects.jobs_bucket)
    await js.delete_stream(f"KV_{harness.subjects.jobs_bucket}")  # writes retry until it is back
    durable_at_ack: list[bool] = []

    async def on_ack(msg: Msg) -> None:  # every ack the broker sends for a submission
        if msg.data in (b"", b"+ACK"):  # an empty body is an ack too
            try:
                ids = {r.job_id for r in await store.load_all(5)}
            except Exception:
                ids = set()
            durable_at_ack.append("copied" in ids)

    await harness.nc.subscribe(f"$JS.ACK.{harness.subjects.submit_stream}.>", cb=on_ack)
    data = encode_json(job("copied", job_id="copied"))
    subject = harness.subjects.submit("default")

    def send(msg_id: str) -> asyncio.Task[Msg]:
        headers = {"Nats-Msg-Id": msg_id}
        return asyncio.create_task(harness.nc.request(subject, data, timeout=30, headers=headers))

    replies = [send("first")]
    await wait_for(lambda: broker.stats["submitted"] >= 1, 10, what="the first copy taken in")
    replies.append(send("second"))  # another batch: nothing of its own to persist
    await wait_for(lambda: broker.stats["submitted"] >= 2, 10, what="the second copy taken in")
    for task in replies:
        assert decode_submit_reply((await task).data).accepted
    await wait_for(lambda: len(durable_at_ack) >= 2, 30, what="both copies acked")
    assert durable_at_ack == [True, True]
