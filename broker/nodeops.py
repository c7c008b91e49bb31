"""The client's side of `muster cordon|uncordon|drain|notice`: one request to the agent of the
named cluster (`<prefix>.agent.<cluster>.nodeops`), answered with what it did.

The request goes to the agent, not the broker: the agent is what can change its cluster's
nodes, and the broker learns of the change the way it learns of any node change (the node's
`no_new_pods`, the evictions a drain causes). Only operators may publish there.
"""

from __future__ import annotations

import re

from broker.client import MusterClient, MusterError
from schemas.agent import NodeOpName, NodeOpReply, NodeOpRequest
from schemas.codec import DecodeError, encode_json, json_decoder

_reply = json_decoder(NodeOpReply, "NodeOpReply")
_request = json_decoder(NodeOpRequest, "NodeOpRequest")
CLUSTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")


async def node_op(
    client: MusterClient,
    cluster: str,
    op: NodeOpName,
    node: str | None,
    *,
    all_nodes: bool = False,
    reason: str = "",
    timeout: float = 10.0,
) -> NodeOpReply:
    """Ask `cluster`'s agent to carry out `op`; its reply when it did, else MusterError with
    the agent's reason (nothing was changed) or why no agent answered."""
    if client.team:
        raise MusterError(
            f"`muster {op}` is an operator's action and team {client.team!r} may not send it; "
            "connect as the admin user (--user admin) without --team"
        )
    if not CLUSTER.match(cluster):
        raise MusterError(f"{cluster!r} is not a cluster name (`muster clusters` lists them)")
    req = NodeOpRequest(op=op, node=node, all_nodes=all_nodes, reason=reason)
    try:
        data = encode_json(_request(encode_json(req)))  # the agent's limits, checked here first
    except DecodeError as exc:
        raise MusterError(str(exc)) from None
    subject = client.subjects.agent_nodeops(cluster)
    reply = await client.ask(
        subject,
        data,
        _reply,
        timeout,
        silent=(
            f"no agent of cluster {cluster!r} answers: the name is wrong or its agent is down "
            "(`muster clusters` lists the clusters the broker knows)"
        ),
        late=(
            f"the agent of cluster {cluster!r} did not answer within {timeout:g}s; what it "
            "was doing may still complete: check with `muster clusters`"
        ),
        unreadable=f"cluster {cluster!r} sent an unreadable reply",
    )
    if not reply.ok:
        raise MusterError(reply.error or f"{op} failed on cluster {cluster!r} (no reason given)")
    return reply


PAST = {"cordon": "cordoned", "uncordon": "uncordoned", "drain": "drained", "notice": "noticed"}


def describe(cluster: str, reply: NodeOpReply) -> str:
    """One line for people: what changed, and what a drain or notice sets moving."""
    op = reply.op or "cordon"
    nodes = ", ".join(reply.nodes) or "no node"
    if op == "notice":
        return (
            f"spot notice sent for node {nodes} of cluster {cluster}; what runs there is "
            "checkpointed and moved before the node is reclaimed"
        )
    text = f"{PAST[op]} {len(reply.nodes)} node(s) of cluster {cluster}: {nodes}"
    if op == "drain":
        if reply.attempts:
            text += (
                f"; ended {', '.join(reply.attempts)} as an infrastructure loss (each resumes "
                "elsewhere from its latest checkpoint)"
            )
        else:
            text += "; nothing was running there"
    return text
