"""Per-agent budgets: what one cluster's agent may cost the broker.

Every batch an agent publishes used to be decoded and applied in the subscription callback, one
after the other without yielding: an agent sending large snapshots as fast as it could kept the
event loop busy for seconds, so the API went unanswered, the socket unread, and nats-server cut
the broker off as a slow consumer. Now the callback only files the raw batch in its cluster's
mailbox (`AgentMailboxes.offer`, no decoding), and the broker's agent worker takes batches from
the mailboxes in turn, as each cluster's budget allows (`take`), yielding after every batch:

- snapshots coalesce: a snapshot replaces everything its cluster had waiting (it replaces all
  the broker knows of the cluster anyway, and the agent repeats unacknowledged outcomes in it),
  so the newest wins and a storm costs one apply per `agent_snapshots_per_s`;
- a token bucket per cluster on messages and on bytes (`agent_msgs_per_s`, `agent_bytes_per_s`
  with their bursts) paces the rest; a batch over it waits in the mailbox;
- a mailbox holds at most `agent_pending_bytes`; a batch beyond it is dropped and counted (the
  sequence gap makes the broker ask for a snapshot, at most once a second).

A storm thus costs its own cluster freshness, never the broker's liveness; the counters name
the cluster (`muster_agent_batches_dropped_total{cluster,reason}`, the log line
`broker.agent_over_budget`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from schemas.config import Limits

# How a snapshot event starts in an msgpack EventBatch (tag field "type"): looked for in the
# first bytes only. A false match only coalesces early; a missed one only does not coalesce.
SNAPSHOT_MARK = b"\xa4type\xa8snapshot"
SNAPSHOT_SCAN = 512
MAX_MAILBOXES = 8192  # clusters with a mailbox at once; batches of one more are dropped
SNAPSHOT_BURST = 3.0  # snapshots one cluster may send back to back (connect, resyncs)


@dataclass(slots=True)
class Bucket:
    rate: float
    burst: float
    tokens: float
    at: float

    def refill(self, now: float) -> None:
        if self.rate <= 0:
            self.tokens = self.burst
        else:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def ready(self, cost: float) -> bool:
        """A cost above the burst passes once the bucket is full (a large snapshot is not
        refused forever, only paced)."""
        return self.tokens >= min(cost, self.burst)

    def wait(self, cost: float) -> float:
        need = min(cost, self.burst) - self.tokens
        return 0.0 if need <= 0 or self.rate <= 0 else need / self.rate


@dataclass(slots=True)
class Mailbox:
    msgs: Bucket
    volume: Bucket
    snapshots: Bucket
    queue: deque[tuple[bytes, bool]] = field(default_factory=deque)  # (batch, is snapshot)
    pending: int = 0  # bytes waiting
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> batches
    applied: int = 0


class AgentMailboxes:
    def __init__(self, limits: Limits, now: float) -> None:
        self._limits = limits
        self._boxes: dict[str, Mailbox] = {}
        self._order: deque[str] = deque()  # clusters with something waiting, in turn
        self.dropped_unknown = 0  # batches of clusters beyond MAX_MAILBOXES

    def _box(self, cluster: str, now: float) -> Mailbox | None:
        box = self._boxes.get(cluster)
        if box is None:
            if len(self._boxes) >= MAX_MAILBOXES:
                return None
            lim = self._limits
            box = self._boxes[cluster] = Mailbox(
                msgs=Bucket(lim.agent_msgs_per_s, lim.agent_burst_msgs, lim.agent_burst_msgs, now),
                volume=Bucket(
                    lim.agent_bytes_per_s, lim.agent_burst_bytes, lim.agent_burst_bytes, now
                ),
                snapshots=Bucket(lim.agent_snapshots_per_s, SNAPSHOT_BURST, SNAPSHOT_BURST, now),
            )
        return box

    def offer(self, cluster: str, data: bytes, now: float) -> str | None:
        """File a batch; the reason when it was dropped instead (or what it superseded)."""
        box = self._box(cluster, now)
        if box is None:
            self.dropped_unknown += 1
            return "too-many-clusters"
        snapshot = data.find(SNAPSHOT_MARK, 0, SNAPSHOT_SCAN) >= 0
        waiting = bool(box.queue)  # then the cluster already has its turn in `_order`
        why = None
        if snapshot and waiting:
            # The newest snapshot replaces whatever the cluster had waiting.
            self._drop(box, "coalesced", len(box.queue))
            why = "coalesced"
            box.queue.clear()
            box.pending = 0
        elif box.pending + len(data) > self._limits.agent_pending_bytes and box.queue:
            self._drop(box, "over-budget", 1)
            return "over-budget"
        if not waiting:
            self._order.append(cluster)
        box.queue.append((data, snapshot))
        box.pending += len(data)
        return why

    def take(self, now: float) -> tuple[str, bytes] | float:
        """The next batch some cluster's budget allows, clusters in turn; else how long until
        one may go (seconds; 0.5 when nothing waits)."""
        wait = 0.5
        for _ in range(len(self._order)):
            cluster = self._order.popleft()
            box = self._boxes[cluster]
            data, snapshot = box.queue[0]
            box.msgs.refill(now)
            box.volume.refill(now)
            box.snapshots.refill(now)
            if (
                box.msgs.ready(1)
                and box.volume.ready(len(data))
                and (not snapshot or box.snapshots.ready(1))
            ):
                box.queue.popleft()
                box.pending -= len(data)
                box.msgs.tokens -= 1
                box.volume.tokens -= min(len(data), box.volume.burst)
                if snapshot:
                    box.snapshots.tokens -= 1
                box.applied += 1
                if box.queue:
                    self._order.append(cluster)
                return cluster, data
            self._order.append(cluster)
            later = max(
                box.msgs.wait(1),
                box.volume.wait(len(data)),
                box.snapshots.wait(1) if snapshot else 0.0,
            )
            wait = min(wait, later)
        return max(wait, 0.001)

    def dropped(self) -> dict[tuple[str, str], int]:
        """(cluster, reason) -> batches dropped so far."""
        return {
            (cluster, reason): n
            for cluster, box in list(self._boxes.items())
            for reason, n in list(box.dropped.items())
        }

    @staticmethod
    def _drop(box: Mailbox, reason: str, n: int) -> None:
        box.dropped[reason] = box.dropped.get(reason, 0) + n
