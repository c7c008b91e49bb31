"""The state every duty of the broker shares, set up in one place.

The broker's duties (process, executor, intake, agent link) are classes of their own that
`broker.service.Broker` composes; each reads and writes the fields made here, and calls
another duty's methods only through the declarations at the end of `BrokerFields`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from broker import tenancy
from broker.agentlink import AgentMailboxes
from broker.core.effects import Effect
from broker.core.machine import Machine
from broker.intake import TokenBuckets, intake_names
from broker.lease import LeaderLease
from broker.metrics import Metrics
from broker.rendezvous import ReplyRendezvous
from broker.sequencer import Held, RecordWrites, Sequencer
from broker.snapshotwriter import Snapshots
from broker.store import JobStore, RecordMirror
from schemas.config import BrokerConfig
from schemas.natsopts import NatsOptions
from schemas.subjects import Subjects
from shell.gcpacing import GcPacer
from shell.natsio import Asked, Requester


class BrokerFields:
    """The broker's shared state; `broker.service.Broker` adds its duties."""

    def __init__(
        self,
        config: BrokerConfig,
        nc: Client,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
        pace_gc: bool = False,
        agent_nc: Client | None = None,
        nats_options: NatsOptions | None = None,
    ) -> None:
        """`pace_gc`: manage the process's cycle collector (GcPacer); the `muster broker`
        process turns it on, an in-process broker (tests) leaves the host's GC alone.
        `agent_nc`: a connection of its own for the agents' event subjects, so that however
        much agents send, nats-server can only cut that one as a slow consumer, never the
        connection that holds the lease, the store, the API and the submissions.
        `nats_options`: how to reach NATS from another process, for the job bucket's snapshot
        writer (broker/snapshotwriter.py); without them no snapshot is written."""
        self.config = config
        self.nc = nc
        self.agent_nc = agent_nc or nc
        self.js = nc.jetstream(timeout=10)
        self.subjects = Subjects(prefix=config.subject_prefix)
        self._team_queues = tenancy.team_queues(config)
        self._team_of_queue = tenancy.team_of_queue(config)
        self._intake_names = frozenset(intake_names(config))  # subjects a submission may name
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.clock = clock
        self.machine: Machine | None = None
        self.store: JobStore | None = None
        self.mirror: RecordMirror | None = None  # while standing by (see run)
        self.lease = LeaderLease(
            self.js,
            self.subjects.leader_bucket,
            self.holder,
            config.timeouts.lease_ttl_s,
            max_bytes=config.limits.lease_bucket_max_bytes,
            replication=config.replication,
            nc=nc,
            alive_subject=self.subjects.lease_alive,
        )
        self.leading = asyncio.Event()
        self.stopped = asyncio.Event()
        self._wake = asyncio.Event()
        self._queue: asyncio.Queue[tuple[list[Effect], asyncio.Future[None] | None]] = (
            asyncio.Queue()
        )
        self._tasks: list[asyncio.Task[Any]] = []
        self._subs: list[Any] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.stats = {
            "submitted": 0,
            "rejected": 0,
            "batches": 0,
            "events": 0,
            "bad_batches": 0,
            "dispatch_acked": 0,
            "dispatch_failed": 0,
            "dispatch_requests": 0,  # first copies of Dispatches sent: one job or a batch
            "dispatch_batches": 0,  # of them, requests that carried several Dispatches
            "dead_lettered": 0,
            "held_for_storage": 0,
            "put_back_for_storage": 0,
            "storage_full_rejections": 0,
            "store_quota_rejections": 0,
            "agent_dropped": 0,
            "rate_limited": 0,
            "stale_epoch_ignored": 0,
            "redispatched": 0,
            "ack_retries": 0,
            "late_acks": 0,
            "ack_waits_again": 0,  # waits started again for a busy agent, with no copy sent
            "lead_failures": 0,
            "newer_records": 0,
            "store_records_lost": 0,
            "store_records_repersisted": 0,
            "records_put": 0,  # record writes acknowledged by the store (deferred ones merged)
            "restored_from_snapshot": 0,  # the last sequence of the snapshot restored from
        }
        # Messages refused by a handler's boundary (bad input or a failure processing it),
        # by handler: the broker answers or drops them with a reason and carries on.
        self.refused: Counter[str] = Counter()
        # stream sequence -> deliveries this process gave up on while their records waited
        # for the store (it stepped down): not the message's fault, so not counted as poison
        self._excused: OrderedDict[int, int] = OrderedDict()
        # The store refused a write for lack of space: a record (until one persists) or the
        # probe (until one lands). Either refuses new submissions.
        self._persist_full = False
        self._probe_full = False
        self._buckets = TokenBuckets(config.limits.submit_rate_per_s, config.limits.submit_burst)
        self._id_key = b""
        self._applied_sent: dict[str, tuple[str, int]] = {}
        self._applied_busy: set[str] = set()
        # cluster -> the writes its batches' Applied waits for: a Dispatch to the cluster lets
        # out first the Applied of a batch whose records are written (`_dispatch_all`)
        self._applied_due: dict[str, set[asyncio.Future[None]]] = {}
        self._applied_at: dict[str, float] = {}
        self._lease_check_at = -1e18
        self._epoch_recorded = 0  # the epoch last written to the job bucket (see _take_epoch)
        self._mail: AgentMailboxes | None = None  # per-cluster agent budgets, while leading
        self._mail_wake = asyncio.Event()
        self._budget_logged: dict[str, float] = {}
        self._wire_refused_at: dict[str, float] = {}  # cluster -> when last logged and told
        # cluster -> the wire version of its agent's last batch: whether it takes several
        # Dispatches in one request (broker/dispatchbatches.py)
        self._agent_wires: dict[str, str] = {}
        self._rendezvous = ReplyRendezvous(
            nc, config.max_payload_bytes, self._storage_error, self._early_reply, self.refused
        )
        self._requests = Requester(nc)
        # Dispatches whose first copy awaits its ack without a task (broker/executor.py):
        # reply token -> (the copy, the timer that hands it to a task when its wait ends)
        self._first_copies: dict[str, tuple[Asked, asyncio.TimerHandle]] = {}
        # The effect rules (barrier, retries, learnt ack waits), driven by broker/executor.py
        self._sequencer = Sequencer(config.timeouts)
        # Which records go to the store now and which wait (deferred writes), and when the
        # pipeline is woken for the first that falls due (event-loop time; None: not armed).
        self._writes = RecordWrites(config.timeouts.deferred_write_s)
        self._writes_wake: float | None = None
        # A clean stop while leading: every deferred record is due at once (`_hand_over`).
        self._handing_over = False
        self._unwritten = 0  # records of the put the pipeline is retrying (NATS refusing it)
        self.metrics = Metrics(self)
        self._gc = GcPacer() if pace_gc else None
        self._next_cycle = 0.0  # event-loop time before which no admission cycle starts
        self.restore_s = 0.0
        self.restored_jobs = 0
        self.nats_options = nats_options
        # When the job bucket's snapshot is written; while leading with nats_options.
        self.snapshots: Snapshots | None = None

    # -- views and nudges for callers beside the duties (tests, the dashboard) -------------
    @property
    def rendezvous(self) -> ReplyRendezvous:
        """Answers retries of a submission whose first copy the stream never stored."""
        return self._rendezvous

    def attempt_token(self, job_id: str, attempt: int) -> str:
        """The secret this attempt's workload is dispatched with to report its checkpoints."""
        return self._attempt_token(job_id, attempt)

    def held_dispatches(self) -> list[Held]:
        """Dispatches waiting behind the Cancel of the attempt before them."""
        return self._sequencer.held()

    def wake(self) -> None:
        """Run the machine loop now, for a caller that changed the machine directly."""
        self._wake.set()

    def drained(self) -> asyncio.Future[None]:
        """Done once every effect pushed so far has run (a marker queued behind them)."""
        marker = self._push([], wait=True)
        assert marker is not None  # wait=True always queues one
        return marker

    if TYPE_CHECKING:  # one duty's methods that another calls (defined by the duties)

        @property
        def storage_full(self) -> bool: ...

        def agent_drops(self) -> dict[tuple[str, str], int]: ...

        def _spawn(self, coro: Any) -> None: ...

        def _push(
            self, effects: list[Effect], *, wait: bool = False
        ) -> asyncio.Future[None] | None: ...

        async def _pipeline(self) -> None: ...

        def _attempt_token(self, job_id: str, attempt: int) -> str: ...

        async def _send_command(self, cluster: str, cmd: Any) -> bool: ...

        def _drop_first_copies(self) -> None: ...

        async def _lose_leadership(self, why: str) -> None: ...

        async def _submissions(self) -> None: ...

        def _storage_error(self) -> str | None: ...

        async def _probe_storage(self) -> None: ...

        def _early_reply(self, msg: Msg) -> bytes | None: ...

        async def _on_agent_batch(self, msg: Msg) -> None: ...

        async def _agent_worker(self) -> None: ...

        async def _on_sdk_checkpoint(self, msg: Msg) -> None: ...

        async def _on_api(self, msg: Msg) -> None: ...

        def _team_of_job(self, job_id: str) -> str | None: ...

        async def _clock_loop(self) -> None: ...
