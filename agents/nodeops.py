"""The agent's side of `muster cordon|uncordon|drain|notice`: answers NodeOpRequests on
`<prefix>.agent.<cluster>.nodeops` with one NodeOpReply.

Only operators may publish there (the NATS permissions `muster nats-config` renders), so the
agent trusts the sender and checks only the request: a malformed one, an unknown node, or a
missing node without `all_nodes` is answered with the reason and changes nothing. Requests are
carried out one at a time, so two drains of one node cannot interleave.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar, cast

import structlog
from nats.aio.client import Client

from agents.backend import Backend, BackendError, NodeOps
from agents.service import MAX_REQUEST_BYTES, Replier
from schemas.agent import NodeOpReply, NodeOpRequest
from schemas.codec import json_decoder

log = structlog.get_logger("muster.agent.nodeops")
_decode = json_decoder(NodeOpRequest, "NodeOpRequest")


class NodeOpServer(Replier[NodeOpRequest]):
    too_large: ClassVar[str] = f"node operation request over {MAX_REQUEST_BYTES} B"
    unreadable: ClassVar[str] = "bad node operation request: "

    def __init__(self, nc: Client, subject: str, cluster: str, backend: Backend) -> None:
        super().__init__(nc, subject, cluster, backend, _decode)
        self.log = log.bind(cluster=cluster)
        self._lock = asyncio.Lock()

    async def serve(self, data: bytes, reply: str) -> None:
        await self.send(reply, await self.answer(data))

    async def answer(self, data: bytes) -> NodeOpReply:
        """The reply to one request; nothing changes unless `ok` is True."""
        req = self.read(data)
        if isinstance(req, str):
            return NodeOpReply(ok=False, error=req)
        refused = self._refusal(req)
        if refused:
            return NodeOpReply(ok=False, op=req.op, error=refused)
        ops = cast(NodeOps | None, self.backend if hasattr(self.backend, "node_op") else None)
        if ops is None:
            error = f"the agent of cluster {self.cluster!r} cannot {req.op} nodes"
            return NodeOpReply(ok=False, op=req.op, error=error)
        async with self._lock:
            try:
                done = await ops.node_op(req.op, req.node, req.reason)
            except BackendError as exc:
                self.log.warning("node operation refused", op=req.op, node=req.node, error=str(exc))
                return NodeOpReply(ok=False, op=req.op, error=str(exc)[:1000])
            except Exception as exc:  # a backend bug must not leave the operator waiting
                self.log.exception("node operation failed", op=req.op, node=req.node)
                return NodeOpReply(ok=False, op=req.op, error=f"{req.op} failed: {exc}"[:1000])
        self.log.info("node operation", op=req.op, nodes=done.nodes, ended=len(done.attempts))
        return NodeOpReply(
            ok=True,
            op=req.op,
            nodes=done.nodes,
            attempts=[f"{job}/{attempt}" for job, attempt in done.attempts],
        )

    def _refusal(self, req: NodeOpRequest) -> str:
        if req.node is not None and req.all_nodes:
            return f"name one node or ask for every node (all_nodes), not both ({req.node!r})"
        if req.node is None and not req.all_nodes:
            return (
                f"no node named: to {req.op} every node of cluster {self.cluster!r} say so "
                "explicitly (`--all`)"
            )
        return ""
