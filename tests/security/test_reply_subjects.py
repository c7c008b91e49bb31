"""A requester chooses its reply subject, and the broker may publish anywhere. A team that names
the broker's own key-value store, another team's queue or the broker's private inbox as the
reply must get no answer there: otherwise the broker would write job records, submit, or feed
its own JetStream deliveries on the team's say-so."""

from __future__ import annotations

import pytest
from nats.js.errors import KeyNotFoundError

from broker.service import Broker
from shell.natsio import flush
from tests.security.conftest import AuthNats, client_as, overhear
from tests.support import wait_for

FORGED = ("forged-api", "forged-submit")


async def test_the_broker_answers_only_inboxes(auth_nats: AuthNats, broker: Broker) -> None:
    alpha = await auth_nats.connect("team-alpha")
    admin = await auth_nats.connect("admin")
    own = await auth_nats.connect("broker")
    heard = await overhear(admin, ["muster.submit.speech", "muster.agent.east.cmd"])
    heard_own = await overhear(own, ["_INBOX_broker.probe"])
    bucket = broker.subjects.jobs_bucket
    before = broker.refused["api"]
    for reply in (
        f"$KV.{bucket}.{FORGED[0]}",
        "muster.submit.speech",
        "muster.agent.east.cmd",
        "_INBOX_broker.probe",
        "_INBOX_team-alpha",  # an inbox prefix with no inbox under it
    ):
        await alpha.publish("muster.api.alpha.queues", b"{}", reply=reply)
    spec = b'{"name": "x", "job_id": "sneaky", "gang": [{"name": "w", "replicas": 1, "gpu": 1}]}'
    await alpha.publish("muster.submit.vision", spec, reply=f"$KV.{bucket}.{FORGED[1]}")
    await flush(alpha)
    machine = broker.machine
    assert machine is not None
    await wait_for(lambda: "sneaky" in machine.jobs, 10, what="the submission processed")
    # A proper call is still answered, and by then every earlier answer would have gone out.
    client = await client_as(auth_nats, "team-alpha", "alpha")
    try:
        assert [q.name for q in await client.queues()] == ["vision", "speech", "ops"]
    finally:
        await client.close()
    for c in (broker.nc, admin, own):
        await flush(c)
    assert heard == heard_own == []
    kv = await broker.js.key_value(bucket)
    for key in FORGED:
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)
    assert broker.refused["api"] == before + 5
