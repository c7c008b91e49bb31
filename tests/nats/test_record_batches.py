"""A fast-ingest batch of job records (nats ADR-50) on a real three-server cluster whose
bucket's stream changes leader mid-batch: the put either returns with every record stored or
fails, and the retry the broker makes stores them all. Never a put that returns with records
missing."""

from __future__ import annotations

from typing import Any

import pytest

from broker.store import RecordMirror, StoreError
from load.natscluster import NatsCluster
from tests.broker.jobs import mirror_took, stored_record
from tests.nats.test_bucket_read import filled_store, step_down
from tests.nats.world import connect

BATCH = 3000


async def test_a_batch_across_a_stream_leader_change_returns_only_once_whole(
    nats_cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc = await connect(nats_cluster)
    try:
        store = await filled_store(nc, 10)
        assert store.fast_ingest
        records = [stored_record(i, state="running") for i in range(BATCH)]
        publish = nc.publish
        sent: list[str] = []
        moved: list[str] = []

        async def stepping_down_publish(subject: str, *args: Any, **kwargs: Any) -> None:
            if subject.startswith(store.prefix):
                sent.append(subject)
                if len(sent) == BATCH // 3:
                    moved.append(await step_down(nats_cluster, nc, store.stream))
            await publish(subject, *args, **kwargs)

        monkeypatch.setattr(nc, "publish", stepping_down_publish)
        failures = 0
        for _ in range(5):
            try:
                await store.put_many(records)
                break
            except StoreError:
                failures += 1
        else:
            pytest.fail("the records were never stored")
        monkeypatch.setattr(nc, "publish", publish)
        assert moved
        mirror = RecordMirror(store)
        got = mirror_took(mirror, await mirror.caught_up(60))
        await mirror.stop()
        want = mirror_took(mirror, records)["records"]
        assert {k: v for k, v in got["records"].items() if k in want} == want
    finally:
        await nc.close()
