"""The effect executor: carries out what the core decided, in order.

The asyncio driver of `broker/sequencer.py`, which holds the rules (persist first, the
Cancel-before-Dispatch barrier, retries with a wait learnt per cluster, the dispatch token);
the deterministic simulations drive the same object from their virtual clocks. Here are the
I/O: one ordered pipeline to the store and NATS, requests and their replies, and the leader's
reaction to an agent that claims a newer epoch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, NamedTuple

import structlog

from broker.core.effects import Effect, Forget, Publish, Send
from broker.core.inputs import CancelSettled, DispatchAcked
from broker.dispatchbatches import (
    MAX_BATCH_BYTES,
    SharedReply,
    dispatch_batches,
    read_ack,
    read_batch_answer,
)
from broker.fields import BrokerFields
from broker.sequencer import attempt_token
from schemas.agent import MAX_BATCH_DISPATCHES, Cancel, CommandAck, Dispatch, WorkloadStatus
from schemas.codec import encode_json, encode_msgpack
from schemas.wire import takes_dispatch_batches
from shell.natsio import Asked

log = structlog.get_logger("muster.broker")

# Lifecycle steps an operator follows at info level (queued and checkpointed are debug-worthy
# at load; `muster watch` shows them). "dispatched" is logged when the agent acks.
LIFECYCLE_LOGGED = frozenset(
    {"admitted", "running", "preempting", "requeued", "succeeded", "failed", "cancelled"}
)


def log_lifecycle(event: Any) -> None:
    """One info line per lifecycle step, with the job, cluster and attempt it concerns."""
    log.info(
        f"job {event.kind}",
        job_id=event.job_id,
        cluster=event.cluster,
        flavor=event.flavor,
        attempt=event.attempt,
        reason=event.reason,
    )


LEASE_CHECK_MIN_INTERVAL_S = 1.0  # stale-epoch claims are checked against the lease this rarely
STORAGE_FULL_MARKERS = ("insufficient", "resources", "maximum bytes", "storage")


def _storage_full(error: str) -> bool:
    text = error.lower()
    return any(marker in text for marker in STORAGE_FULL_MARKERS)


async def first_done(futures: list[asyncio.Future[Any]], timeout: float) -> None:
    """Return once one of `futures` is done or `timeout` seconds have passed: what
    `asyncio.wait(..., return_when=FIRST_COMPLETED)` does for futures, without the sets it
    builds and the coroutine checks it makes per call (one call per Dispatch)."""
    for fut in futures:
        if fut.done():
            return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, wake)
    for fut in futures:
        fut.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        for fut in futures:
            fut.remove_done_callback(wake)


class FirstCopy(NamedTuple):
    """Where a Dispatch's first copy left off when a task takes it on: the copy still
    unanswered after its wait (None: nothing of it is outstanding), and why it counts as
    refused so far."""

    unanswered: Asked | None
    error: str


def _failed(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class EffectExecutor(BrokerFields):
    """Carries out the machine's effects in order: persist, then send and publish."""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _push(self, effects: list[Effect], *, wait: bool = False) -> asyncio.Future[None] | None:
        if not effects and not wait:
            return None
        fut: asyncio.Future[None] | None = (
            asyncio.get_running_loop().create_future() if wait else None
        )
        self._queue.put_nowait((effects, fut))
        return fut

    async def _pipeline(self) -> None:
        assert self.store is not None
        while True:
            batch = [await self._queue.get()]
            # Let tasks that are already runnable (the admission cycle woken by the same
            # submissions) add their effects, so one put persists a job submitted and admitted
            # together instead of two.
            await asyncio.sleep(0)
            while not self._queue.empty() and len(batch) < 4096:
                batch.append(self._queue.get_nowait())
            # A lease suspended by a full server store is not proven ours: change nothing
            # (write, dispatch, cancel) until a renewal proves it again (broker/lease.py).
            await self.lease.proven.wait()
            loop = asyncio.get_running_loop()
            now = math.inf if self._handing_over else loop.time()
            await self._persist(self._writes.take((effects for effects, _ in batch), now))
            self._wake_for_deferred(loop)
            logged = log.is_enabled_for(logging.INFO)  # once a batch: a call costs as much
            # Dispatches go out per cluster once the pass is done, several in one request
            # where the agent takes batches; before any other command to the same cluster.
            outgoing: dict[str, list[Dispatch]] = {}
            for effects, fut in batch:
                for eff in effects:
                    if isinstance(eff, Send):
                        cmd = eff.command
                        if isinstance(cmd, Dispatch):
                            if self._sequencer.dispatch(eff.cluster, cmd, eff.after_cancel_of):
                                outgoing.setdefault(eff.cluster, []).append(cmd)
                            continue
                        if eff.cluster in outgoing:
                            await self._dispatch_all(eff.cluster, outgoing.pop(eff.cluster))
                        if isinstance(cmd, Cancel):
                            ticket = self._sequencer.cancel(cmd)
                            self._spawn(self._cancel_until_heard(eff.cluster, cmd, ticket))
                        else:
                            self._spawn(self._send_command(eff.cluster, eff.command))
                    elif isinstance(eff, Forget):
                        self._spawn(self._forget(eff.job_id))
                    elif isinstance(eff, Publish):
                        event = eff.event
                        if logged and event.kind in LIFECYCLE_LOGGED:
                            log_lifecycle(event)
                        body = encode_json(event)
                        await self.nc.publish(self.subjects.job_events(event.job_id), body)
                        team = self._team_of_job(event.job_id)
                        if team:
                            await self.nc.publish(
                                self.subjects.team_events(team, event.job_id), body
                            )
                if fut is not None and not fut.done():
                    fut.set_result(None)
            for cluster, cmds in outgoing.items():
                await self._dispatch_all(cluster, cmds)

    def _wake_for_deferred(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wake the pipeline when the first deferred record falls due (an empty batch takes
        it), unless a wake-up at or before then is already armed."""
        due = self._writes.due_at()
        if due is None or (self._writes_wake is not None and self._writes_wake <= due):
            return
        self._writes_wake = due
        loop.call_at(due, self._deferred_due, due)

    def _deferred_due(self, due: float) -> None:
        if self._writes_wake == due:
            self._writes_wake = None
        self._queue.put_nowait(([], None))

    async def _forget(self, job_id: str) -> None:
        """Delete an expired job's record; a failure leaves it to the next leader's pass."""
        assert self.store is not None
        try:
            await self.store.delete(job_id)
        except Exception as exc:
            log.warning("broker.forget_failed", job_id=job_id, error=str(exc))

    async def _persist(self, records: list[Any]) -> None:
        assert self.store is not None
        delay = 0.05
        while records:
            try:
                self._unwritten = len(records)
                await self.store.put_many(records)
                self._unwritten = 0
                self.stats["records_put"] += len(records)
                if self._persist_full:
                    log.warning("broker.storage_available", records=len(records))
                self._persist_full = False
                return
            except Exception as exc:  # NATS down: durability first, so wait and retry
                if _storage_full(str(exc)):
                    if not self._persist_full:
                        log.error("broker.storage_full", error=str(exc), records=len(records))
                    self._persist_full = True
                log.warning("broker.persist_retry", error=str(exc), records=len(records))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _request(
        self,
        cluster: str,
        data: bytes,
        attempts: int,
        resumed: FirstCopy | None = None,
        dispatch: Dispatch | None = None,
    ) -> CommandAck:
        """The agent's answer (with a stale epoch: the newer epoch it claims), or the refusal
        this side makes of its silence.

        Up to `attempts` copies, each waited for as long as the cluster's acks take
        (broker/ackwait.py); the ack of any copy sent so far counts. A refusal is final once
        no later copy is outstanding: the agent runs a job's commands one after the other,
        so a later copy may still be carried out, and then its ack is the truth.
        `resumed`: the first copy was sent and waited for already (`_dispatch`). `dispatch`:
        the Dispatch `data` carries, waited for again while its agent is busy (ackwait.py)."""
        subject = self.subjects.agent_cmd(cluster)
        seq = self._sequencer
        loop = asyncio.get_running_loop()
        asked: list[Asked] = []
        latest: Asked | None = None
        refused: CommandAck | None = None
        error = ""
        first = 0
        # A Dispatch's patience counts from its first copy (broker/ackwait.py).
        keys = [(dispatch.job_id, dispatch.attempt)] if dispatch is not None else []
        first_copy = resumed.unanswered if resumed is not None else None
        started = first_copy.sent if first_copy is not None else loop.time()
        try:
            if resumed is not None:
                first, error, latest = 1, resumed.error, resumed.unanswered
                if latest is not None:
                    asked.append(latest)
                elif attempts > 1:
                    await asyncio.sleep(seq.empty_pause(0))  # nothing on the wire
            for i in range(first, attempts):
                if refused is not None:
                    return refused
                if i:
                    self.stats["ack_retries"] += 1
                try:
                    latest = await self._requests.ask(subject, data)
                    asked.append(latest)
                except Exception as exc:
                    error = _failed(exc)
                wait = seq.ack_wait(cluster, i)
                heard = seq.heard(cluster)
                deadline = loop.time() + wait
                while asked:
                    if (left := deadline - loop.time()) <= 0:
                        now = loop.time()
                        if not seq.still_busy(cluster, heard, now - started, attempts, keys):
                            break
                        self.stats["ack_waits_again"] += 1  # busy, not silent: no copy
                        heard, deadline = seq.heard(cluster), now + wait
                        continue
                    await first_done([a.reply for a in asked], left)
                    for a in [a for a in asked if a.reply.done()]:
                        asked.remove(a)
                        ack = read_ack(cluster, a.reply)
                        if isinstance(ack, str):
                            error = ack
                            continue
                        seq.acked(cluster, loop.time() - a.sent, dispatch=bool(keys))
                        if a is not latest:  # the old fixed wait would have dropped it
                            self.stats["late_acks"] += 1
                        if seq.decides(ack, outstanding=bool(asked)):
                            return ack
                        refused = ack
                if asked:
                    error = seq.silence(cluster, wait).error
                elif refused is None and i + 1 < attempts:
                    await asyncio.sleep(seq.empty_pause(i))  # nothing on the wire
            return refused if refused is not None else CommandAck(ok=False, error=error)
        finally:
            for a in asked:
                self._requests.forget(a)

    def _attempt_token(self, job_id: str, attempt: int) -> str:
        """The secret that lets one attempt's workload report its own checkpoints."""
        return attempt_token(self._id_key, job_id, attempt)

    async def _dispatch_all(self, cluster: str, cmds: list[Dispatch]) -> None:
        """Send one pass's Dispatches to `cluster`: in batches to an agent that takes them
        (broker/dispatchbatches.py), one by one to any other.

        The Applied of a batch of the cluster whose records are written leaves first (its
        task runs before this one resumes): the Dispatches may stand on what that batch told
        (a node it freed), and an agent the broker has not acknowledged for the fence, as
        after an outage that long, refuses them as read late (`agents/gate.py`)."""
        if any(persisted.done() for persisted in self._applied_due.get(cluster, ())):
            await asyncio.sleep(0)
        takes = takes_dispatch_batches(self._agent_wires.get(cluster, ""))
        most = MAX_BATCH_DISPATCHES if takes else 1
        limit = min(MAX_BATCH_BYTES, self.config.max_payload_bytes // 2)
        for group, data in dispatch_batches(cmds, most, limit):
            await self._first_copy(cluster, group, data)

    async def _first_copy(self, cluster: str, cmds: list[Dispatch], data: bytes) -> None:
        """Send a Dispatch (or a batch of them, `data`) and hear the ack of this first copy
        without a task of its own: a callback on the reply and a timer. Anything but an
        answer in time (silence, no responders, a bad ack, a stale epoch) goes on in a task
        per Dispatch (`_send_dispatch`), from where this left it; most never need one."""
        try:
            asked = await self._requests.ask(self.subjects.agent_cmd(cluster), data)
        except Exception as exc:
            for cmd in cmds:
                self._spawn(self._send_dispatch(cluster, cmd, FirstCopy(None, _failed(exc))))
            return
        self.stats["dispatch_requests"] += 1
        if len(cmds) > 1:
            self.stats["dispatch_batches"] += 1
        for cmd in cmds:
            self._sequencer.dispatch_sent(cluster, cmd)
        self._first_copy_wait(cluster, cmds, asked)
        asked.reply.add_done_callback(
            lambda reply: self._first_copy_answered(cluster, cmds, asked, reply)
        )

    def _first_copy_wait(self, cluster: str, cmds: list[Dispatch], asked: Asked) -> None:
        """Arm (or arm again) the wait for a first copy's answer."""
        seq = self._sequencer
        wait = seq.ack_wait(cluster, 0)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(
            wait, self._first_copy_unanswered, cluster, cmds, asked, wait, seq.heard(cluster)
        )
        self._first_copies[asked.token] = (asked, timer)

    def _first_copy_answered(
        self, cluster: str, cmds: list[Dispatch], asked: Asked, reply: asyncio.Future[Any]
    ) -> None:
        waiting = self._first_copies.pop(asked.token, None)
        if waiting is None or reply.cancelled():
            return  # its wait ended first (a task took it on), or the leadership did
        waiting[1].cancel()
        alone = len(cmds) == 1
        got = read_ack(cluster, reply) if alone else read_batch_answer(cluster, reply, len(cmds))
        if isinstance(got, str):  # no answer yet: the next copies go out from tasks
            for cmd in cmds:
                self._spawn(self._send_dispatch(cluster, cmd, FirstCopy(None, got)))
            return
        rtt = asyncio.get_running_loop().time() - asked.sent
        self._sequencer.acked(cluster, rtt, dispatch=True)
        for i, cmd in enumerate(cmds):
            ack = got[i] if isinstance(got, list) else got
            if ack.stale_epoch:
                self._spawn(self._dispatch_answered(cluster, cmd, ack))
            elif alone or isinstance(got, list):  # its own ack decides (Sequencer.decides)
                self._dispatch_settled(cluster, cmd, ack)
            else:  # a batch refused as such: each Dispatch is asked alone
                self._spawn(self._send_dispatch(cluster, cmd, FirstCopy(None, ack.error)))

    def _first_copy_unanswered(
        self, cluster: str, cmds: list[Dispatch], asked: Asked, wait: float, heard: int
    ) -> None:
        if self._first_copies.pop(asked.token, None) is None:
            return
        seq = self._sequencer
        waited = asyncio.get_running_loop().time() - asked.sent
        keys = [(cmd.job_id, cmd.attempt) for cmd in cmds]
        if seq.still_busy(cluster, heard, waited, seq.attempts(cmds[0]), keys):
            self.stats["ack_waits_again"] += 1  # busy, not silent: no copy yet
            self._first_copy_wait(cluster, cmds, asked)
            return
        silence = seq.silence(cluster, wait).error
        copies = (
            [asked]
            if len(cmds) == 1
            else SharedReply(asked, cluster, len(cmds), self._requests.forget).parts
        )
        for cmd, copy in zip(cmds, copies, strict=True):
            self._spawn(self._send_dispatch(cluster, cmd, FirstCopy(copy, silence)))

    def _drop_first_copies(self) -> None:
        """The leadership ended: no first copy's answer is this leader's to act on."""
        copies, self._first_copies = self._first_copies, {}
        for asked, timer in copies.values():
            timer.cancel()
            self._requests.forget(asked)

    async def _send_dispatch(
        self, cluster: str, cmd: Dispatch, resumed: FirstCopy | None = None
    ) -> None:
        attempts = self._sequencer.attempts(cmd)
        self._sequencer.dispatch_sent(cluster, cmd)
        ack = await self._request(cluster, encode_msgpack(cmd), attempts, resumed, cmd)
        await self._dispatch_answered(cluster, cmd, ack)

    async def _dispatch_answered(self, cluster: str, cmd: Dispatch, ack: CommandAck) -> None:
        if ack.stale_epoch:
            error, stale = ack.error, ack.epoch
            log.bind(job_id=cmd.job_id, cluster=cluster, attempt=cmd.attempt).warning(
                "broker.stale_epoch", error=error, claimed=stale
            )
            await self._on_stale_epoch(cluster, stale, error)
            if not self.leading.is_set():
                return
        self._dispatch_settled(cluster, cmd, ack)

    def _dispatch_settled(self, cluster: str, cmd: Dispatch, ack: CommandAck) -> None:
        """Tell the core what became of a Dispatch."""
        self._sequencer.dispatch_answered(cmd)
        ok, error = ack.ok, ack.error
        if not ok:
            self.stats["dispatch_failed"] += 1
            log.bind(job_id=cmd.job_id, cluster=cluster, attempt=cmd.attempt).warning(
                "broker.dispatch_failed", error=error
            )
        else:
            self.stats["dispatch_acked"] += 1
            log.info(
                "job dispatched",
                job_id=cmd.job_id,
                cluster=cluster,
                attempt=cmd.attempt,
                flavor=cmd.flavor,
                resume_from_step=cmd.resume_from.step if cmd.resume_from else None,
            )
        machine = self.machine
        if machine is not None:
            self._push(
                machine.handle(
                    DispatchAcked(
                        cmd.job_id,
                        cmd.attempt,
                        ok,
                        error,
                        job_only=ack.job_only,
                        resize_refused=ack.resize_refused,
                    ),
                    self.clock(),
                )
            )

    async def _cancel_until_heard(self, cluster: str, cmd: Cancel, ticket: int) -> None:
        """Ask until the agent acknowledges the Cancel or the sequencer gives up on it (its
        cluster lost), then tell the core (the record stops waiting for it) and send the
        Dispatches it held. A deposed leader sends nothing: its step-down cancels this task
        and resets the sequencer."""
        seq = self._sequencer
        ended: WorkloadStatus | None = None
        while True:
            ack = await self._ask_command(cluster, cmd)
            if ack.ok or ack.stale_epoch or not self.leading.is_set():
                ended = ack.ended if ack.ok else None
                break
            track = self.machine.agents.get(cluster) if self.machine is not None else None
            pause = seq.cancel_again(track.health if track is not None else None)
            if pause is None:
                break
            await asyncio.sleep(pause)
        if not self.leading.is_set():
            return  # deposed meanwhile: what it held is not its to send
        machine = self.machine
        if machine is not None and cmd.attempt is not None:
            settled = CancelSettled(cmd.job_id, cmd.attempt, cluster, ended)
            written = self._push(machine.handle(settled, self.clock()), wait=ended is not None)
            if written is not None:
                # The ending may cancel an attempt this Cancel holds the Dispatch of: the
                # pipeline takes that Cancel (and drops the Dispatch) before the rest goes.
                await written
                if not self.leading.is_set():
                    return
        for held in seq.settled(cmd, ticket):
            self._spawn(self._send_dispatch(held.cluster, held.command))

    async def _send_command(self, cluster: str, cmd: Any) -> bool:
        ack = await self._ask_command(cluster, cmd)
        return ack.ok or ack.stale_epoch

    async def _ask_command(self, cluster: str, cmd: Any) -> CommandAck:
        """The agent's answer to `cmd` (logged when refused; a stale epoch acted on)."""
        ack = await self._request(cluster, encode_msgpack(cmd), self._sequencer.attempts(cmd))
        ok, error, stale = ack.ok, ack.error, (ack.epoch if ack.stale_epoch else None)
        if not ok:
            log.info(
                "broker.command_failed",
                cluster=cluster,
                command=type(cmd).__name__,
                job_id=getattr(cmd, "job_id", None),
                error=error,
            )
        if stale is not None:
            await self._on_stale_epoch(cluster, stale, error)
        return ack

    async def _on_stale_epoch(self, cluster: str, claimed: int, error: str) -> None:
        """An agent refused our epoch. Believed only when it claims a higher epoch than ours
        and the lease confirms a newer leader; checked at most once per
        LEASE_CHECK_MIN_INTERVAL_S, so a storm of such answers costs nothing."""
        epoch = self.lease.epoch
        now = time.monotonic()
        if claimed <= epoch or now - self._lease_check_at < LEASE_CHECK_MIN_INTERVAL_S:
            self.stats["stale_epoch_ignored"] += 1
            return
        self._lease_check_at = now
        if not await self.lease.confirm_newer(epoch):
            self.stats["stale_epoch_ignored"] += 1
            log.warning("broker.stale_epoch_unconfirmed", cluster=cluster, claimed=claimed)
            return
        await self._lose_leadership(f"agent of {cluster!r} saw epoch {claimed}: {error}")
