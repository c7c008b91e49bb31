"""Every NATS subject, stream and bucket name Muster uses, derived from one prefix.

Kept in one place so the broker, the agents, clients and the NATS permission files in
`deploy/` cannot drift apart.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Token = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]

# The header of a submission that names where its answer goes. JetStream keeps a message's
# headers but not its reply subject, so only this survives into the submit stream: the broker
# answers the stored copy on it, even when it never heard the plain copy (docs/protocol.md).
REPLY_HEADER = "Muster-Reply-To"


class Subjects(msgspec.Struct, frozen=True):
    """Subject names under a configurable prefix (default `muster`)."""

    prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")] = "muster"

    # -- client-facing (JSON) -------------------------------------------------------------
    def submit(self, queue: str) -> str:
        return f"{self.prefix}.submit.{queue}"

    @property
    def submit_all(self) -> str:
        return f"{self.prefix}.submit.*"

    def dead_letter(self, queue: str) -> str:
        """Submissions that failed processing repeatedly, with a `Muster-Reason` header."""
        return f"{self.prefix}.deadletter.submit.{queue}"

    def api(self, verb: str) -> str:
        return f"{self.prefix}.api.{verb}"

    @property
    def api_all(self) -> str:
        return f"{self.prefix}.api.*"

    def api_as(self, team: str, verb: str) -> str:
        """A team's API call; NATS lets only that team's user publish it."""
        return f"{self.prefix}.api.{team}.{verb}"

    @property
    def api_teams_all(self) -> str:
        return f"{self.prefix}.api.*.*"

    def team_events(self, team: str, job_id: str) -> str:
        """A job's events again, under its queue's team, which only that team may read."""
        return f"{self.prefix}.events.team.{team}.{job_id}"

    def job_events(self, job_id: str) -> str:
        return f"{self.prefix}.events.job.{job_id}"

    @property
    def job_events_all(self) -> str:
        return f"{self.prefix}.events.job.*"

    # -- workload checkpoint SDK (JSON) ----------------------------------------------------
    def checkpoint(self, job_id: str) -> str:
        """A workload reports a checkpoint (schemas.agent.CheckpointReport as JSON)."""
        return f"{self.prefix}.checkpoint.{job_id}"

    @property
    def checkpoint_all(self) -> str:
        return f"{self.prefix}.checkpoint.*"

    # -- agent protocol (msgpack) ---------------------------------------------------------
    def agent_events(self, cluster: str) -> str:
        return f"{self.prefix}.agent.{cluster}.events"

    @property
    def agent_events_all(self) -> str:
        return f"{self.prefix}.agent.*.events"

    def agent_cmd(self, cluster: str) -> str:
        return f"{self.prefix}.agent.{cluster}.cmd"

    def agent_logs(self, cluster: str) -> str:
        """Log reads (schemas.agent.LogRequest as JSON; LogChunks back on the reply subject)."""
        return f"{self.prefix}.agent.{cluster}.logs"

    def agent_nodeops(self, cluster: str) -> str:
        """Cordon, uncordon, drain, notice (schemas.agent.NodeOpRequest as JSON; a NodeOpReply
        back on the reply subject). Only operators may publish it."""
        return f"{self.prefix}.agent.{cluster}.nodeops"

    def cluster_of_agent_subject(self, subject: str) -> str | None:
        """`muster.agent.<cluster>.events` -> `<cluster>`; None when the subject is not one."""
        head = f"{self.prefix}.agent."
        if not subject.startswith(head) or not subject.endswith(".events"):
            return None
        cluster = subject[len(head) : -len(".events")]
        return cluster if cluster and "." not in cluster else None

    def queue_of_submit_subject(self, subject: str) -> str | None:
        head = f"{self.prefix}.submit."
        if not subject.startswith(head):
            return None
        queue = subject[len(head) :]
        return queue if queue and "." not in queue else None

    # -- JetStream / KV names (no dots allowed in these) ----------------------------------
    @property
    def _stem(self) -> str:
        return self.prefix.replace(".", "_").upper()

    @property
    def submit_stream(self) -> str:
        return f"{self._stem}_SUBMIT"

    @property
    def jobs_bucket(self) -> str:
        return f"{self._stem}_JOBS"

    @property
    def jobs_snapshot_bucket(self) -> str:
        return snapshot_bucket_of(self.jobs_bucket)

    @property
    def leader_bucket(self) -> str:
        return f"{self._stem}_LEADER"

    @property
    def lease_alive(self) -> str:
        """The leader answers probes here while it holds the lease (broker/liveness.py).
        Outside the prefix on purpose: only the broker's NATS user may use it, since anyone
        subscribed to it would keep a dead leader looking alive."""
        return f"_{self._stem}_LEASE.alive"


def snapshot_bucket_of(jobs_bucket: str) -> str:
    """The object store holding a snapshot of the job bucket (broker/snapshot.py)."""
    return f"{jobs_bucket}_SNAPSHOT"


DEFAULT_SUBJECTS = Subjects()
