"""A submission's `Muster-Reply-To` header is text nobody checks on the wire, unlike a reply
subject NATS parsed; the broker, which may publish on its records, the agents' commands and
every inbox, answers it only where it would answer a plain reply subject. A team naming
anything else gets no answer anywhere, and its submission is processed as any other."""

from __future__ import annotations

import pytest
from nats.js.errors import KeyNotFoundError

from broker.service import Broker
from schemas.codec import decode_submit_reply
from schemas.subjects import REPLY_HEADER
from shell.natsio import flush, submit_request
from tests.broker.jobs import processed_with_headers_refused
from tests.security.conftest import AuthNats, overhear


def job(job_id: str) -> bytes:
    return (
        b'{"name": "x", "job_id": "' + job_id.encode() + b'", '
        b'"gang": [{"name": "w", "replicas": 1, "gpu": 1}]}'
    )


async def test_a_team_cannot_point_the_reply_header_anywhere_but_an_inbox(
    auth_nats: AuthNats, broker: Broker
) -> None:
    alpha = await auth_nats.connect("team-alpha")
    admin = await auth_nats.connect("admin")
    own = await auth_nats.connect("broker")
    heard = await overhear(admin, ["muster.submit.speech", "muster.agent.east.cmd"])
    heard_own = await overhear(own, ["_INBOX_broker.probe"])
    plain = await overhear(alpha, ["_INBOX_team-alpha.plain"])
    bucket = broker.subjects.jobs_bucket
    headers = [
        f"$KV.{bucket}.forged-header",
        "muster.submit.speech",
        "muster.agent.east.cmd",
        "_INBOX_broker.probe",  # the broker's own inbox, where its JetStream deliveries arrive
        "_INBOX_team-alpha",  # an inbox prefix with no inbox under it
    ]
    for i, header in enumerate(headers):
        await alpha.publish(
            "muster.submit.vision",
            job(f"hdr-{i}"),
            reply="_INBOX_team-alpha.plain",
            headers={REPLY_HEADER: header},
        )
    await flush(alpha)
    await processed_with_headers_refused(broker, [f"hdr-{i}" for i in range(len(headers))])
    # A proper submission is answered on its header, and by then every earlier answer is out.
    reply = await submit_request(alpha, "muster.submit.vision", job("proper"), 10)
    assert decode_submit_reply(reply.data).accepted
    for c in (broker.nc, admin, own, alpha):
        await flush(c)
    assert heard == heard_own == plain == []
    assert auth_nats.errors.get("broker", []) == []  # nothing was even tried where NATS refuses
    kv = await broker.js.key_value(bucket)
    with pytest.raises(KeyNotFoundError):
        await kv.get("forged-header")
