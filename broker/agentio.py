"""The broker's side of the agent link: agent batches in, Applied acknowledgements out.

Batches are filed in per-cluster mailboxes (`broker/agentlink.py`) and applied in turn by one
worker; an agent of an incompatible wire version is told and logged, and batches carrying
outcomes are acknowledged so the agent can drop them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

import msgspec
import structlog
from nats.aio.msg import Msg

from broker.core.effects import refusal
from broker.core.inputs import AgentBatch, Checkpoint
from broker.fields import BrokerFields
from broker.sequencer import acknowledges
from schemas.agent import (
    Applied,
    CheckpointReport,
    WireRefused,
)
from schemas.codec import DecodeError, decode_event_batch, json_decoder
from schemas.wire import WIRE_VERSION, compatible

log = structlog.get_logger("muster.broker")

_checkpoint_decoder = json_decoder(CheckpointReport, "CheckpointReport")

BUDGET_LOG_EVERY_S = 10.0  # per cluster: how often an agent over its budget is logged
WIRE_REFUSAL_EVERY_S = 10.0  # per cluster: how often an incompatible agent is logged and told


class _WireOnly(msgspec.Struct):
    wire: str = ""


_wire_decoder = msgspec.msgpack.Decoder(_WireOnly)


def _peek_wire(data: bytes) -> str | None:
    """The wire version of a batch that did not decode in full; None when unreadable."""
    try:
        return _wire_decoder.decode(data).wire
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class AgentLink(BrokerFields):
    """Takes agents' batches into the machine and acknowledges their outcomes."""

    async def _on_agent_batch(self, msg: Msg) -> None:
        """File the batch in its cluster's mailbox, undecoded (broker/agentlink.py): this
        callback must keep up with the socket whatever one agent sends."""
        mail = self._mail
        cluster = self.subjects.cluster_of_agent_subject(msg.subject)
        if mail is None or cluster is None:
            return
        now = time.monotonic()
        why = mail.offer(cluster, msg.data, now)
        if why is not None:
            if why != "coalesced":
                self.stats["agent_dropped"] += 1
            if now - self._budget_logged.get(cluster, -1e18) >= BUDGET_LOG_EVERY_S:
                self._budget_logged[cluster] = now
                log.warning(
                    "broker.agent_over_budget",
                    cluster=cluster,
                    reason=why,
                    dropped=sum(n for (c, _), n in mail.dropped().items() if c == cluster),
                    bytes=len(msg.data),
                )
        self._mail_wake.set()

    def agent_drops(self) -> dict[tuple[str, str], int]:
        """(cluster, reason) -> agent batches not applied: coalesced, over-budget."""
        return self._mail.dropped() if self._mail is not None else {}

    async def _agent_worker(self) -> None:
        """Apply the agents' batches, clusters in turn as their budgets allow, yielding after
        each so the API, submissions and the socket are served between any two."""
        mail = self._mail
        assert mail is not None
        while True:
            got = mail.take(time.monotonic())
            if isinstance(got, float):
                self._mail_wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(got):
                        await self._mail_wake.wait()
                continue
            cluster, data = got
            try:
                await self._agent_batch(cluster, data)
            except Exception as exc:  # the handler boundary: refuse, count, carry on
                self.refused["agent_batch"] += 1
                self.stats["bad_batches"] += 1
                log.exception("broker.batch_refused", cluster=cluster, error=repr(exc)[:300])
            await asyncio.sleep(0)

    async def _agent_batch(self, cluster: str, data: bytes) -> None:
        machine = self.machine
        if machine is None:
            return
        try:
            batch = decode_event_batch(data)
        except DecodeError as exc:
            # A batch of another major may not decode here: name its version if it has one.
            if not self._wire_ok(cluster, _peek_wire(data)):
                return
            self.stats["bad_batches"] += 1
            self.refused["agent_batch"] += 1
            log.warning("broker.bad_batch", cluster=cluster, error=str(exc)[:500])
            return
        if not self._wire_ok(cluster, batch.wire):
            return
        self._agent_wires[cluster] = batch.wire  # what its Dispatches may be sent as
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        self._sequencer.carried_out(cluster, batch)
        try:
            effects = machine.handle(AgentBatch(cluster, batch), self.clock())
        except Exception:  # a bug must not take the broker down; it is logged loudly
            self.stats["bad_batches"] += 1
            log.exception("broker.batch_failed", cluster=cluster, seq=batch.seq)
            return
        error = refusal(effects)
        if error:
            self.stats["bad_batches"] += 1
            log.warning("broker.rejected_batch", cluster=cluster, error=error)
        now = time.monotonic()
        if acknowledges(effects, batch, now, self._applied_at.get(cluster)):
            # The agent keeps endings and checkpoints until told they are persisted, and
            # extends its workloads' fences from the time the acknowledged batch left.
            self._applied_at[cluster] = now
            persisted = self._push(effects, wait=True)
            self._spawn(self._acknowledge(cluster, batch.instance, batch.seq, persisted))
        else:
            self._push(effects)
        self._wake.set()

    def _wire_ok(self, cluster: str, wire: str | None) -> bool:
        """False for a batch whose wire major differs from ours: it is refused, counted, logged
        and the agent told why (at most every WIRE_REFUSAL_EVERY_S per cluster). Same major,
        any minor, is accepted; so is None (no version could be read: the caller's own
        checks refuse the batch)."""
        if wire is None or compatible(wire):
            return True
        self.refused["agent_wire"] += 1
        wire = wire[:16]  # as the schema bounds it: a batch that did not decode is unbounded
        now = time.monotonic()
        if now - self._wire_refused_at.get(cluster, -1e18) >= WIRE_REFUSAL_EVERY_S:
            self._wire_refused_at[cluster] = now
            reason = (
                f"wire version {wire!r} of cluster {cluster!r} is not compatible with this "
                f"broker's {WIRE_VERSION}: run an agent of major version "
                f"{WIRE_VERSION.split('.')[0]} (or upgrade the broker)"
            )
            log.error(
                "broker.agent_wire_refused",
                cluster=cluster,
                agent_wire=wire,
                broker_wire=WIRE_VERSION,
            )
            if self.machine is not None:
                cmd = WireRefused(
                    epoch=self.machine.epoch,
                    broker_wire=WIRE_VERSION,
                    agent_wire=wire,
                    reason=reason,
                )
                self._spawn(self._send_command(cluster, cmd))
        return False

    async def _acknowledge(
        self, cluster: str, instance: str, seq: int, persisted: asyncio.Future[None] | None
    ) -> None:
        """Tell the agent its outcomes up to `seq` are persisted. One Applied in flight per
        cluster; a newer seq that arrives meanwhile is sent when it returns."""
        if persisted is not None:
            due = self._applied_due.setdefault(cluster, set())  # one set a cluster, kept
            due.add(persisted)
            try:
                await persisted
            finally:
                due.discard(persisted)
        sent = self._applied_sent.get(cluster)
        if sent is not None and sent[0] == instance and sent[1] >= seq:
            return
        self._applied_sent[cluster] = (instance, seq)
        if cluster in self._applied_busy:
            return
        self._applied_busy.add(cluster)
        try:
            done: tuple[str, int] | None = None
            while self._applied_sent.get(cluster) != done and self.machine is not None:
                done = self._applied_sent[cluster]
                cmd = Applied(epoch=self.machine.epoch, instance=done[0], seq=done[1])
                await self._send_command(cluster, cmd)
        finally:
            self._applied_busy.discard(cluster)

    async def _on_sdk_checkpoint(self, msg: Msg) -> None:
        machine = self.machine
        if machine is None:
            return
        try:
            report = _checkpoint_decoder(msg.data)
            if not hmac.compare_digest(
                report.token, self._attempt_token(report.job_id, report.attempt)
            ):
                raise ValueError(
                    f"checkpoint for {report.job_id} attempt {report.attempt} without that "
                    "attempt's MUSTER_CHECKPOINT_TOKEN; only its own replicas may report it"
                )
            effects = machine.handle(Checkpoint(report), self.clock())
        except Exception as exc:  # the handler boundary
            self.refused["checkpoint"] += 1
            log.warning("broker.bad_checkpoint", subject=msg.subject, error=str(exc)[:500])
            return
        self._push(effects)
        self._wake.set()
