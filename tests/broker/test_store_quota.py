"""Per-team storage: one team fills its share of the job bucket and is refused with a clear
reason, while another team's submissions and cancels are answered at once; cancelling frees
the first team's space (an ended job's workload is compacted out of its record)."""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.codec import decode_submit_reply, encode_json
from schemas.config import Limits, QueueConfig
from tests.broker.conftest import Harness, broker_config
from tests.support import wait_for

QUOTA = 2 * 2**20


def big_job(name: str) -> dict[str, Any]:
    """About 200 KB: a job whose environment carries a large configuration."""
    env = {f"CONFIG_{i}": "x" * 1000 for i in range(200)}
    return {
        "name": name,
        "gang": [{"name": "w", "replicas": 1, "gpu": 8}],
        "workload": {"image": "trainer:1", "env": env},
    }


async def test_one_team_fills_its_share_while_another_submits_and_cancels(
    harness: Harness,
) -> None:
    config = msgspec.structs.replace(
        broker_config(harness.prefix),
        queues=[QueueConfig(name="qa", team="alpha"), QueueConfig(name="qb", team="beta")],
        limits=Limits(
            submit_stream_max_bytes=16 * 2**20,
            jobs_bucket_max_bytes=32 * 2**20,
            team_store_max_bytes=QUOTA,
        ),
    )
    broker = await harness.start_broker(config)

    async def submit(queue: str, job: dict[str, Any]) -> Any:
        # Answered within a second, whatever the other team does.
        msg = await harness.nc.request(harness.subjects.submit(queue), encode_json(job), 1.0)
        return decode_submit_reply(msg.data)

    async def cancel(job_id: str) -> Any:
        msg = await harness.nc.request(
            harness.subjects.api("cancel"), encode_json({"job_id": job_id}), 1.0
        )
        return msgspec.json.decode(msg.data)

    alpha: list[str] = []
    refusal = None
    for i in range(40):
        reply = await submit("qa", big_job(f"a{i}"))
        if not reply.accepted:
            refusal = reply.error
            break
        alpha.append(reply.job_id)
        # The other team is served between every one of alpha's submissions.
        other = await submit("qb", {**big_job(f"b{i}"), "workload": {"image": "t:1"}})
        assert other.accepted, other.error
        assert (await cancel(other.job_id))["ok"]
    assert refusal is not None, "alpha was never refused"
    assert "storage quota: team 'alpha'" in refusal and "team_store_max_bytes" in refusal
    assert 5 <= len(alpha) <= 12  # about 2 MiB of 200 KB jobs
    assert broker.stats["store_quota_rejections"] >= 1
    # A new leader counts the bucket as it reads it back: still over.
    await harness.crash_broker()
    broker = await harness.start_broker(config)
    after_restart = await submit("qa", big_job("a-restart"))
    assert not after_restart.accepted and "storage quota: team 'alpha'" in after_restart.error
    # Beta's big jobs are its own share, untouched by alpha's.
    for i in range(3):
        reply = await submit("qb", big_job(f"bb{i}"))
        assert reply.accepted, reply.error
    # Alpha cancels: the ended jobs' workloads are compacted away, and it submits again.
    for job_id in alpha:
        assert (await cancel(job_id))["ok"]
    again = await submit("qa", big_job("a-again"))
    assert again.accepted, again.error
    assert broker.store is not None
    used, active = broker.store.usage.of({"qa"})
    assert active == 1 and used < QUOTA / 2


async def test_an_ended_job_is_deleted_from_the_bucket_after_its_retention(
    harness: Harness,
) -> None:
    config = msgspec.structs.replace(
        broker_config(harness.prefix),
        limits=Limits(
            submit_stream_max_bytes=8 * 2**20,
            jobs_bucket_max_bytes=32 * 2**20,
            ended_retention_s=1.0,
        ),
    )
    broker = await harness.start_broker(config)
    job = {"job_id": "brief-1", "name": "brief", "gang": [{"name": "w", "replicas": 1, "gpu": 8}]}
    assert (await harness.submit(job)).accepted
    assert (await harness.api("cancel", {"job_id": "brief-1"}))["ok"]
    await wait_for(lambda: broker.machine is not None and "brief-1" not in broker.machine.jobs, 10)
    assert broker.store is not None
    store = broker.store

    async def deleted() -> bool:
        return "brief-1" not in {r.job_id for r in await store.load_all()}

    await wait_for(deleted, 10, what="the expired record deleted from the bucket")
    again = await harness.submit(job)  # past the retention: a new job under the same id
    assert again.accepted and not again.duplicate
