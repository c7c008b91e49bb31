"""The broker's effect rules, sans-IO: in which order a batch of the core's effects is carried
out, which Dispatch waits behind which Cancel, when a command is asked again and how long its
ack is waited for, and the token each Dispatch carries.

Synchronous and clock-free (times come in as arguments, as in `agents/gate.py`), so the rules
exist once: `broker/executor.py` drives a `Sequencer` from asyncio and NATS, and both
deterministic simulations (`load/vopr.py`, `load/sim/loop.py`) drive the same object from
their virtual clocks. The rules:

- **persist first**: the records of a batch are written before any of its commands or events
  leave; those then go out in the order the machine produced them;
- **deferred writes** (`RecordWrites`): a `Persist(deferred=True)` is a change nothing waits
  on and a restore without it handles (an attempt found running; the lifecycle argues it,
  and why a dispatch's ack is not one). It is written at most `timeouts.deferred_write_s`
  after the job's first deferred change, or with the job's next urgent write if that comes
  first, always as the record is then (the newest state); a job forgotten meanwhile is not
  written back, and a leadership that ends drops what waits, as a crash would;
- **Cancel before Dispatch**: a Dispatch whose `Send.after_cancel_of` names attempts with a
  Cancel in flight is held until every one of those Cancels is acknowledged or given up on
  (its cluster declared lost: the fence, minutes long, has lapsed by then). When one
  attempt's Cancel is sent again while an older copy is in flight, the newest one decides.
  Which attempts may still run is the job record's fact (`AttemptRecord.cancel_unacked`);
  this object only knows the Cancels this leader has in flight, and a new leader's core
  sends every unacknowledged one again before any Dispatch, so the two cannot disagree
  across a restart. The driver feeds `CancelSettled` to the core when a Cancel settles;
- **Cancels are resent** until heard or their cluster is lost;
- **Applied**: an agent's batch is acknowledged only when the core applied it in full (not a
  replay it refused, nor a batch out of sequence it answered with a resync), once its records
  are written, and before any Dispatch to its cluster that leaves after that, unless an
  earlier Applied of the cluster is still in flight (the driver's `_dispatch_all`: the agent
  refuses a Dispatch while the broker has not acknowledged it for the fence); one without
  outcomes at most every `APPLIED_EVERY_S` per cluster;
- **retries**: a command is asked `attempts` times, each copy waited for as long as the
  cluster's acks take (`broker/ackwait.py`), with a short pause when nothing reached the wire;
  the ack of any copy counts, and a refusal does not outvote a later copy still unanswered;
  a Dispatch's wait that ends while its cluster moved on other Dispatches of ours starts
  again instead (`still_busy`: a busy agent is not asked again);
- **the token**: a keyed hash of (job, attempt), pure, so the core stamps it on the Dispatch it
  builds (`Machine(dispatch_token=...)`) and nobody edits the command afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from broker.ackwait import AckWaits
from broker.core.effects import Effect, Forget, Persist, applied
from broker.core.records import JobRecord
from schemas.agent import (
    TERMINAL_PHASES,
    Cancel,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    EventBatch,
    WorkloadStatus,
)
from schemas.config import Timeouts

COMMAND_ATTEMPTS = 3  # copies of a command other than a Dispatch (dispatch_retries + 1 for it)
EMPTY_PAUSE_S = 0.1  # first pause when a copy could not be sent at all; doubles per copy
EMPTY_PAUSE_MAX_S = 2.0
APPLIED_EVERY_S = 0.5  # batches without outcomes are acknowledged this often (fence renewal)

GATHER_S = 0.1  # deferred records due this soon after one that is due are written with it
AttemptKey = tuple[str, int]  # (job, attempt)
CancelKey = tuple[str, int | None]  # (job, attempt) of a Cancel (None: every attempt)


def attempt_token(key: bytes, job_id: str, attempt: int) -> str:
    """The secret that lets one attempt's workload report its own checkpoints."""
    basis = f"checkpoint:{job_id}:{attempt}".encode()
    return hashlib.blake2b(basis, key=key, digest_size=16).hexdigest()


def persist_first(batches: Iterable[Sequence[Effect]]) -> list[JobRecord]:
    """The newest record of each job the batches persist: written (in one put) before any
    other effect of these batches is carried out."""
    records: dict[str, JobRecord] = {}
    for effects in batches:
        for eff in effects:
            if isinstance(eff, Persist):
                records[eff.record.job_id] = eff.record
    return list(records.values())


class RecordWrites:
    """The records to write before a batch's other effects, and the deferred ones waiting.

    A deferred record waits at most `delay_s` from the job's first deferred change; an urgent
    write of the job carries it (the record object is the job's live one, so what is written
    is its newest state). Entries are kept in the order they fall due: every one waits the
    same `delay_s` from when it was filed, so the first is always the earliest, and a take
    walks only the entries it writes."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.gather_s = min(GATHER_S, delay_s / 4)
        self._waiting: dict[str, tuple[float, JobRecord]] = {}  # job -> (due, record)

    def take(self, batches: Iterable[Sequence[Effect]], now: float) -> list[JobRecord]:
        """The newest record of each job to write now: every urgent one of `batches`, and every
        deferred one due by `now`; the other deferred ones are filed to wait."""
        urgent: dict[str, JobRecord] = {}
        waiting = self._waiting
        for effects in batches:
            for eff in effects:
                if isinstance(eff, Persist):
                    job = eff.record.job_id
                    if not eff.deferred or self.delay_s <= 0:
                        urgent[job] = eff.record
                    elif job in waiting:
                        waiting[job] = (waiting[job][0], eff.record)
                    else:
                        waiting[job] = (now + self.delay_s, eff.record)
                elif isinstance(eff, Forget):
                    waiting.pop(eff.job_id, None)  # deleted: never written back
        for job in urgent:
            waiting.pop(job, None)  # carried by the urgent write
        for job in self._due(now):
            urgent[job] = waiting.pop(job)[1]
        return list(urgent.values())

    def _due(self, now: float) -> list[str]:
        """The waiting jobs to write now: none while the first is not due; once it is, every
        one due within `gather_s` more, so at a steady pace the deferred records go out in a
        few large writes rather than one write per pipeline turn (a record written early is
        still within its bound). Walks only those: the rest wait in order behind them."""
        last = now + self.gather_s
        taken: list[str] = []
        for job, (due, _) in self._waiting.items():
            if due > (last if taken else now):
                break
            taken.append(job)
        return taken

    def due_at(self) -> float | None:
        """When the first waiting record falls due; None when none waits."""
        for due, _ in self._waiting.values():
            return due
        return None

    def waiting(self) -> int:
        return len(self._waiting)

    def reset(self) -> None:
        """The leadership ended: what waits is not this one's to write (as after a crash)."""
        self._waiting.clear()


KEPT_EVENTS = frozenset({CheckpointReport, ClusterSnapshot})  # an agent keeps them until told


def outcomes(batch: EventBatch) -> bool:
    """Whether the batch carries what an agent keeps until the broker acknowledges it. Read
    for most batches of a busy agent (500 events each), so by exact type."""
    for event in batch.events:
        if type(event) in KEPT_EVENTS:
            return True
        if isinstance(event, WorkloadStatus) and event.phase in TERMINAL_PHASES:
            return True
    return False


def acknowledges(
    effects: Sequence[Effect], batch: EventBatch, now: float, last: float | None
) -> bool:
    """Whether an Applied for `batch` goes to its agent, given the core's `effects` for it and
    when this cluster's last batch was acknowledged (`last`, None: never). The agent drops
    what it kept and renews its fences from it, so only a batch applied in full counts."""
    if applied(effects) is None:
        return False
    return last is None or now - last >= APPLIED_EVERY_S or outcomes(batch)


def reported_attempts(batch: EventBatch) -> list[AttemptKey]:
    """The attempts a batch reports a phase of: Dispatches carried out on that cluster (an
    agent reports nothing of an attempt before its Dispatch is done, and the first phase may
    already be `running`), which tell a busy agent's command path from a silent one
    (broker/ackwait.py)."""
    return [(e.job_id, e.attempt) for e in batch.events if type(e) is WorkloadStatus]


@dataclass(frozen=True, slots=True)
class Held:
    """A Dispatch waiting for the Cancels of the earlier attempts it is ordered after."""

    cluster: str
    command: Dispatch
    after: tuple[int, ...] = ()


def _cancels(cancel: Cancel, dispatch: Dispatch) -> bool:
    """Whether `cancel` ends the attempt `dispatch` would start."""
    return cancel.job_id == dispatch.job_id and cancel.attempt in (None, dispatch.attempt)


class Sequencer:
    """The barrier and the retry decisions of one leadership (`reset` when it ends); the
    learnt ack waits outlive it (they describe the clusters, not the leader)."""

    def __init__(self, timeouts: Timeouts, waits: AckWaits | None = None) -> None:
        self.timeouts = timeouts
        self.waits = waits if waits is not None else AckWaits(timeouts)
        self._ticket = 0
        self._cancels: dict[CancelKey, int] = {}  # (job, attempt) -> newest Cancel's ticket
        self._held: dict[CancelKey, list[Held]] = {}
        # Dispatches sent and not answered yet -> (their cluster, whether it reported them)
        self._awaiting: dict[AttemptKey, tuple[str, bool]] = {}

    # -- the barrier ---------------------------------------------------------------------
    def cancel(self, cmd: Cancel) -> int:
        """A Cancel goes out: Dispatches ordered after it wait until `settled(ticket)`, and a
        Dispatch of the attempt it cancels still held never leaves (the core gave it up)."""
        for key, held in list(self._held.items()):
            kept = [h for h in held if not _cancels(cmd, h.command)]
            if len(kept) < len(held):
                if kept:
                    self._held[key] = kept
                else:
                    del self._held[key]
        self._ticket += 1
        self._cancels[(cmd.job_id, cmd.attempt)] = self._ticket
        return self._ticket

    def dispatch(self, cluster: str, cmd: Dispatch, after: tuple[int, ...]) -> bool:
        """True: send now. False: held behind a Cancel in flight of an attempt in `after`."""
        if not after or not self._cancels:  # nothing to wait for: the common case
            return True
        return self._hold(Held(cluster, cmd, after))

    def _hold(self, held: Held) -> bool:
        """File `held` under the first Cancel in flight it waits for; True when there is none."""
        job = held.command.job_id
        key = next(((job, a) for a in held.after if (job, a) in self._cancels), None)
        if key is None:
            return True
        self._held.setdefault(key, []).append(held)
        return False

    def settled(self, cmd: Cancel, ticket: int) -> list[Held]:
        """The Cancel with `ticket` was acknowledged or given up on (its cluster lost): the
        Dispatches it held that wait for no other Cancel in flight, to send now. An older
        copy settling releases nothing while a newer Cancel of the same attempt is in flight."""
        key = (cmd.job_id, cmd.attempt)
        if self._cancels.get(key) != ticket:
            return []
        del self._cancels[key]
        return [h for h in self._held.pop(key, []) if self._hold(h)]

    def in_flight(self) -> int:
        """Cancels still waited on."""
        return len(self._cancels)

    def held(self) -> list[Held]:
        return [h for hs in self._held.values() for h in hs]

    def reset(self) -> None:
        """The leadership ended (or the broker crashed): nothing held is sent by this one."""
        self._cancels.clear()
        self._held.clear()
        self._awaiting.clear()

    # -- retries -------------------------------------------------------------------------
    def attempts(self, cmd: object) -> int:
        """How many copies of `cmd` are asked before its silence counts as a refusal."""
        if isinstance(cmd, Dispatch):
            return self.timeouts.dispatch_retries + 1
        return COMMAND_ATTEMPTS

    def ack_wait(self, cluster: str, copy: int) -> float:
        """How long the ack of copy number `copy` (0 = the first send) is waited for."""
        return self.waits.of(cluster).wait(copy)

    def acked(self, cluster: str, rtt: float, *, dispatch: bool = False) -> None:
        """An ack came `rtt` seconds after the copy it answers left; `dispatch`: it answered
        a Dispatch (or a batch of them), so the cluster's Dispatch path moves."""
        wait = self.waits.of(cluster)
        wait.observe(rtt)
        if dispatch:
            wait.heard += 1

    # -- a busy agent (broker/ackwait.py) --------------------------------------------------
    def dispatch_sent(self, cluster: str, cmd: Dispatch) -> None:
        """A Dispatch went out: its cluster's reports of it are watched until it is answered."""
        self._awaiting.setdefault((cmd.job_id, cmd.attempt), (cluster, False))

    def dispatch_answered(self, cmd: Dispatch) -> None:
        self._awaiting.pop((cmd.job_id, cmd.attempt), None)

    def carried_out(self, cluster: str, batch: EventBatch) -> None:
        """The cluster's batch reported attempts: each one of ours awaiting its ack was
        carried out there, which is progress for the others it has not answered yet."""
        if not self._awaiting:
            return  # nothing is waited for: the batch is not read
        for key in reported_attempts(batch):
            if self._awaiting.get(key) == (cluster, False):
                self._awaiting[key] = (cluster, True)
                self.waits.of(cluster).heard += 1

    def heard(self, cluster: str) -> int:
        """How often the cluster's Dispatch path was heard from so far (only changes count)."""
        return self.waits.of(cluster).heard

    def still_busy(
        self, cluster: str, heard: int, waited: float, copies: int, keys: Iterable[AttemptKey]
    ) -> bool:
        """Whether the Dispatches `keys`, whose copy's wait just ended unanswered, are waited
        for again instead of asked again: their cluster answered or carried out other
        Dispatches since that wait began (`heard`: `self.heard` then), one of them is still
        not reported by its cluster (one that was is carried out: its answer was lost or is
        slow, and a copy is acknowledged at once), and they have been waited for `waited` seconds,
        under their patience."""
        wait = self.waits.of(cluster)
        if wait.heard <= heard or waited >= wait.patience(copies):
            return False
        return any(self._awaiting.get(key) == (cluster, False) for key in keys)

    @staticmethod
    def decides(ack: CommandAck, outstanding: bool) -> bool:
        """Whether this ack is the command's answer. A refusal is not while another copy is
        still unanswered: the agent runs a job's commands one after the other, so a later
        copy may yet be carried out, and then its ack is the truth. (A refusal kept is the
        answer once the wait for the copy then in flight ends.)"""
        return ack.ok or ack.stale_epoch or not outstanding

    @staticmethod
    def silence(cluster: str, wait: float) -> CommandAck:
        """The refusal this side makes of an agent's silence."""
        return CommandAck(
            ok=False, error=f"agent of cluster {cluster!r} did not ack in {wait:.3g}s"
        )

    @staticmethod
    def empty_pause(copy: int) -> float:
        """Nothing reached the wire (no connection): pause this long before the next copy."""
        return min(EMPTY_PAUSE_S * (1 << min(copy, 30)), EMPTY_PAUSE_MAX_S)

    def cancel_again(self, health: str | None) -> float | None:
        """Every copy of a Cancel went unheard: ask again after this many seconds, or None
        to give up (the cluster is lost or gone: its fence has ended the attempt)."""
        if health is None or health == "lost":
            return None
        return self.timeouts.dispatch_ack_s
