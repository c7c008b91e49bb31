"""The agent's command gate: which of the broker's commands an agent obeys.

Sans-IO and synchronous, so the rules that keep "never two copies" on the agent's side exist
once: `AgentRuntime` drives it from NATS, and the deterministic simulation (`load/vopr.py`)
drives the same object from its virtual clock. The rules:

- **epoch**: a command from an older epoch than one already seen comes from a deposed leader
  and is refused (`stale_epoch`, with the newest epoch seen);
- **highest attempt**: a Dispatch older than the newest attempt created here is refused; the
  same attempt again is a duplicate (acknowledged, nothing created), unless it carries a newer
  placement revision (an elastic gang resized in place);
- **cancelled up to**: once the broker cancels an attempt (or the agent fences it), a late
  Dispatch of it or of any older attempt is refused;
- **supersede**: a newer attempt first ends the older live ones of the same job;
- **fence lapsed**: a Dispatch that would create an attempt is refused once the broker has not
  acknowledged this cluster for the attempt's fence window (`fence_after_s`), counted from
  when the newest batch it acknowledged left (`heard`): by then the broker may have declared
  the cluster lost and started the job elsewhere. A Dispatch read late (it waited in the
  socket of an agent that was frozen, or starved of CPU) must not start a second copy, and
  a new attempt's fence counts from that same moment (`fence_base`), never from when its
  Dispatch arrived, which proves nothing of what the broker heard. Before the broker has
  acknowledged any batch of this process, both count from when the process subscribed
  (`started`): no Dispatch it reads was sent earlier, but one can wait in its socket for as
  long as the process is stopped.

The gate only decides and records; the caller acts on the backend between `judge` and `ran`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from schemas.agent import CommandAck, Dispatch

MAX_TRACKED_JOBS = 500_000  # memory bound on per-job idempotency records


@dataclass(slots=True)
class JobTrack:
    """What this agent knows about one job: the newest attempt it created, the attempts still
    alive here, and attempts the broker cancelled (a late Dispatch for those is refused)."""

    highest: int = 0
    live: set[int] = field(default_factory=set)
    cancelled_upto: int = 0
    fence_after: dict[int, float] = field(default_factory=dict)  # attempt -> seconds (0 = off)
    revision: dict[int, int] = field(default_factory=dict)  # attempt -> newest placement revision


@dataclass(frozen=True, slots=True)
class Refuse:
    ack: CommandAck
    fence_lapsed: bool = False  # read after the broker's silence passed the attempt's fence


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The attempt exists here already: acknowledge, create nothing."""


@dataclass(frozen=True, slots=True)
class Resize:
    """A newer placement revision of the attempt running here."""


@dataclass(frozen=True, slots=True)
class Run:
    """Create the attempt, after ending the older live attempts in `supersede`."""

    supersede: tuple[int, ...]


Verdict = Refuse | Duplicate | Resize | Run


class CommandGate:
    def __init__(self, max_tracked: int = MAX_TRACKED_JOBS) -> None:
        self.max_epoch = 0
        self.max_tracked = max_tracked
        self._jobs: dict[str, JobTrack] = {}
        # When the newest batch the broker acknowledged left this agent (None: none yet, in
        # this process): the broker heard the cluster then, and no earlier is proven.
        self.heard_at: float | None = None
        # When this process subscribed to its commands (None: not known, as in a test that
        # drives the gate alone): what it reads was sent no earlier.
        self.subscribed_at: float | None = None

    # -- deciding ------------------------------------------------------------------------
    def epoch_refusal(self, epoch: int) -> CommandAck | None:
        """None when `epoch` may command this agent (and it becomes the newest seen)."""
        if epoch < self.max_epoch:
            err = f"stale epoch {epoch}: this agent has seen epoch {self.max_epoch}"
            return CommandAck(ok=False, stale_epoch=True, error=err, epoch=self.max_epoch)
        self.max_epoch = epoch
        return None

    def judge(self, cmd: Dispatch, now: float) -> Verdict:
        """What to do with `cmd`, read at `now` (the clock `heard` is given)."""
        track = self.track(cmd.job_id)
        if cmd.attempt <= track.cancelled_upto:
            err = f"attempt {cmd.attempt} of job {cmd.job_id} was cancelled here"
            return Refuse(CommandAck(ok=False, error=err))
        if cmd.attempt == track.highest:
            if cmd.revision > track.revision.get(cmd.attempt, 0):
                return Resize()
            return Duplicate()
        if cmd.attempt < track.highest:
            err = (
                f"attempt {cmd.attempt} of job {cmd.job_id} is older than attempt "
                f"{track.highest} already dispatched here"
            )
            return Refuse(CommandAck(ok=False, error=err))
        silent = self.silent_for(now)
        if cmd.fence_after_s > 0 and silent is not None and silent >= cmd.fence_after_s:
            err = (
                f"attempt {cmd.attempt} of job {cmd.job_id} not started: the broker has not "
                f"acknowledged this cluster for {silent:.1f}s, past the attempt's fence of "
                f"{cmd.fence_after_s:g}s, so it may have started the job elsewhere"
            )
            return Refuse(CommandAck(ok=False, error=err), fence_lapsed=True)
        return Run(tuple(sorted(a for a in track.live if a < cmd.attempt)))

    def silent_for(self, now: float) -> float | None:
        """How long the broker has not been proven to hear this cluster: since the newest
        batch it acknowledged left or, before any, since this process subscribed (a Dispatch
        is no older than the subscription it came on); None when neither is known."""
        since = self._since()
        return None if since is None else max(0.0, now - since)

    def fence_base(self, now: float) -> float:
        """Where a new attempt's fence window counts from."""
        since = self._since()
        return now if since is None else min(now, since)

    def _since(self) -> float | None:
        return self.heard_at if self.heard_at is not None else self.subscribed_at

    def cancel_targets(self, job_id: str, attempt: int | None) -> list[int]:
        """The live attempts a Cancel of `attempt` (None: every attempt) ends."""
        track = self._jobs.get(job_id)
        if track is None:
            return []
        return sorted(a for a in track.live if attempt is None or a == attempt)

    # -- recording -----------------------------------------------------------------------
    def heard(self, sent_at: float) -> None:
        """The broker acknowledged a batch that left at `sent_at`."""
        if self.heard_at is None or sent_at > self.heard_at:
            self.heard_at = sent_at

    def ran(self, cmd: Dispatch) -> None:
        """The backend created the attempt."""
        track = self.track(cmd.job_id)
        track.highest = cmd.attempt
        track.live.add(cmd.attempt)
        track.fence_after[cmd.attempt] = cmd.fence_after_s

    def resized(self, cmd: Dispatch) -> None:
        self.track(cmd.job_id).revision[cmd.attempt] = cmd.revision

    def cancelled(self, job_id: str, attempt: int | None) -> None:
        """The broker cancelled `attempt` (None: all): none of those may be created again."""
        track = self.track(job_id)
        if attempt is None:
            track.live.clear()
            track.cancelled_upto = max(track.cancelled_upto, track.highest)
        else:
            track.live.discard(attempt)
            track.cancelled_upto = max(track.cancelled_upto, attempt)

    def fenced(self, job_id: str, attempt: int) -> None:
        """The agent stopped the attempt itself (cut off too long): as if cancelled."""
        self.cancelled(job_id, attempt)

    def ended(self, job_id: str, attempt: int) -> None:
        """The attempt stopped on its own (a terminal phase) or was superseded."""
        track = self._jobs.get(job_id)
        if track is not None:
            track.live.discard(attempt)

    def adopt(self, job_id: str, attempt: int, *, live: bool, fence_after: float | None) -> None:
        """An attempt found in the cluster (an earlier agent process created it)."""
        track = self.track(job_id)
        track.highest = max(track.highest, attempt)
        if live:
            track.live.add(attempt)
            if fence_after is not None and attempt not in track.fence_after:
                track.fence_after[attempt] = fence_after

    def started(self, now: float) -> None:
        """This process subscribes to its commands at `now`: nothing of it acknowledged yet."""
        self.heard_at = None
        self.subscribed_at = now

    def forget(self, now: float) -> None:
        """A new process, subscribing at `now`, knows nothing until its cluster's snapshot is
        adopted."""
        self._jobs.clear()
        self.started(now)

    # -- reading -------------------------------------------------------------------------
    def track(self, job_id: str) -> JobTrack:
        track = self._jobs.get(job_id)
        if track is None:
            if len(self._jobs) >= self.max_tracked:
                self._forget_oldest()
            track = self._jobs[job_id] = JobTrack()
        return track

    def get(self, job_id: str) -> JobTrack | None:
        return self._jobs.get(job_id)

    def tracks(self) -> Iterator[tuple[str, JobTrack]]:
        """Every tracked job (a copy of the list: callers may record while iterating)."""
        return iter(list(self._jobs.items()))

    def live(self, job_id: str) -> set[int]:
        track = self._jobs.get(job_id)
        return set(track.live) if track else set()

    def _forget_oldest(self) -> None:
        """Drop the oldest tenth of finished jobs' records (dicts keep insertion order)."""
        drop = []
        for job_id, tr in self._jobs.items():
            if not tr.live:
                drop.append(job_id)
                if len(drop) >= self.max_tracked // 10:
                    break
        for job_id in drop:
            del self._jobs[job_id]
