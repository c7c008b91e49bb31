"""A real broker behind the generated authorization: each team acts through its own NATS
user, and whatever it tries against another team's queue or job is refused with nothing
changed; an admin can do all of it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from broker.client import MusterError
from broker.service import Broker
from schemas.job import JobSpec, PodSet
from shell.natsio import flush
from tests.security.conftest import AuthNats, client_as, overhear
from tests.support import wait_for

SPEC = JobSpec(name="train", gang=[PodSet(name="worker", replicas=1, gpu=1)])


async def test_teams_touch_only_their_own_jobs(auth_nats: AuthNats, broker: Broker) -> None:
    alpha = await client_as(auth_nats, "team-alpha", "alpha")
    beta = await client_as(auth_nats, "team-beta", "beta")
    admin = await client_as(auth_nats, "admin")
    try:
        spec = SPEC
        mine = (await alpha.submit(spec, queue="vision")).job_id
        theirs = (await beta.submit(spec, queue="speech")).job_id
        # Another team's queue: NATS refuses the publish, so nothing is ever queued.
        with pytest.raises(MusterError):
            await beta.submit(spec, queue="vision", timeout=1)
        with pytest.raises(MusterError):
            await alpha.submit(spec, queue="ops", timeout=1)
        # Another team's job: unknown to it, for every verb; nothing changes.
        for call in (beta.cancel, beta.get, beta.why):
            with pytest.raises(MusterError, match="unknown job"):
                await call(mine)
        with pytest.raises(MusterError, match="not team 'beta'"):
            await beta.list(queue="vision")
        assert [j.job_id for j in await beta.list()] == [theirs]
        assert [j.job_id for j in await alpha.list()] == [mine]
        everything = await admin.list()
        assert sorted(j.job_id for j in everything) == sorted([mine, theirs])
        assert {j.job_id: j.state for j in everything}[mine] == "queued"
        # The owner hears its own job's events on its team subject and may cancel it.
        heard: list[Any] = []

        async def on_event(msg: Any) -> None:
            heard.append(msg)

        await alpha.nc.subscribe(f"muster.events.team.alpha.{mine}", cb=on_event)
        await alpha.nc.flush()
        assert (await alpha.cancel(mine)).state == "cancelled"
        await wait_for(lambda: heard, what="the team's own event")
        assert b'"cancelled"' in heard[0].data
        # An admin acts on every team's jobs.
        assert (await admin.cancel(theirs)).state == "cancelled"
        assert (await admin.get(mine)).state == "cancelled"
    finally:
        for c in (alpha, beta, admin):
            await c.close()


async def test_a_team_cannot_take_another_teams_job_id(auth_nats: AuthNats, broker: Broker) -> None:
    """Job ids are global: a team that submits another team's (predictable) id first gets it,
    and the victim is told the id is taken rather than "duplicate" for a job it cannot see."""
    alpha = await client_as(auth_nats, "team-alpha", "alpha")
    beta = await client_as(auth_nats, "team-beta", "beta")
    admin = await client_as(auth_nats, "admin")
    spec = msgspec.structs.replace(SPEC, job_id="nightly-1")
    try:
        assert not (await beta.submit(spec, queue="speech")).duplicate
        with pytest.raises(MusterError, match="'nightly-1' is already taken"):
            await alpha.submit(spec, queue="vision")
        with pytest.raises(MusterError, match="already taken"):
            await admin.submit(spec, queue="ops")
        # The owner's own retry is a harmless duplicate.
        assert (await beta.submit(spec, queue="speech")).duplicate
        view = await admin.get("nightly-1")
        assert (view.queue, view.state) == ("speech", "queued")
        assert [j.job_id for j in await alpha.list()] == []
        # An admin submits anywhere.
        mine = msgspec.structs.replace(SPEC, job_id="admin-1")
        assert not (await admin.submit(mine, queue="vision")).duplicate
        assert [j.job_id for j in await alpha.list()] == ["admin-1"]
    finally:
        for c in (alpha, beta, admin):
            await c.close()


async def test_a_team_hears_nothing_of_another_teams_work(
    auth_nats: AuthNats, broker: Broker
) -> None:
    """With the real broker: beta submits a spec with an env value, asks about it, cancels it;
    alpha, subscribed to everything it might try, hears none of it (NATS refuses each)."""
    spy = await auth_nats.connect("team-alpha")
    beta = await client_as(auth_nats, "team-beta", "beta")
    tries = (
        "_INBOX.>",
        "_INBOX_team-beta.>",
        "_INBOX_broker.>",
        "muster.events.job.*",
        "muster.events.team.beta.*",
        "muster.submit.*",
        "muster.agent.*.logs",
        "$KV.>",
        "$JS.>",
        ">",
    )
    stolen = await overhear(spy, tries)
    secret = msgspec.structs.replace(
        SPEC, workload=msgspec.structs.replace(SPEC.workload, env={"TOKEN": "beta-secret"})
    )
    try:
        job_id = (await beta.submit(secret, queue="speech")).job_id
        assert job_id is not None
        assert (await beta.get(job_id)).state == "queued"
        assert (await beta.cancel(job_id)).state == "cancelled"
    finally:
        await beta.close()
    await flush(spy)
    assert stolen == []
    refused = [str(e) for e in auth_nats.errors["team-alpha"]]
    assert len(refused) == len(tries), refused
