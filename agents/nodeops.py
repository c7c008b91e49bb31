"""The agent's side of `muster cordon|uncordon|drain|notice`: answers NodeOpRequests on
`<prefix>.agent.<cluster>.nodeops` with one NodeOpReply.

Only operators may publish there (the NATS permissions `muster nats-config` renders), so the
agent trusts the sender and checks only the request: a malformed one, an unknown node, or a
missing node without `all_nodes` is answered with the reason and changes nothing. Requests are
carried out one at a time, so two drains of one node cannot interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from agents.backend import Backend, BackendError, NodeOps
from schemas.agent import NodeOpReply, NodeOpRequest
from schemas.codec import DecodeError, encode_json, json_decoder

log = structlog.get_logger("muster.agent.nodeops")
_decode = json_decoder(NodeOpRequest, "NodeOpRequest")
MAX_REQUEST_BYTES = 4096


class NodeOpServer:
    def __init__(self, nc: Client, subject: str, cluster: str, backend: Backend) -> None:
        self.nc = nc
        self.backend = backend
        self.cluster = cluster
        self.subject = subject
        self.log = log.bind(cluster=cluster)
        self._lock = asyncio.Lock()
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subject, cb=self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        reply = await self.answer(msg.data)
        with contextlib.suppress(Exception):
            await self.nc.publish(msg.reply, encode_json(reply))

    async def answer(self, data: bytes) -> NodeOpReply:
        """The reply to one request; nothing changes unless `ok` is True."""
        if len(data) > MAX_REQUEST_BYTES:
            return NodeOpReply(ok=False, error=f"node operation request over {MAX_REQUEST_BYTES} B")
        try:
            req = _decode(data)
        except DecodeError as exc:
            return NodeOpReply(ok=False, error=f"bad node operation request: {exc}"[:1000])
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
