"""The job bucket's backup and restore, drilled: back up a live bucket, stop the broker, wipe
the bucket, restore it, start the broker: every job is back in the state it had, the running
ones go on running (not dispatched again), the queued ones run, and each runs once."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client

from broker.backup import BackupError, backup, read_backup, restore
from tests.support import wait_for
from tests.world import World, flavor, sim_job


async def test_back_up_wipe_restore_and_the_broker_resumes_every_job(
    world: World, tmp_path: Path
) -> None:
    h = world.harness
    fleet = await world.start({"a": [flavor("od", "on-demand", nodes=2)]})
    ids = []
    for i in range(5):  # two run at once (one 8-GPU node each), three wait
        reply = await h.submit(sim_job(f"b{i}", steps=200, rate=20.0, every=20))
        assert reply.accepted, reply.error
        ids.append(reply.job_id)

    async def two_running() -> dict[str, str] | None:
        states = {j: (await world.job(j))["state"] for j in ids}
        return states if list(states.values()).count("running") == 2 else None

    before = await wait_for(two_running, 20, what="two jobs running")
    cancelled = next(j for j, s in before.items() if s == "queued")
    assert (await h.api("cancel", {"job_id": cancelled}))["ok"]
    before[cancelled] = "cancelled"

    path = tmp_path / "jobs.backup"
    taken = await backup(h.nc, h.config, path)
    assert taken.records == len(ids)
    await h.stop_broker()
    js = h.nc.jetstream()
    await js.delete_key_value(h.subjects.jobs_bucket)  # the lost bucket
    restored = await restore(h.nc, h.config, path)
    assert restored.records == len(ids)

    broker = await h.start_broker()
    assert broker.restored_jobs == len(ids)
    after = {j: (await world.job(j))["state"] for j in ids}
    assert after == before  # read right after the restore, before anything moved on

    async def all_done() -> bool:
        states = [(await world.job(j))["state"] for j in ids]
        return states.count("succeeded") == len(ids) - 1 and "cancelled" in states

    await wait_for(all_done, 60, what="every job but the cancelled one succeeded")
    runs = {j: len(c.history.get(j, [])) for c in fleet.clusters.values() for j in ids}
    assert runs == {j: (0 if j == cancelled else 1) for j in ids}, runs


async def test_restore_refuses_a_bucket_that_holds_records_and_a_foreign_backup(
    world: World, nc: Client, tmp_path: Path
) -> None:
    h = world.harness
    await world.start({"a": [flavor("od", "on-demand", nodes=1)]})
    reply = await h.submit(sim_job("r0", steps=20))
    assert reply.accepted
    path = tmp_path / "jobs.backup"
    await backup(nc, h.config, path)
    with pytest.raises(BackupError, match="is not empty"):
        await restore(nc, h.config, path)
    assert (await restore(nc, h.config, path, replace=True)).records == 1
    other = h.config.__class__(subject_prefix="elsewhere")
    with pytest.raises(BackupError, match="restore it with that broker config"):
        read_backup(path, other)
    path.write_text(path.read_text().splitlines()[0] + "\n")
    with pytest.raises(BackupError, match="truncated"):
        read_backup(path, h.config)
