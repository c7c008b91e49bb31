"""Regression tests for faults that once took the broker down, lost an outcome or ran a job
twice: poison submissions, unbounded agent numbers, dispatches persisted but never
acknowledged, agents that keep claiming a newer epoch, bare heartbeats, replayed snapshots."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec

from schemas.agent import (
    Applied,
    CommandAck,
    Dispatch,
    EventBatch,
    Heartbeat,
    NodeInfo,
)
from schemas.codec import decode_command, decode_submit_reply, encode_json, encode_msgpack
from schemas.config import SchedulingConfig
from tests.broker.conftest import OD_A100, Harness
from tests.broker.jobs import job
from tests.broker.wire import next_item
from tests.support import wait_for

POISON_COUNT = "²"  # str.isdigit() says yes, int() says no
HUGE_COUNT = "9" * 5000  # over Python's int-from-string digit limit


def _container(gpu: Any = 1) -> dict[str, Any]:
    return {
        "name": "main",
        "image": "busybox",
        "resources": {"limits": {"nvidia.com/gpu": gpu}},
    }


def _template(gpu: Any = 1) -> dict[str, Any]:
    return {"spec": {"containers": [_container(gpu)]}}


def _kubeflow(kind: str, key: str, count: Any = 1, gpu: Any = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": kind,
        "metadata": {"name": "poison"},
        "spec": {key: {"Worker": {"replicas": count, "template": _template(gpu)}}},
    }


def _manifests(count: Any = 1, gpu: Any = 1) -> list[dict[str, Any]]:
    """One manifest of every supported kind, with `count` in its replica count field(s) and
    `gpu` as its GPU limit."""
    return [
        _kubeflow("PyTorchJob", "pytorchReplicaSpecs", count, gpu),
        _kubeflow("MPIJob", "mpiReplicaSpecs", count, gpu),
        _kubeflow("TFJob", "tfReplicaSpecs", count, gpu),
        _kubeflow("XGBoostJob", "xgbReplicaSpecs", count, gpu),
        _kubeflow("PaddleJob", "paddleReplicaSpecs", count, gpu),
        _kubeflow("MXJob", "mxReplicaSpecs", count, gpu),
        {
            "apiVersion": "batch.volcano.sh/v1alpha1",
            "kind": "Job",
            "metadata": {"name": "poison"},
            "spec": {
                "minAvailable": count,
                "tasks": [{"replicas": count, "template": _template(gpu)}],
            },
        },
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "poison"},
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "w",
                        "replicas": count,
                        "template": {"spec": {"parallelism": count, "template": _template(gpu)}},
                    }
                ]
            },
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "poison"},
            "spec": {"parallelism": count, "completions": count, "template": _template(gpu)},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "poison"},
            "spec": {"containers": [_container(gpu)]},
        },
    ]


def _poison_submissions() -> list[bytes]:
    # A Pod has no count field: it takes only the GPU variants.
    out = [json.dumps(m).encode() for m in _manifests(count=POISON_COUNT) if m["kind"] != "Pod"]
    out += [json.dumps(m).encode() for m in _manifests(count=HUGE_COUNT) if m["kind"] != "Pod"]
    out += [json.dumps(m).encode() for m in _manifests(gpu=[8])]
    out += [json.dumps(m).encode() for m in _manifests(gpu={"n": 8})]
    return out


async def test_poison_manifests_are_rejected_and_the_broker_keeps_serving(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    await harness.agent("c1")
    for data in _poison_submissions():
        reply = await harness.submit(data)
        assert not reply.accepted and reply.error, data[:120]
        # the manifest parser refuses each with its own reason, never Python exception text
        assert reply.error.startswith("invalid manifest: "), reply.error
        assert "Error" not in reply.error and "int()" not in reply.error, reply.error
        assert broker.leading.is_set()
    assert broker.refused["submit"] == 0
    # Nothing of them is left in the stream (each was answered and acked), and good work
    # is still admitted.
    reply = await harness.submit(job("after", replicas=1, gpu=1))
    assert reply.accepted
    await harness.wait_event(reply.job_id, "running")
    assert harness.broker is broker and broker.leading.is_set()
    js = harness.nc.jetstream()
    await harness.wait_for(lambda: broker.stats["submitted"] >= 1)
    info = await js.stream_info(harness.subjects.submit_stream)
    assert info.state.messages == 0


def _snapshot_batch(cluster: str, gpu: int, seq: int = 1, instance: str = "a") -> bytes:
    """Encoded by hand: the schema would refuse to build these values."""
    raw = {
        "cluster": cluster,
        "instance": instance,
        "seq": seq,
        "events": [
            {
                "type": "snapshot",
                "flavors": [{"name": "f", "capacity_type": "on-demand", "gpu_type": "A100"}],
                "nodes": [{"name": "n0", "flavor": "f", "gpu": gpu}],
            }
        ],
    }
    return msgspec.msgpack.encode(raw)


async def test_agent_claiming_absurd_gpu_counts_is_refused(harness: Harness) -> None:
    broker = await harness.start_broker()
    for i, gpu in enumerate((50_000_000, 2**63, 2**64 - 1)):
        cluster = f"huge{i}"
        await harness.nc.publish(
            harness.subjects.agent_events(cluster), _snapshot_batch(cluster, gpu)
        )
    await harness.wait_for(lambda: broker.refused["agent_batch"] >= 3)
    machine = broker.machine
    assert machine is not None
    assert not any(c.startswith("huge") for c in machine.agents)
    assert not any(c.startswith("huge") for c in machine.scheduler.known_clusters())
    # A sane agent on the same broker is served as usual.
    await harness.agent("c1")
    reply = await harness.submit(job("ok", replicas=1, gpu=1))
    await harness.wait_event(reply.job_id, "running")


async def test_bare_heartbeat_under_a_made_up_name_creates_no_cluster(harness: Harness) -> None:
    broker = await harness.start_broker()
    for i in range(50):
        batch = EventBatch(cluster=f"ghost{i}", instance="x", seq=1, events=[Heartbeat(at=1.0)])
        await harness.nc.publish(harness.subjects.agent_events(f"ghost{i}"), encode_msgpack(batch))
    await harness.agent("c1")  # ordered after the ghosts on the same connection
    clusters = await harness.api("clusters")
    assert [c["name"] for c in clusters["result"]] == ["c1"]
    assert broker.machine is not None and list(broker.machine.agents) == ["c1"]


async def test_replayed_old_snapshot_is_ignored(harness: Harness) -> None:
    broker = await harness.start_broker()
    agent = await harness.agent("c1", count=2)
    first = encode_msgpack(
        EventBatch(
            cluster="c1", instance=agent.instance, seq=1, events=[agent.snapshot()], sent_at=1.0
        )
    )
    # The cluster grows: a newer snapshot with more nodes.
    agent.nodes = agent.nodes + [
        NodeInfo(name=f"c1-extra-{i}", flavor=OD_A100.name, gpu=8, cpu_milli=96_000, memory=2**38)
        for i in range(4)
    ]
    await agent.send(agent.snapshot())
    machine = broker.machine
    assert machine is not None
    await harness.wait_for(lambda: machine.agents["c1"].seq == agent.seq)
    before = broker.stats["bad_batches"]
    await harness.nc.publish(harness.subjects.agent_events("c1"), first)  # the replay
    await harness.wait_for(lambda: broker.stats["bad_batches"] > before)
    views = await harness.api("clusters")
    (c1,) = views["result"]
    assert sum(f["nodes"] for f in c1["flavors"]) == 6


async def test_persisted_unacknowledged_dispatch_is_resent_after_restart(
    harness: Harness,
) -> None:
    """The leader persisted a dispatch and died before any ack: the next leader sends it
    again at once (same attempt) instead of waiting out the start timeout."""
    config = copy.deepcopy(harness.config)
    config.timeouts.start_s = 120.0
    await harness.start_broker(config)
    agent = await harness.agent("c1")
    agent.ack = False
    reply = await harness.submit(job("stranded", replicas=1, gpu=1))
    first: Dispatch = await next_item(agent.dispatches)
    await harness.crash_broker()
    agent.ack = True
    broker = await harness.start_broker(config)
    again: Dispatch = await next_item(agent.dispatches, 10)
    assert (again.job_id, again.attempt) == (first.job_id, first.attempt) == (reply.job_id, 1)
    assert again.epoch == broker.lease.epoch > first.epoch
    await harness.wait_event(reply.job_id, "running", timeout=10)
    assert broker.stats["redispatched"] == 1
    # Acknowledged now, and the acknowledgement is persisted: another restart sends nothing.
    await harness.wait_for(
        lambda: (
            broker.machine is not None
            and broker.machine.jobs[reply.job_id].attempts[-1].acked_at is not None
        )
    )
    store = broker.store
    assert store is not None

    async def ack_persisted() -> bool:  # what a restarted broker would read back
        records = {r.job_id: r for r in await store.load_all(10)}
        return records[reply.job_id].attempts[-1].acked_at is not None

    await wait_for(ack_persisted, 10, what="the acknowledged attempt in the store")
    await harness.crash_broker()
    broker = await harness.start_broker(config)
    assert broker.stats["redispatched"] == 0


async def test_stale_epoch_storm_leaves_the_broker_leading(harness: Harness) -> None:
    """An agent answering every command with stale_epoch (and a huge epoch) for seconds:
    the lease says the broker still leads, so it keeps leading, and no consumers pile up.
    Dispatch breakers off: they would stop sending to that cluster after three refusals."""
    no_breakers = SchedulingConfig(breaker_failures=0)
    broker = await harness.start_broker(
        msgspec.structs.replace(harness.config, scheduling=no_breakers)
    )
    epoch = broker.lease.epoch
    agent = await harness.agent("c1")
    await agent.stop_answering()  # the test answers below
    answered = 0

    async def liar(msg: Any) -> None:
        nonlocal answered
        decode_command(msg.data)
        answered += 1
        ack = CommandAck(ok=False, stale_epoch=True, epoch=2**60, error="stale epoch")
        await msg.respond(encode_msgpack(ack))

    await harness.nc.subscribe(harness.subjects.agent_cmd("c1"), cb=liar)
    for i in range(30):
        await harness.submit(job(f"s{i}", replicas=1, gpu=1))
    await harness.wait_for(lambda: answered >= 60, 20)
    assert broker.leading.is_set() and harness.broker is broker
    assert broker.lease.epoch == epoch
    assert broker.stats["stale_epoch_ignored"] >= 30
    js = harness.nc.jetstream()
    for stream in (harness.subjects.submit_stream, f"KV_{harness.subjects.jobs_bucket}"):
        info = await js.stream_info(stream)
        assert info.state.consumer_count <= 2, (stream, info.state.consumer_count)
    stats = await harness.api("stats")
    assert stats["epoch"] == epoch


async def test_stale_epoch_confirmed_by_the_lease_steps_down(harness: Harness) -> None:
    """The same answer is believed once the lease shows another holder."""
    broker = await harness.start_broker()
    agent = await harness.agent("c1")
    await agent.stop_answering()  # the test answers below
    js = harness.nc.jetstream()
    kv = await js.key_value(harness.subjects.leader_bucket)
    await kv.put(
        "leader", json.dumps({"holder": "usurper", "acquired_at": 1.0, "epoch": 0}).encode()
    )

    async def newer(msg: Any) -> None:
        ack = CommandAck(ok=False, stale_epoch=True, epoch=2**40, error="stale epoch")
        await msg.respond(encode_msgpack(ack))

    await harness.nc.subscribe(harness.subjects.agent_cmd("c1"), cb=newer)
    await harness.submit(job("x", replicas=1, gpu=1))
    await harness.wait_for(lambda: not broker.leading.is_set(), 10)


async def test_outcome_published_while_the_broker_is_away_is_kept_until_acknowledged(
    harness: Harness,
) -> None:
    """Wire-level check of the acknowledgement the agent outbox relies on: a batch carrying an
    ending is answered with Applied(seq) once its record is persisted."""
    broker = await harness.start_broker()
    agent = await harness.agent("c1")
    reply = await harness.submit(job("t", replicas=1, gpu=1))
    await harness.wait_event(reply.job_id, "running")
    await agent.finish(reply.job_id, 1)
    await harness.wait_event(reply.job_id, "succeeded")
    await harness.wait_for(
        lambda: any(isinstance(c, Applied) and c.seq == agent.seq for c in agent.commands)
    )
    assert broker.leading.is_set()


async def test_cpu_only_gang_that_fits_no_pool_is_rejected(harness: Harness) -> None:
    await harness.start_broker()
    await harness.agent("c1", count=4)  # 4 nodes of 96 cores
    gang = {"name": "cpu-flood", "gang": [{"name": "w", "replicas": 4096, "gpu": 0, "cpu": "1"}]}
    reply = await harness.submit(gang)
    assert not reply.accepted and reply.error and "can never be placed" in reply.error
    fits = {"name": "cpu-ok", "gang": [{"name": "w", "replicas": 8, "gpu": 0, "cpu": "1"}]}
    assert (await harness.submit(fits)).accepted


async def test_full_queue_refuses_submissions_and_other_queues_still_accept(
    harness: Harness,
) -> None:
    config = copy.deepcopy(harness.config)
    config.limits.max_pending_per_queue = 5
    broker = await harness.start_broker(config)  # no cluster: everything stays queued
    for i in range(5):
        assert (await harness.submit(job(f"q{i}"))).accepted
    reply = await harness.submit(job("q5"))
    assert not reply.accepted and reply.error and "is full" in reply.error
    assert "max_pending_per_queue" in reply.error
    assert (await harness.submit(job("r0"), queue="research")).accepted
    assert broker.machine is not None and broker.machine.views.pending_count() == 6


async def test_submitter_over_its_rate_is_refused_with_the_reason(harness: Harness) -> None:
    config = copy.deepcopy(harness.config)
    config.limits.submit_rate_per_s = 0.001  # effectively: the burst, then nothing
    config.limits.submit_burst = 3
    broker = await harness.start_broker(config)
    replies = [await harness.submit(job(f"b{i}", labels={"user": "alice"})) for i in range(5)]
    assert [r.accepted for r in replies] == [True, True, True, False, False]
    assert replies[3].error and replies[3].error.startswith("rate limited")
    assert (await harness.submit(job("c0", labels={"user": "bob"}))).accepted
    assert broker.stats["rate_limited"] == 2


async def test_server_derived_ids_are_unguessable_and_a_retry_with_msg_id_is_the_same_job(
    harness: Harness,
) -> None:
    broker = await harness.start_broker()
    a = await harness.submit(job("train"))
    b = await harness.submit(job("train"))
    assert a.accepted and b.accepted and a.job_id != b.job_id
    # Not the stream sequence: another client cannot compute the next id and take it first.
    for reply in (a, b):
        assert reply.job_id is not None
        suffix = reply.job_id.rsplit("-", 1)[1]
        assert len(suffix) == 12 and int(suffix, 16) > 10**6  # not a small counter
    headers = {"Nats-Msg-Id": "7f9c2b8e-retry-me"}
    data = encode_json(job("train"))
    first = decode_submit_reply(
        (
            await harness.nc.request(harness.subjects.submit("default"), data, 10, headers=headers)
        ).data
    )
    # The stream drops the duplicate (same Nats-Msg-Id); the broker still answers it.
    again = decode_submit_reply(
        (
            await harness.nc.request(harness.subjects.submit("default"), data, 10, headers=headers)
        ).data
    )
    assert first.accepted and again.accepted and again.duplicate
    assert again.job_id == first.job_id
    assert broker.machine is not None and len(broker.machine.jobs) == 3
