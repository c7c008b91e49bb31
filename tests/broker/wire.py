"""A scripted agent that speaks the wire protocol by hand, so broker tests can control and
observe every message (acks withheld, stale reports, sequence gaps)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.agent import (
    AgentEvent,
    Cancel,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    DispatchAcks,
    DispatchBatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    NodeInfo,
    Resync,
    WorkloadStatus,
)
from schemas.codec import decode_command, encode_msgpack
from schemas.subjects import Subjects


def nodes(cluster: str, flavor: str, count: int, gpu: int = 8) -> list[NodeInfo]:
    return [
        NodeInfo(
            name=f"{cluster}-{flavor}-{i}",
            flavor=flavor,
            gpu=gpu,
            cpu_milli=96_000,
            memory=768 * 2**30,
        )
        for i in range(count)
    ]


class WireAgent:
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        cluster: str,
        flavors: list[FlavorInfo],
        node_list: list[NodeInfo],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.cluster = cluster
        self.flavors = flavors
        self.nodes = node_list
        self.instance = uuid.uuid4().hex[:8]
        self.seq = 0
        self.ack = True  # False: never answer (an agent that stopped acking)
        self.unanswered: list[Msg] = []  # commands it did not answer, for the test to answer
        self.commands: list[Any] = []
        self.dispatches: asyncio.Queue[Dispatch] = asyncio.Queue()
        self.cancels: asyncio.Queue[Cancel] = asyncio.Queue()
        self.workloads: list[WorkloadStatus] = []
        self.auto_run = True  # answer a dispatch with created + running
        self.refuse = ""  # not empty: refuse every dispatch with this error (ok=False)
        self.refuse_jobs: set[str] = set()  # ... or the dispatches of these jobs only
        # not empty: answer a DispatchBatch with this one refusal, as an agent older than
        # wire 1.3 answers a command kind it does not know
        self.refuse_batches = ""
        self.batches: list[DispatchBatch] = []  # the DispatchBatches it received
        self.job_only = False  # ... as a refusal of each job alone (a team's quota there)
        self.silent = False  # True: no heartbeats (a cluster that went away)
        # (job, attempt) -> the ending a Cancel of that attempt is answered with (one it has
        # not reported in a batch the broker acknowledged)
        self.ended: dict[tuple[str, int], WorkloadStatus] = {}
        self.wire = ""  # the wire version its batches carry ("": the 0.1.0 release's none)
        self._sub: Any = None
        self._beat: asyncio.Task[None] | None = None

    async def start(self) -> WireAgent:
        self._sub = await self.nc.subscribe(self.subjects.agent_cmd(self.cluster), cb=self._on_cmd)
        await self.send(self.snapshot())
        self._beat = asyncio.create_task(self._heartbeats())
        return self

    async def stop_answering(self) -> None:
        """Leave the command subject (heartbeats go on), for a test's own answers there."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _heartbeats(self) -> None:
        for _ in range(10_000):  # bounded: ~33 minutes at most
            # The protocol's heartbeat period, a rhythm and not a wait: tests wait for what
            # the broker makes of heartbeats (health, a resync), never for the period itself.
            await asyncio.sleep(0.2)
            if not self.silent:
                await self.send(Heartbeat(at=time.time()))

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(flavors=self.flavors, nodes=self.nodes, workloads=self.workloads)

    async def send(self, *events: AgentEvent, seq: int | None = None) -> None:
        await self.nc.publish(
            self.subjects.agent_events(self.cluster), self.batch(*events, seq=seq)
        )

    def batch(self, *events: AgentEvent, seq: int | None = None) -> bytes:
        """The next event batch as it goes on the wire (it takes the next sequence number)."""
        self.seq = self.seq + 1 if seq is None else seq
        batch = EventBatch(
            cluster=self.cluster,
            instance=self.instance,
            seq=self.seq,
            events=list(events),
            sent_at=time.time(),
            wire=self.wire,
        )
        return encode_msgpack(batch)

    def _dispatch_ack(self, cmd: Dispatch) -> CommandAck:
        if self.refuse or cmd.job_id in self.refuse_jobs:
            error = self.refuse or f"job {cmd.job_id} refused here"
            return CommandAck(ok=False, error=error, job_only=self.job_only)
        return CommandAck(ok=True)

    async def _on_batch(self, msg: Msg, batch: DispatchBatch) -> None:
        self.batches.append(batch)
        for cmd in batch.dispatches:
            self.dispatches.put_nowait(cmd)
        if not self.ack:
            self.unanswered.append(msg)
            return
        if self.refuse_batches:
            await msg.respond(encode_msgpack(CommandAck(ok=False, error=self.refuse_batches)))
            return
        acks = [self._dispatch_ack(cmd) for cmd in batch.dispatches]
        await msg.respond(encode_msgpack(DispatchAcks(acks=acks)))
        for cmd, ack in zip(batch.dispatches, acks, strict=True):
            if ack.ok and self.auto_run:
                await self._run(cmd)

    async def _on_cmd(self, msg: Msg) -> None:
        cmd = decode_command(msg.data)
        self.commands.append(cmd)
        if isinstance(cmd, DispatchBatch):
            await self._on_batch(msg, cmd)
            return
        if isinstance(cmd, Dispatch):
            self.dispatches.put_nowait(cmd)
        elif isinstance(cmd, Cancel):
            self.cancels.put_nowait(cmd)
        if not self.ack:
            self.unanswered.append(msg)
            return
        if isinstance(cmd, Dispatch) and not (ack := self._dispatch_ack(cmd)).ok:
            await msg.respond(encode_msgpack(ack))
            return
        ended = self.ended.get((cmd.job_id, cmd.attempt)) if isinstance(cmd, Cancel) else None
        await msg.respond(encode_msgpack(CommandAck(ok=True, ended=ended)))
        if isinstance(cmd, Resync):
            await self.send(self.snapshot())
        if isinstance(cmd, Cancel):
            self.workloads = [
                w
                for w in self.workloads
                if not (w.job_id == cmd.job_id and cmd.attempt in (None, w.attempt))
            ]
        if isinstance(cmd, Dispatch) and self.auto_run:
            await self._run(cmd)

    async def _run(self, cmd: Dispatch) -> None:
        """The dispatched workload runs: report it and list it in snapshots."""
        total = sum(len(a.nodes) for a in cmd.assignment)
        status = WorkloadStatus(
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            phase="running",
            running_replicas=total,
            total_replicas=total,
        )
        self.workloads = [w for w in self.workloads if w.job_id != cmd.job_id] + [status]
        await self.send(status)

    async def finish(self, job_id: str, attempt: int, phase: str = "succeeded") -> None:
        """The workload ends: report it and stop listing it in snapshots."""
        self.workloads = [w for w in self.workloads if w.job_id != job_id]
        await self.send(WorkloadStatus(job_id=job_id, attempt=attempt, phase=phase))  # type: ignore[arg-type]

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()


async def next_item(queue: asyncio.Queue[Any], timeout: float = 5.0) -> Any:
    return await asyncio.wait_for(queue.get(), timeout)
