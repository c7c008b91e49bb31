"""Agent-stream tracking: which batches of a cluster's agent to apply (instance, sequence,
replays, resyncs) and how healthy each cluster is.

The health of a cluster has one owner, `AgentTracker`; the scheduler's schedulable flag is
derived from it in one place (`_set_health`) and never set elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.core.effects import Effect, Refused, Send
from broker.core.scheduler import Scheduler
from schemas.agent import ClusterSnapshot, EventBatch, Resync
from schemas.api import ClusterHealth
from schemas.config import Timeouts

RESYNC_MIN_INTERVAL_S = 1.0
MAX_CLUSTERS = 4096  # clusters known at once; a snapshot from one more is refused
RETIRED_INSTANCES = 16  # per cluster: batches from these old agent instances are replays


@dataclass(slots=True)
class AgentTrack:
    """What the broker knows about one cluster's agent connection."""

    instance: str | None = None
    seq: int = 0
    synced: bool = False  # a snapshot of the current instance has been applied
    last_heard: float = 0.0
    health: ClusterHealth = "healthy"
    last_resync: float = -1e18
    stale_s: float = 0.0  # the agent's cluster watches have been failing this long
    retired: list[str] = field(default_factory=list)  # earlier instances, newest last


@dataclass(slots=True)
class Admitted:
    """A batch to apply: its events from `start` on (a snapshot, when out of sequence)."""

    track: AgentTrack
    start: int
    recovered: bool  # the cluster was unreachable or lost and speaks again


class AgentTracker:
    def __init__(self, scheduler: Scheduler, epoch: int) -> None:
        self.scheduler = scheduler
        self.epoch = epoch
        self.tracks: dict[str, AgentTrack] = {}
        # Resyncs asked of clusters that have not sent a snapshot yet (no track exists), so a
        # bare heartbeat under a made-up name costs a bounded entry here and nothing else.
        self._unknown_resync: dict[str, float] = {}

    def admit(self, cluster: str, batch: EventBatch, now: float) -> Admitted | list[Effect]:
        """Whether to apply the batch, and from which event; or the effects of not applying
        it (a refusal, or a resync request)."""
        if batch.cluster != cluster:
            return [
                Refused(
                    f"batch claims cluster {batch.cluster!r} but arrived on the subject of "
                    f"cluster {cluster!r}; rejected"
                )
            ]
        events = batch.events
        track = self.tracks.get(cluster)
        if track is not None and (
            batch.instance in track.retired
            or (batch.instance == track.instance and batch.seq <= track.seq)
        ):
            return [
                Refused(
                    f"batch {batch.seq} of agent instance {batch.instance!r} of cluster "
                    f"{cluster!r} is older than one already applied (a replay); ignored"
                )
            ]
        in_sequence = (
            track is not None
            and track.instance == batch.instance
            and track.synced
            and batch.seq == track.seq + 1
        )
        # Only a batch out of sequence needs its snapshot found (the common case skips the scan).
        snap_at = (
            None
            if in_sequence
            else next((i for i, e in enumerate(events) if isinstance(e, ClusterSnapshot)), None)
        )
        if track is None:
            if snap_at is None:
                # Clusters exist only from a snapshot: ask for one, remember nothing else.
                return self._resync_unknown(cluster, now)
            if len(self.tracks) >= MAX_CLUSTERS:
                return [
                    Refused(f"cluster {cluster!r} refused: {MAX_CLUSTERS} clusters already known")
                ]
            self._unknown_resync.pop(cluster, None)
            track = self.tracks[cluster] = AgentTrack(last_heard=now)
        was = track.health
        track.last_heard = now
        self._retire(track, batch.instance)
        track.instance = batch.instance
        track.seq = batch.seq
        if not in_sequence and snap_at is None:
            track.synced = False
            return self.resync(cluster, track, now, "sequence gap or unknown agent")
        if was != "healthy":
            self._set_health(cluster, track, "healthy")
        return Admitted(track, snap_at or 0, was != "healthy")

    def resync(self, cluster: str, track: AgentTrack, now: float, why: str) -> list[Effect]:
        if now - track.last_resync < RESYNC_MIN_INTERVAL_S:
            return []
        track.last_resync = now
        return [Send(cluster, Resync(epoch=self.epoch, reason=why))]

    def silent(self, now: float, timeouts: Timeouts) -> list[str]:
        """Mark clusters unreachable or lost by how long their agents have been silent; the
        ones newly lost are returned (their jobs are lost with them)."""
        lost: list[str] = []
        for cluster, track in self.tracks.items():
            silent = now - track.last_heard
            if silent > timeouts.lost_after_s and track.health != "lost":
                self._set_health(cluster, track, "lost")
                track.synced = False
                track.instance = None
                lost.append(cluster)
            elif silent > timeouts.unreachable_after_s and track.health == "healthy":
                self._set_health(cluster, track, "unreachable")
        return lost

    def healthy(self, cluster: str) -> bool:
        """Whether the cluster's agent was heard lately (a Cancel sent now will be heard)."""
        track = self.tracks.get(cluster)
        return track is not None and track.health == "healthy"

    def lost_cause(self, cluster: str, now: float, timeouts: Timeouts) -> str:
        """Why a silent cluster's attempts end: its fence (granted while the broker heard the
        agent) has lapsed, an infrastructure loss, never charged to a job's error budget."""
        if timeouts.fence_window_s <= 0:
            return "cluster-lost"
        track = self.tracks.get(cluster)
        silent = now - track.last_heard if track is not None else timeouts.lost_after_s
        return f"fenced: cluster {cluster} unreachable for {silent:.0f} s"

    def assume(self, cluster: str, now: float) -> None:
        """After a restart: a cluster that runs a restored attempt is tracked until it
        speaks (or is declared lost for its silence)."""
        if cluster not in self.tracks:
            self.tracks[cluster] = AgentTrack(last_heard=now)

    def _set_health(self, cluster: str, track: AgentTrack, health: ClusterHealth) -> None:
        track.health = health
        if health == "lost":
            return  # the scheduler forgets the cluster (`remove_cluster`) instead
        self.scheduler.set_cluster_schedulable(cluster, health == "healthy")

    @staticmethod
    def _retire(track: AgentTrack, instance: str) -> None:
        """A new agent instance replaces the current one, which may never speak again."""
        old = track.instance
        if old is not None and old != instance and old not in track.retired:
            track.retired.append(old)
            del track.retired[:-RETIRED_INSTANCES]

    def _resync_unknown(self, cluster: str, now: float) -> list[Effect]:
        asked = self._unknown_resync
        if now - asked.get(cluster, -1e18) < RESYNC_MIN_INTERVAL_S:
            return []
        if len(asked) >= MAX_CLUSTERS:
            stale = [c for c, t in asked.items() if now - t >= RESYNC_MIN_INTERVAL_S]
            for c in stale:
                del asked[c]
            if len(asked) >= MAX_CLUSTERS:
                return []
        asked[cluster] = now
        return [Send(cluster, Resync(epoch=self.epoch, reason="unknown agent"))]
