"""The agent's node-operations decoder and refusals, property-tested: whatever arrives, the
answer is one NodeOpReply, and the backend is asked only for a well-formed request that names
one node or says `all_nodes`; everything else changes nothing and says why."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from agents.backend import Backend, NodeOpResult
from agents.nodeops import NodeOpServer

OPS = ("cordon", "uncordon", "drain", "notice")


class Cluster:
    """A backend that records what it was asked and changes nothing else."""

    cluster = "c1"

    def __init__(self) -> None:
        self.asked: list[tuple[str, str | None, str]] = []

    async def node_op(self, op: str, node: str | None, reason: str) -> NodeOpResult:
        self.asked.append((op, node, reason))
        return NodeOpResult([node or "n1"], [])


values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=20), st.sampled_from(OPS)
)
fields = st.dictionaries(
    st.sampled_from(["op", "node", "all_nodes", "reason", "force", "nodes"]), values, max_size=5
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(fields, st.binary(max_size=64)))
@example(body={"op": "cordon", "node": "n1", "reason": "disk"})
@example(body={"op": "drain", "all_nodes": True})
@example(body={"op": "drain", "node": "n1", "all_nodes": True})
@example(body={"op": "uncordon"})
def test_any_request_gets_one_reply_and_only_a_valid_one_reaches_the_backend(
    body: dict[str, Any] | bytes,
) -> None:
    backend = Cluster()
    server = NodeOpServer(cast(Client, None), "s", "c1", cast(Backend, backend))
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = asyncio.run(server.answer(data))
    valid = (
        isinstance(body, dict)
        and set(body) <= {"op", "node", "all_nodes", "reason"}
        and body.get("op") in OPS
        and (body.get("node") is None or (isinstance(body["node"], str) and body["node"]))
        and isinstance(body.get("all_nodes", False), bool)
        and isinstance(body.get("reason", ""), str)
        and len(body.get("node") or "") <= 253
        and (body.get("node") is None) == bool(body.get("all_nodes"))
    )
    assert reply.ok == valid, (body, reply)
    assert bool(backend.asked) == valid
    if not valid:
        assert reply.error
