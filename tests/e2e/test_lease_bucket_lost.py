"""A lease bucket lost with its server restarts its revisions at 1. The broker that takes over
must still lead at an epoch above every one agents have seen, or every agent refuses it."""

from __future__ import annotations

from schemas.agent import Cancel
from schemas.codec import decode_command_ack, encode_msgpack
from tests.world import World, flavor, sim_job


async def test_takeover_after_the_lease_bucket_was_lost_is_accepted_by_agents(
    world: World,
) -> None:
    h = world.harness
    # A few leaderships first, so the epoch agents see is well above a new bucket's first.
    for _ in range(2):
        await h.start_broker()
        await h.stop_broker()
    fleet = await world.start({"c1": [flavor("a100-od", "on-demand", nodes=2)]})
    first = h.broker
    assert first is not None
    old_epoch = first.lease.epoch
    assert old_epoch > 1
    job_id = (await h.submit(sim_job("before", steps=40, rate=20.0, every=20))).job_id
    await h.wait_event(job_id, "succeeded", timeout=30)
    runtime = fleet.runtimes["c1"]
    assert runtime.max_epoch == old_epoch

    # The lease bucket is lost (its only server came back without its store); the leader dies.
    js = h.nc.jetstream()
    await js.delete_key_value(h.subjects.leader_bucket)
    await h.crash_broker()

    second = await h.start_broker()
    assert second.lease.epoch > old_epoch
    await h.wait_for(lambda: runtime.max_epoch == second.lease.epoch, 15)
    job_id = (await h.submit(sim_job("after", steps=40, rate=20.0, every=20))).job_id
    await h.wait_event(job_id, "succeeded", timeout=30)
    assert second.stats["stale_epoch_ignored"] == 0

    # The old leader's epoch is still refused.
    stale = Cancel(job_id="before", epoch=old_epoch, reason="stale leader")
    msg = await h.nc.request(h.subjects.agent_cmd("c1"), encode_msgpack(stale), timeout=5)
    ack = decode_command_ack(msg.data)
    assert not ack.ok and ack.stale_epoch and ack.epoch == second.lease.epoch
