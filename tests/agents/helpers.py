"""Plays the broker on the wire for agent tests: decodes EventBatches, sends Commands."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import NoRespondersError

from agents.backend import Backend
from agents.runtime import HOLD_MAX_S, AgentRuntime
from schemas.agent import (
    CheckpointRef,
    ClusterSnapshot,
    Command,
    CommandAck,
    Dispatch,
    DispatchAcks,
    DispatchBatch,
    EventBatch,
    PodSetAssignment,
    WorkloadStatus,
)
from schemas.codec import (
    DecodeError,
    decode_command_ack,
    decode_dispatch_acks,
    decode_event_batch,
    encode_msgpack,
)
from schemas.job import JobSpec, PodSet, Simulation, Workload
from schemas.subjects import DEFAULT_SUBJECTS, Subjects
from shell.natsio import flush
from tests.support import wait_for

T = TypeVar("T")
E = TypeVar("E")


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


class BrokerWire:
    """Subscribes to one cluster's events subject and records every decoded batch."""

    def __init__(self, nc: Client, cluster: str, subjects: Subjects = DEFAULT_SUBJECTS) -> None:
        self.nc = nc
        self.cluster = cluster
        self.subjects = subjects
        self.batches: list[EventBatch] = []
        self.errors: list[str] = []
        self._changed = asyncio.Event()
        self._sub: Any = None

    async def start(self) -> BrokerWire:
        self._sub = await self.nc.subscribe(
            self.subjects.agent_events(self.cluster), cb=self._on_batch
        )
        await flush(self.nc)
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_batch(self, msg: Any) -> None:
        try:
            self.batches.append(decode_event_batch(msg.data))
        except Exception as exc:  # recorded; tests assert there are none
            self.errors.append(str(exc))
        self._changed.set()

    def events(self, kind: type[E] | None = None, since: int = 0) -> list[E]:
        out: list[Any] = []
        for b in self.batches[since:]:
            for ev in b.events:
                if kind is None or isinstance(ev, kind):
                    out.append(ev)
        return out

    def statuses(self, job_id: str, attempt: int | None = None) -> list[WorkloadStatus]:
        return [
            s
            for s in self.events(WorkloadStatus)
            if s.job_id == job_id and (attempt is None or s.attempt == attempt)
        ]

    async def wait_for(self, pred: Callable[[], T | None], timeout: float = 5.0) -> T:
        """Look at `pred` whenever a batch arrives (bounded by `timeout`)."""
        return await wait_for(pred, timeout, changed=self._changed)

    async def wait_status(
        self, job_id: str, attempt: int, phase: str, timeout: float = 5.0
    ) -> WorkloadStatus:
        def find() -> WorkloadStatus | None:
            for s in self.statuses(job_id, attempt):
                if s.phase == phase:
                    return s
            return None

        return await self.wait_for(find, timeout)

    async def wait_snapshot(self, since: int = 0, timeout: float = 5.0) -> ClusterSnapshot:
        def find() -> ClusterSnapshot | None:
            snaps = self.events(ClusterSnapshot, since)
            return snaps[0] if snaps else None

        return await self.wait_for(find, timeout)

    async def send(self, cmd: Command, timeout: float = 2.0) -> CommandAck:
        return await self.send_raw(encode_msgpack(cmd), timeout)

    async def send_raw(self, data: bytes, timeout: float = 2.0) -> CommandAck:
        return decode_command_ack(await self.ask(data, timeout))

    async def send_batch(
        self, batch: DispatchBatch, timeout: float = 2.0
    ) -> DispatchAcks | CommandAck:
        """A DispatchBatch as the broker sends it; its answer: one ack per Dispatch, or one
        for the whole batch."""
        data = await self.ask(encode_msgpack(batch), timeout)
        try:
            return decode_dispatch_acks(data)
        except DecodeError:
            return decode_command_ack(data)

    async def ask(self, data: bytes, timeout: float = 2.0) -> bytes:
        """Request/reply like the broker. A just-started nats-server answers "no responders"
        for a few hundred ms even after the agent's SUB was flushed, so retry that (bounded)."""
        subject = self.subjects.agent_cmd(self.cluster)

        async def answered() -> bytes | None:
            try:
                msg = await self.nc.request(subject, data, timeout=timeout)
            except NoRespondersError:
                return None
            return msg.data

        return await wait_for(answered, 5.0, what=f"a responder on {subject}", interval=0.05)


def job_spec(
    name: str = "train",
    replicas: int = 2,
    gpu: int = 8,
    sim: Simulation | None = None,
) -> JobSpec:
    return JobSpec(
        name=name,
        gang=[PodSet(name="worker", replicas=replicas, gpu=gpu, cpu="4", memory="16Gi")],
        workload=Workload(simulate=sim),
    )


def dispatch(
    job_id: str,
    nodes: list[str],
    *,
    attempt: int = 1,
    epoch: int = 1,
    flavor: str = "spot-a100",
    gpu: int = 8,
    sim: Simulation | None = None,
    resume_from: CheckpointRef | None = None,
    checkpoint_uri: str = "",
) -> Dispatch:
    return Dispatch(
        job_id=job_id,
        attempt=attempt,
        epoch=epoch,
        flavor=flavor,
        assignment=[PodSetAssignment(podset="worker", nodes=nodes)],
        spec=job_spec(replicas=len(nodes), gpu=gpu, sim=sim),
        resume_from=resume_from,
        checkpoint_uri=checkpoint_uri or f"s3://ckpt/{job_id}",
    )


class HeldFirstSnapshot:
    """Holds a backend's first snapshot until `finish` is set (a big cluster's first read), so
    that a test lands a command between the agent's subscription and that read every time."""

    def __init__(self, backend: Backend) -> None:
        self.reading = asyncio.Event()
        self.finish = asyncio.Event()
        self._read = backend.snapshot
        backend.snapshot = self._snapshot  # type: ignore[method-assign]

    async def _snapshot(self) -> ClusterSnapshot:
        if not self.finish.is_set():
            self.reading.set()
            await self.finish.wait()
        return await self._read()


async def sent_while_starting(
    runtime: AgentRuntime, held: HeldFirstSnapshot, cmd: Command, *, release: bool = True
) -> CommandAck:
    """Start `runtime` and send `cmd` as the broker does once the agent listens but has not
    learnt its first snapshot, then let the snapshot end (with `release` False, only once the
    command is answered). Stops the runtime; returns the command's ack."""
    wire = BrokerWire(runtime.nc, runtime.cluster, runtime.subjects)
    starting = asyncio.create_task(runtime.start())
    try:
        await asyncio.wait_for(held.reading.wait(), timeout=5)
        asked = asyncio.create_task(wire.send(cmd, timeout=HOLD_MAX_S + 2))
        await wait_for(lambda: runtime.stats["commands"] == 1, what="the command at the agent")
        if not release:
            await asyncio.wait_for(asyncio.shield(asked), timeout=HOLD_MAX_S + 2)
        held.finish.set()
        await starting
        return await asked
    finally:
        held.finish.set()
        await asyncio.gather(starting, return_exceptions=True)
        await runtime.stop()
