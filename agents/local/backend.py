"""Replicas as local processes, behind the same `Backend` seam as `kube` and `fake`.

A "node" is a slot group declared in the config (a GPU count, CPU and memory), so one machine
can be several clusters and the broker's gang fitting is unchanged. Each attempt gets a
directory `<workdir>/<job_id>/attempt-<n>/` holding:

- `state.json`: the pid file: which replicas run where (pid plus kernel start time, so a
  reused pid is never mistaken for a replica); a restarted agent adopts what still runs.
- `rank-<r>/`: the replica's working directory; `rank-<r>.log`: its stdout and stderr.
- `rank-<r>.exit`: its exit code, written by the shim (`agents/local/shim.py`).
- `fence`: a unix deadline the agent extends while alive; the shim kills the replica when it
  lapses, so a dead agent never leaves a copy running after the broker has moved the job.
- `checkpoint.json` (`MUSTER_ANNOTATION_FILE`): the SDK's newest checkpoint, reported upward;
  `podinfo/annotations` (`MUSTER_PODINFO_DIR`): where a checkpoint request is written.
- `verdict.json`: how the attempt ended, once reported.

Each replica runs in its own session (process group): cancel and spot reclaim signal the group.
A gang whose only podset is elastic runs each replica as a torchrun agent under one c10d
rendezvous (`elastic.py`; its store is `store.log`'s process): `resize` stops the replicas a
Dispatch revision drops and starts the ones it adds, and the rest go on in the same attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from agents.backend import BackendError, CannotResize, Emit, LogTail, NodeOpResult
from agents.config import LocalClusterConfig, LocalFlavor
from agents.fake.model import (
    Demand,
    NodeState,
    check_capacity,
    gang_demands,
    operate,
)
from agents.fake.trace import load_bamboo
from agents.local import shim
from agents.local.elastic import elastic_podset, store_argv, torchrun_argv, torchrun_env
from agents.sdk import checkpoint_request_line
from agents.workload_env import muster_env, replica_env
from schemas.agent import (
    AgentEvent,
    CheckpointReport,
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    LogRequest,
    NodeGone,
    NodeOpName,
    NodeUpsert,
    SpotNotice,
    WorkloadStatus,
)
from schemas.quantity import cpu_milli, memory_bytes
from shell.tasks import cancel_and_wait

MASTER_ADDR = "127.0.0.1"
MAX_REASON = 1000  # WorkloadStatus.reason is capped at 1024


def _noop_emit(_: AgentEvent) -> None:
    return None


def free_port() -> int:
    """A port nothing listens on now (the rendezvous of one attempt)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return int(s.getsockname()[1])


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when it is gone or
    a zombie. Together with the pid it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log (at most 64 KiB read)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 65536))
            text = fh.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(slots=True, eq=False)
class _Replica:
    rank: int
    node: str
    pid: int
    start_time: int | None
    proc: subprocess.Popen[bytes] | None  # None when adopted after an agent restart
    code: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "pid": self.pid, "start": self.start_time}


@dataclass(slots=True, eq=False)
class _Attempt:
    job_id: str
    attempt: int
    flavor: str
    dir: Path
    demands: list[Demand]  # per replica
    fence_after_s: float
    step: int
    replicas: list[_Replica] = field(default_factory=list)
    phase: str = "created"
    ckpt_mtime: int = 0
    fence_written: float = 0.0
    reclaimed: str = ""  # reason when SIGTERMed by a spot reclaim
    term_at: float | None = None  # monotonic time of that SIGTERM
    killed: list[int] = field(default_factory=list)  # ranks SIGKILLed after ignoring SIGTERM
    culprit: int | None = None  # the first rank seen failing
    cancelling: bool = False  # being stopped on purpose: its exits are no verdict
    # Elastic (torchrun) attempts: the podset's minimum, the rendezvous port and store, and
    # replicas a shrink stopped, each with when it gets SIGKILL if still alive.
    least: int = 0
    port: int = 0
    store: _Replica | None = None
    retiring: list[tuple[_Replica, float]] = field(default_factory=list)

    @property
    def elastic(self) -> bool:
        return self.least > 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(d[0] for d in self.demands))

    def file(self, name: str) -> Path:
        return self.dir / name


class LocalBackend:
    """Runs each dispatched gang as local processes (see the module docstring)."""

    def __init__(self, cluster: str, config: LocalClusterConfig | None = None) -> None:
        self.cluster = cluster
        self.config = config or LocalClusterConfig()
        self.root = Path(self.config.workdir) / cluster
        self.log = structlog.get_logger("muster.local").bind(cluster=cluster)
        self._emit: Emit = _noop_emit
        self._flavors: dict[str, LocalFlavor] = {f.name: f for f in self.config.flavors}
        self._declared: dict[str, NodeState] = {}
        for fl in self.config.flavors:
            for i, shape in enumerate(fl.nodes):
                name = f"{cluster}-{fl.name}-{i}"
                self._declared[name] = NodeState(
                    name, fl.name, shape.gpu, cpu_milli(shape.cpu), memory_bytes(shape.memory)
                )
        self._nodes: dict[str, NodeState] = dict(self._declared)
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._timers: set[asyncio.TimerHandle] = set()
        self._task: asyncio.Task[None] | None = None
        self._trace_task: asyncio.Task[None] | None = None
        self.history: dict[str, list[dict[str, Any]]] = {}  # job_id -> verdicts, for tests

    # -- Backend protocol ----------------------------------------------------------------
    async def start(self, emit: Emit) -> None:
        """Adopt what a previous agent left running, then watch the processes."""
        self._emit = emit
        self.root.mkdir(parents=True, exist_ok=True)
        if self._task is None or self._task.done():
            self._adopt_orphans()
            self._task = asyncio.create_task(self._monitor(), name=f"local-{self.cluster}")
        if self.config.trace is not None and self._trace_task is None:
            self._trace_task = asyncio.create_task(self._replay_trace())

    async def stop(self) -> None:
        """Stop watching; replicas keep running (a restarted agent adopts them) until their
        fence lapses."""
        await cancel_and_wait(self._task, self._trace_task)
        self._task = self._trace_task = None
        for h in self._timers:
            h.cancel()
        self._timers.clear()
        self._emit = _noop_emit

    async def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            flavors=[
                FlavorInfo(
                    name=f.name,
                    capacity_type=f.capacity_type,
                    gpu_type=f.gpu_type,
                    price_per_gpu_hour=f.price_per_gpu_hour,
                )
                for f in self.config.flavors
            ],
            nodes=[n.info() for n in self._nodes.values()],
            workloads=[self._status(a, a.phase) for a in self._attempts.values()],
        )

    async def dispatch(self, cmd: Dispatch) -> None:
        key = (cmd.job_id, cmd.attempt)
        if key in self._attempts:
            return
        workload = cmd.spec.workload
        if not workload.command:
            raise BackendError(
                f"job {cmd.job_id}: workload.command is empty; the local backend runs "
                "workload.command + workload.args as a process on this machine"
            )
        if workload.secret_env:
            # Refused, not run without them: a trainer missing its credentials fails later
            # and less clearly, or runs with a fallback it should not.
            raise BackendError(
                f"job {cmd.job_id}: secret_env needs the kube backend; cluster {self.cluster} "
                "is local and has no Kubernetes Secrets to resolve "
                f"{', '.join(sorted(workload.secret_env))}. Run the job on a kube cluster, "
                "or give a local run its credentials in the agent's own environment"
            )
        if cmd.flavor not in self._flavors:
            raise BackendError(
                f"cluster {self.cluster} has no flavor {cmd.flavor!r}; "
                f"known: {sorted(self._flavors)}"
            )
        demands = self._demands(cmd)
        adir = self.root / cmd.job_id / f"attempt-{cmd.attempt}"
        if (adir / "state.json").exists():
            raise BackendError(f"{adir} already holds attempt {cmd.attempt} of job {cmd.job_id}")
        adir.mkdir(parents=True, exist_ok=True)
        (adir / "podinfo").mkdir(exist_ok=True)
        at = _Attempt(
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            flavor=cmd.flavor,
            dir=adir,
            demands=demands,
            fence_after_s=cmd.fence_after_s,
            step=cmd.resume_from.step if cmd.resume_from else 0,
        )
        self._reserve(at)
        self._attempts[key] = at
        self._first_fence(at)
        port = free_port()
        local_ranks: dict[str, int] = {}
        # rank -> [podset, replica], in the order ranks are given out, for `muster logs`
        names = [[a.podset, i] for a in cmd.assignment for i in range(len(a.nodes))]
        with contextlib.suppress(OSError):
            shim.write_json(at.file("ranks.json"), names)
        podset = elastic_podset(cmd)
        try:
            if podset is not None:
                at.least, at.port = podset.least, port
                at.store = self._spawn(at, -1, "", {}, store_argv(port))
            for rank, (node, *_rest) in enumerate(demands):
                if podset is not None:
                    at.replicas.append(self._spawn_elastic(at, cmd, rank, node))
                else:
                    local_rank = local_ranks.get(node, 0)
                    local_ranks[node] = local_rank + 1
                    env = replica_env(
                        cmd, master_addr=MASTER_ADDR, master_port=port, rank=rank,
                        local_rank=local_rank,
                    )  # fmt: skip
                    argv = [*workload.command, *workload.args]
                    at.replicas.append(self._spawn(at, rank, node, env, argv))
                self._write_state(at)
        except OSError as exc:
            self._kill_all(at, signal.SIGKILL)
            self._stop_store(at)
            self._release(at)
            del self._attempts[key]
            raise BackendError(f"could not start replicas in {adir}: {exc}") from None
        self.log.info(
            "dispatched", job_id=cmd.job_id, attempt=cmd.attempt, port=port, elastic=at.elastic
        )
        self._emit(self._status(at, "created"))

    async def resize(self, cmd: Dispatch) -> None:
        """A revision of a running elastic attempt: stop the replicas on nodes it no longer
        lists (their torchrun agents leave the rendezvous, the others re-form the worker
        group), start a torchrun agent for each node it adds (it joins), keep the rest."""
        at = self._attempts.get((cmd.job_id, cmd.attempt))
        if at is None:
            raise BackendError(
                f"attempt {cmd.attempt} of job {cmd.job_id} does not run on cluster {self.cluster}"
            )
        if not at.elastic or elastic_podset(cmd) is None:
            raise CannotResize(
                f"attempt {cmd.attempt} of job {cmd.job_id} runs with fixed ranks on cluster "
                f"{self.cluster}: only a gang of one elastic podset (max_replicas) runs under "
                "torchrun's elastic rendezvous and can change size in place"
            )
        if at.term_at is not None or at.cancelling:
            raise BackendError(f"attempt {cmd.attempt} of job {cmd.job_id} is stopping")
        self._release(at)
        try:
            demands = self._demands(cmd)
        except BackendError:
            self._reserve(at)
            raise
        on: dict[str, list[_Replica]] = {}
        for r in at.replicas:
            on.setdefault(r.node, []).append(r)
        kept: list[_Replica] = []
        added: list[str] = []
        for node, *_rest in demands:
            here = on.get(node)
            if here:
                kept.append(here.pop(0))
            else:
                added.append(node)
        at.demands = demands
        self._reserve(at)
        for r in (r for rs in on.values() for r in rs):
            self._retire(at, r)
        at.replicas = kept
        names = _read_json(at.file("ranks.json"))
        names = names if isinstance(names, list) else []
        podset = cmd.spec.gang[0].name
        for node in added:
            rank = max(len(names), 1 + max((r.rank for r in self._every(at)), default=-1))
            names += [[podset, i] for i in range(len(names), rank + 1)]
            at.replicas.append(self._spawn_elastic(at, cmd, rank, node))
        with contextlib.suppress(OSError):
            shim.write_json(at.file("ranks.json"), names)
        self._write_state(at)
        self.log.info(
            "resized", job_id=cmd.job_id, attempt=cmd.attempt, revision=cmd.revision,
            replicas=len(at.replicas), added=added,
        )  # fmt: skip

    async def cancel(self, job_id: str, attempt: int | None, reason: str) -> None:
        """SIGTERM each replica's process group, SIGKILL after `cancel_grace_s`; returns
        once every replica is gone, so no copy outlives the cancel. No status is emitted."""
        keys = [k for k in self._attempts if k[0] == job_id and attempt in (None, k[1])]
        await asyncio.gather(*(self.kill_attempt(self._attempts[k], reason) for k in keys))

    async def checkpoint_now(self, job_id: str, attempt: int, deadline: float) -> None:
        """Write the request where the SDK polls for it (`MUSTER_PODINFO_DIR`)."""
        at = self._attempts.get((job_id, attempt))
        if at is None:
            return
        path = at.file("podinfo") / "annotations"
        tmp = path.with_name(".annotations.tmp")
        tmp.write_text(checkpoint_request_line(deadline) + "\n")
        os.replace(tmp, path)

    # -- fencing: the runtime extends each live attempt's fence while the broker hears the
    # agent; the launcher (shim.py) kills the replicas once the deadline passes, agent or not --
    async def fence(self, job_id: str, attempt: int, until: float) -> None:
        """Let the attempt run until `until` (unix seconds) unless extended again."""
        at = self._attempts.get((job_id, attempt))
        if at is not None:
            self._write_fence(at, until)

    def fence_after(self, job_id: str, attempt: int) -> float:
        """The fence window the attempt was dispatched with, for an agent that restarts."""
        at = self._attempts.get((job_id, attempt))
        return at.fence_after_s if at is not None else 0.0

    def _write_fence(self, at: _Attempt, until: float) -> None:
        shim.write_json(at.file("fence"), until)
        at.fence_written = time.time()

    async def kill_attempt(self, at: _Attempt, reason: str) -> None:
        if at.key not in self._attempts or at.cancelling:
            return
        at.cancelling = True  # a replica that exits 0 on SIGTERM has not succeeded
        self._kill_all(at, signal.SIGTERM)
        grace = self.config.cancel_grace_s
        if not await self._wait_exit(at, grace):
            self._kill_all(at, signal.SIGKILL)
            await self._wait_exit(at, 5.0)
        self._forget(at, {"phase": "cancelled", "reason": reason})
        self.log.info("cancelled", job_id=at.job_id, attempt=at.attempt, reason=reason)

    # -- injection API (tests, demo, trace) ----------------------------------------------
    def spot_notice(self, node: str, lead_s: float | None = None) -> float | None:
        """`node` is reclaimed in `lead_s` seconds (default: its flavor's `spot_notice_s`):
        then its replicas get SIGTERM, and SIGKILL `grace_s` later. Returns the deadline."""
        n = self._nodes.get(node)
        if n is None:
            return None
        if n.spot_deadline is not None:
            return n.spot_deadline
        fl = self._flavors[n.flavor]
        lead = fl.spot_notice_s if lead_s is None else max(0.0, lead_s)
        n.spot_deadline = time.time() + lead
        self._emit(SpotNotice(node=node, deadline=n.spot_deadline, reason="spot-interruption"))
        self._later(lead, self._reclaim, n)
        self.log.info("spot notice", node=node, lead_s=lead)
        return n.spot_deadline

    async def node_op(self, op: NodeOpName, node: str | None, reason: str) -> NodeOpResult:
        """Cordon: the node takes no new gangs (this agent refuses dispatches to it, and the
        broker is told); drain: cordon, then SIGTERM its replicas, which end `evicted` as in
        a reclaim (SIGKILL after the flavor's `grace_s`), so the broker moves them; notice: a
        spot notice, as `spot_notice`."""
        return operate(self, self._nodes, op, node, reason, self._terminate_on)

    def capacity_of(self, node: str) -> str:
        return self._flavors[self._nodes[node].flavor].capacity_type

    def report(self, event: AgentEvent) -> None:
        self._emit(event)

    def _terminate_on(self, node: str, reason: str) -> list[tuple[str, int]]:
        """SIGTERM the attempts with a replica on `node`; they end `evicted` with `reason`."""
        ended: list[tuple[str, int]] = []
        for at in list(self._attempts.values()):
            if node in at.nodes and at.term_at is None and not at.cancelling:
                at.reclaimed = reason
                at.term_at = time.monotonic()
                self._kill_all(at, signal.SIGTERM)
                ended.append(at.key)
        return ended

    def _shed(self, node: str) -> None:
        """Elastic attempts that stay at or above their minimum without `node` lose only its
        replicas (as pods on a reclaimed node die while the rest of the gang goes on), when
        the broker's shrink has not reached this agent before the node went."""
        for at in list(self._attempts.values()):
            gone = [r for r in at.replicas if r.node == node]
            if not at.elastic or not gone or at.term_at is not None or at.cancelling:
                continue
            if len(at.replicas) - len(gone) < at.least:
                continue
            self._release(at)
            at.demands = [d for d in at.demands if d[0] != node]
            self._reserve(at)
            for r in gone:
                self._retire(at, r)
            at.replicas = [r for r in at.replicas if r.node != node]
            self._write_state(at)
            self.log.info("elastic replicas shed", job_id=at.job_id, node=node)

    def _retire(self, at: _Attempt, r: _Replica) -> None:
        """SIGTERM a replica that leaves a running elastic gang; SIGKILL after the grace."""
        if self._alive(r):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.pid, signal.SIGTERM)
        at.retiring.append((r, time.monotonic() + self._flavors[at.flavor].grace_s))

    def _reap(self, at: _Attempt) -> None:
        """Forget retired replicas that have exited; SIGKILL those past their grace."""
        now = time.monotonic()
        still = []
        for r, kill_at in at.retiring:
            if self._alive(r):
                if now >= kill_at:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(r.pid, signal.SIGKILL)
                still.append((r, kill_at))
        at.retiring = still

    def add_node(self, node: str) -> bool:
        """Bring a declared node back (after a reclaim)."""
        n = self._declared.get(node)
        if n is None or node in self._nodes:
            return False
        n.clear()
        self._nodes[node] = n
        self._emit(NodeUpsert(node=n.info()))
        return True

    # -- views ---------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def nodes_of(self, flavor: str) -> list[str]:
        return [n.name for n in self._nodes.values() if n.flavor == flavor]

    def live_workloads(self) -> list[tuple[str, int]]:
        return list(self._attempts)

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.root / job_id / f"attempt-{attempt}"

    def log_path(self, job_id: str, attempt: int, rank: int) -> Path:
        """A replica's captured stdout and stderr."""
        return self.attempt_dir(job_id, attempt) / f"rank-{rank}.log"

    async def read_logs(self, req: LogRequest) -> LogTail:
        """The captured output of the attempt's replicas; it outlives the attempt until its
        directory is removed."""
        folder = self.attempt_dir(req.job_id, req.attempt)
        names = _read_json(folder / "ranks.json")
        if not isinstance(names, list) or not names:
            raise BackendError(
                f"attempt {req.attempt} of job {req.job_id} never ran on cluster {self.cluster}"
            )
        lines: list[str] = []
        for rank, (podset, replica) in enumerate(names):
            if req.podset is not None and podset != req.podset:
                continue
            if req.replica is not None and replica != req.replica:
                continue
            lines += [
                f"[{podset}-{replica}] {ln}"
                for ln in tail(folder / f"rank-{rank}.log", req.tail_lines)
            ]
        if not lines and (req.podset is not None or req.replica is not None):
            known = ", ".join(f"{p}-{r}" for p, r in names)
            raise BackendError(
                f"attempt {req.attempt} has no such replica; its replicas are: {known}"
            )
        ended = (req.job_id, req.attempt) not in self._attempts
        return LogTail(lines[-req.tail_lines :], ended)

    def pids(self, job_id: str, attempt: int) -> list[int]:
        at = self._attempts.get((job_id, attempt))
        return [] if at is None else [r.pid for r in at.replicas]

    # -- processes -----------------------------------------------------------------------
    def _spawn_elastic(self, at: _Attempt, cmd: Dispatch, rank: int, node: str) -> _Replica:
        """A torchrun agent for one replica (no RANK or WORLD_SIZE: the rendezvous gives
        them to its worker)."""
        podset = elastic_podset(cmd)
        assert podset is not None
        env = {**cmd.spec.workload.env, **muster_env(cmd), **torchrun_env()}
        argv = torchrun_argv(cmd, podset, at.port, self.config.elastic_max_restarts)
        return self._spawn(at, rank, node, env, argv)

    def _spawn(
        self, at: _Attempt, rank: int, node: str, env: dict[str, str], command: list[str]
    ) -> _Replica:
        """Start `command` under the shim; rank -1 is an elastic attempt's rendezvous store."""
        tag = "store" if rank < 0 else f"rank-{rank}"
        cwd = at.dir / tag
        cwd.mkdir(exist_ok=True)
        full_env = {
            **os.environ,
            **env,
            "MUSTER_ANNOTATION_FILE": str(at.file("checkpoint.json")),
            "MUSTER_PODINFO_DIR": str(at.file("podinfo")),
            "MUSTER_PODINFO_POLL_S": str(self.config.poll_s),
            "MUSTER_SIGTERM_GRACE_S": str(self._flavors[at.flavor].grace_s),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [
            sys.executable,
            shim.__file__,
            "--exit-file",
            str(at.file(f"{tag}.exit")),
            "--fence-file",
            str(at.file("fence")),
            "--",
            *command,
        ]
        with at.file(f"{tag}.log").open("ab") as logf:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return _Replica(rank, node, proc.pid, process_start_time(proc.pid), proc)

    def _write_state(self, at: _Attempt) -> None:
        shim.write_json(
            at.file("state.json"),
            {
                "job_id": at.job_id,
                "attempt": at.attempt,
                "flavor": at.flavor,
                "demands": at.demands,
                "fence_after_s": at.fence_after_s,
                "step": at.step,
                "replicas": [r.to_json() for r in at.replicas],
                "elastic": [at.least, at.port],
                "store": at.store.to_json() if at.store is not None else None,
                "retiring": [r.to_json() for r, _ in at.retiring],
            },
        )

    def _alive(self, r: _Replica) -> bool:
        if r.code is not None:
            return False
        if r.proc is not None:
            rc = r.proc.poll()
            if rc is None:
                return True
        elif r.start_time is not None and process_start_time(r.pid) == r.start_time:
            return True
        r.code = self._exit_code(r)
        return False

    def _exit_code(self, r: _Replica) -> int:
        """The shim's own exit status (-1 when adopted: not our child); `_code` prefers the
        shim's record of the command's."""
        return -1 if r.proc is None else int(r.proc.returncode)

    def _every(self, at: _Attempt) -> list[_Replica]:
        """The attempt's replicas and those a shrink is still stopping."""
        return [*at.replicas, *(r for r, _ in at.retiring)]

    def _kill_all(self, at: _Attempt, sig: int) -> None:
        for r in self._every(at):
            if self._alive(r):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r.pid, sig)

    async def _wait_exit(self, at: _Attempt, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(self._alive(r) for r in self._every(at)):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- the watch loop ------------------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            for at in list(self._attempts.values()):
                try:
                    self._check(at)
                except Exception:  # one attempt's trouble must not stop the others
                    self.log.exception("local attempt check failed", job_id=at.job_id)
            await asyncio.sleep(self.config.poll_s)

    def _check(self, at: _Attempt) -> None:
        if at.cancelling:
            return
        self._read_checkpoint(at)
        self._reap(at)
        alive = [self._alive(r) for r in at.replicas]
        if at.term_at is not None:
            grace = self._flavors[at.flavor].grace_s
            if any(alive) and not at.killed and time.monotonic() - at.term_at >= grace:
                at.killed = [r.rank for r, live in zip(at.replicas, alive, strict=True) if live]
                self._kill_all(at, signal.SIGKILL)
                self.log.warning("replicas ignored SIGTERM; killed", ranks=at.killed)
            if any(alive):
                return
        elif all(alive):
            if at.phase == "created":
                at.phase = "running"
                self._emit(self._status(at, "running"))
            return
        failed = [
            r.rank
            for r, live in zip(at.replicas, alive, strict=True)
            if not live and self._code(at, r) != 0
        ]
        if at.elastic and any(alive) and not failed:
            # torchrun exits 0 once its worker group completed: the job is done, and a
            # replica still alive is one that joined too late (waiting in the rendezvous).
            for r, live in zip(at.replicas, alive, strict=True):
                if live:
                    self._retire(at, r)
            at.replicas = [r for r, live in zip(at.replicas, alive, strict=True) if not live]
            return
        if any(alive) and not failed:
            return  # some finished cleanly; wait for the rest
        if at.retiring:
            return  # reported once the replicas a shrink stopped are gone too
        if at.culprit is None and failed:
            at.culprit = failed[0]  # the one that failed on its own, not those killed after
        self._kill_all(at, signal.SIGKILL)  # one replica failed: the gang is done
        if any(self._alive(r) for r in at.replicas):
            return  # reaped on a later tick
        self._finish(at)

    def _code(self, at: _Attempt, r: _Replica) -> int:
        rec = _read_json(at.file(f"rank-{r.rank}.exit"))
        if isinstance(rec, dict) and isinstance(rec.get("code"), int):
            return int(rec["code"])
        return r.code if r.code is not None else -1

    def _fenced(self, at: _Attempt, r: _Replica) -> bool:
        rec = _read_json(at.file(f"rank-{r.rank}.exit"))
        return isinstance(rec, dict) and rec.get("fenced") is True

    def _finish(self, at: _Attempt) -> None:
        self._read_checkpoint(at)
        codes = [self._code(at, r) for r in at.replicas]
        if any(self._fenced(at, r) for r in at.replicas):
            phase, reason = (
                "evicted",
                "fenced: its fence lapsed (agent gone or cut off from the broker)",
            )
        elif at.reclaimed:
            phase, reason = "evicted", at.reclaimed
            if at.killed:
                grace = self._flavors[at.flavor].grace_s
                reason += f"; ranks {at.killed} ignored SIGTERM and were killed after {grace:g}s"
        elif all(c == 0 for c in codes):
            phase, reason = "succeeded", ""
        else:
            phase, reason = "failed", self._failure_reason(at, codes)
        status = self._status(at, phase, reason, codes)
        self._forget(at, {"phase": phase, "reason": reason, "exit_codes": codes})
        self._emit(status)

    def _failure_reason(self, at: _Attempt, codes: list[int]) -> str:
        by_rank = {r.rank: c for r, c in zip(at.replicas, codes, strict=True)}
        rank = at.culprit if at.culprit is not None else next(r for r, c in by_rank.items() if c)
        lines = tail(at.file(f"rank-{rank}.log"), self.config.log_tail_lines)
        text = f"rank {rank} exited with code {by_rank[rank]}; last log lines: " + " | ".join(lines)
        return text[-MAX_REASON:] if len(text) > MAX_REASON else text

    def _forget(self, at: _Attempt, verdict: dict[str, Any]) -> None:
        if self._attempts.pop(at.key, None) is None:
            return
        self._release(at)
        self._stop_store(at)
        with contextlib.suppress(OSError):
            shim.write_json(at.file("verdict.json"), verdict)
        self.history.setdefault(at.job_id, []).append({"attempt": at.attempt, **verdict})

    def _stop_store(self, at: _Attempt) -> None:
        """The rendezvous store holds no state worth a grace period once the attempt ended."""
        store = at.store
        if store is None or not self._alive(store):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(store.pid, signal.SIGKILL)
        if store.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                store.proc.wait(5.0)

    def _first_fence(self, at: _Attempt) -> None:
        """The fence an attempt starts with; from then on only the runtime extends it."""
        if at.fence_after_s > 0:
            self._write_fence(at, time.time() + at.fence_after_s)

    def _read_checkpoint(self, at: _Attempt) -> None:
        path = at.file("checkpoint.json")
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return
        if mtime == at.ckpt_mtime:
            return
        at.ckpt_mtime = mtime
        rec = _read_json(path)
        if not isinstance(rec, dict):
            return
        step, uri = rec.get("step"), rec.get("uri")
        if not isinstance(step, int) or not isinstance(uri, str) or step < 0:
            self.log.warning("ignoring malformed checkpoint report", path=str(path))
            return
        if step <= at.step:  # known already (or older than the resume point)
            return
        at.step = max(at.step, step)
        self._emit(
            CheckpointReport(
                job_id=at.job_id, attempt=at.attempt, step=step, uri=uri[:2048], at=time.time()
            )
        )

    # -- spot ----------------------------------------------------------------------------
    def _later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        loop = asyncio.get_running_loop()

        def run() -> None:
            self._timers.discard(handle)
            fn(*args)

        handle = loop.call_later(delay, run)
        self._timers.add(handle)

    def _reclaim(self, node: NodeState) -> None:
        if self._nodes.get(node.name) is not node:
            return
        self._shed(node.name)
        self._terminate_on(node.name, "spot-reclaimed")
        del self._nodes[node.name]
        self._emit(NodeGone(node=node.name, reason="spot-reclaimed"))

    async def _replay_trace(self) -> None:
        """Removals become spot notices `spot_notice_s` ahead; adds bring a node back."""
        tr = self.config.trace
        assert tr is not None
        events = load_bamboo(tr.path, tr.max_events)
        lead = self._flavors[tr.flavor].spot_notice_s
        t0 = time.monotonic()
        plan: list[tuple[float, str, str]] = []
        for ev in events:
            if ev.time_ms <= tr.start_ms:
                continue
            t = (ev.time_ms - tr.start_ms) / 1000.0 / tr.speedup
            due = max(0.0, t - lead) if ev.op == "remove" else t
            plan.append((due, ev.op, f"{self.cluster}-{tr.flavor}-{ev.node}"))
        plan.sort()
        for due, op, node in plan:
            await asyncio.sleep(max(0.0, t0 + due - time.monotonic()))
            if op == "remove":
                self.spot_notice(node)
            else:
                self.add_node(node)

    # -- capacity ------------------------------------------------------------------------
    def _demands(self, cmd: Dispatch) -> list[Demand]:
        out = gang_demands(cmd, self._nodes, self.cluster)
        check_capacity(self._nodes, out)
        for name in dict.fromkeys(d[0] for d in out):
            if self._nodes[name].cordon_note:
                raise BackendError(
                    f"node {name!r} of cluster {self.cluster} is cordoned; it takes no new "
                    f"gangs until `muster uncordon {self.cluster} {name}`"
                )
        return out

    def _reserve(self, at: _Attempt) -> None:
        for name, gpu, cpu, mem in at.demands:
            node = self._nodes.get(name)
            if node is not None:
                node.take(gpu, cpu, mem)

    def _release(self, at: _Attempt) -> None:
        for name, gpu, cpu, mem in at.demands:
            node = self._nodes.get(name)
            if node is not None:
                node.give_back(gpu, cpu, mem)

    def _status(
        self, at: _Attempt, phase: str, reason: str = "", codes: list[int] | None = None
    ) -> WorkloadStatus:
        return WorkloadStatus(
            job_id=at.job_id,
            attempt=at.attempt,
            phase=phase,  # type: ignore[arg-type]
            running_replicas=len(at.replicas) if phase == "running" else 0,
            total_replicas=len(at.demands),
            exit_codes=codes or [],
            reason=reason,
            step=at.step,
            nodes=at.nodes,
        )

    # -- restart -------------------------------------------------------------------------
    def _adopt_orphans(self) -> None:
        """Attempts a previous agent left: live ones are watched again (the broker decides,
        from the snapshot, whether they stay); ended ones are reported once."""
        for state_file in sorted(self.root.glob("*/attempt-*/state.json")):
            adir = state_file.parent
            if (adir / "verdict.json").exists():
                continue
            st = _read_json(state_file)
            if not isinstance(st, dict):
                continue
            try:
                at = _Attempt(
                    job_id=str(st["job_id"]),
                    attempt=int(st["attempt"]),
                    flavor=str(st["flavor"]),
                    dir=adir,
                    demands=[tuple(d) for d in st["demands"]],
                    fence_after_s=float(st["fence_after_s"]),
                    step=int(st["step"]),
                    phase="running",
                    replicas=[_adopted(r) for r in st["replicas"]],
                    least=int(st.get("elastic", [0, 0])[0]),
                    port=int(st.get("elastic", [0, 0])[1]),
                    store=_adopted(st["store"]) if st.get("store") else None,
                    retiring=[(_adopted(r), 0.0) for r in st.get("retiring", [])],
                )
            except (KeyError, TypeError, ValueError) as exc:
                self.log.warning(
                    "unreadable pid file; ignored", path=str(state_file), error=str(exc)
                )
                continue
            if at.flavor not in self._flavors:
                continue
            self._attempts[at.key] = at
            self._reserve(at)
            live = sum(self._alive(r) for r in at.replicas)
            self.log.info("adopted attempt", job_id=at.job_id, attempt=at.attempt, live=live)
            self._check(at)  # one that ended while no agent watched is reported now


def _adopted(r: dict[str, Any]) -> _Replica:
    """A replica from the pid file of an earlier agent (not our child: no Popen)."""
    return _Replica(int(r["rank"]), str(r["node"]), int(r["pid"]), r["start"], None)
