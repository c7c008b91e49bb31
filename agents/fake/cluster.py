"""The fake backend: the cluster model (agents/fake/model.py) run on real time.

The model holds every fact about the simulated cluster; this adapter adds only what needs
the event loop and the wall clock: one ticker task that sleeps until the model's next due
time, the async `Backend` protocol, and the partition switch the agent runtime honours.
`time_scale` simulated seconds pass per real second.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import structlog

from agents.backend import Emit, LogTail, NodeOpResult
from agents.config import FakeClusterConfig
from agents.fake.model import AttemptRecord, ClusterModel, ignore_event
from schemas.agent import ClusterSnapshot, Dispatch, LogRequest, NodeOpName, Provision
from shell.tasks import cancel_and_wait

__all__ = ["AttemptRecord", "FakeCluster", "RealTimeClock"]


class RealTimeClock:
    """Simulated seconds since creation, `scale` of them per real second."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._real0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._real0) * self.scale

    def unix(self) -> float:
        return time.time()


class FakeCluster(ClusterModel):
    """A simulated cluster behind the `Backend` protocol, driven by a ticker on real time."""

    def __init__(self, cluster: str, config: FakeClusterConfig | None = None) -> None:
        config = config or FakeClusterConfig()
        super().__init__(cluster, config, RealTimeClock(config.time_scale))
        self.partitioned = False
        # Set by whoever runs the agent (Fleet): called with True/False by `outage()`.
        self.on_outage: Callable[[bool], None] | None = None
        self._stale_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._wake_at = math.inf
        self.on_schedule = self._wake_if_earlier
        self.log = structlog.get_logger("muster.fake").bind(cluster=cluster)
        self.on_error = self._log_error

    # -- Backend protocol ----------------------------------------------------------------
    async def start(self, emit: Emit) -> None:
        """Begin simulating; restarting after stop() keeps the cluster's state."""
        self.emit = emit
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._ticker(), name=f"fake-{self.cluster}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.emit = ignore_event

    async def snapshot(self) -> ClusterSnapshot:
        return self.view()

    async def dispatch(self, cmd: Dispatch) -> None:
        """Validate the assignment against real node capacity, then create the workload."""
        self.create(cmd)

    async def resize(self, cmd: Dispatch) -> None:
        self.resize_workload(cmd)

    async def provision(self, cmd: Provision) -> None:
        """Grow an autoscaled flavor (`FakeFlavor.autoscale` models the provider)."""
        self.grow(cmd.job_id, cmd.flavor, cmd.nodes, cmd.deadline)

    async def fence(self, job_id: str, attempt: int, until: float) -> None:
        self.set_fence(job_id, attempt, until)

    async def cancel(self, job_id: str, attempt: int | None, reason: str) -> None:
        """Silent removal: no status is emitted, the next snapshot simply omits the workload."""
        self.remove(job_id, attempt, reason)

    async def checkpoint_now(self, job_id: str, attempt: int, deadline: float) -> None:
        self.checkpoint(job_id, attempt)

    async def read_logs(self, req: LogRequest) -> LogTail:
        return self.logs(req)

    async def node_op(self, op: NodeOpName, node: str | None, reason: str) -> NodeOpResult:
        return self.apply_node_op(op, node, reason)

    # -- the link to NATS ----------------------------------------------------------------
    def outage(self, start: bool) -> None:
        """Partition the whole cluster from NATS (True) or heal it (False). Workloads keep
        running; the runtime stops publishing and answering while partitioned and sends a
        full snapshot on heal (wired through `on_outage`)."""
        self.partitioned = start
        if self.on_outage is not None:
            self.on_outage(start)

    def stale_watches(self, seconds: float) -> None:
        """Report the cluster's view as stale for `seconds` (0 = fresh), as a kube agent whose
        watches keep failing does; the broker then places nothing here."""
        self._stale_s = max(0.0, seconds)

    def stale_s(self) -> float:
        return self._stale_s

    # -- the ticker ----------------------------------------------------------------------
    def _log_error(self, kind: str, exc: Exception) -> None:
        """A bug in one workload must not stop the cluster: log it and go on."""
        self.log.error("fake cluster event failed", kind=kind, exc_info=exc)

    def _wake_if_earlier(self, due: float) -> None:
        if due < self._wake_at and self._wake is not None:
            self._wake.set()

    async def _ticker(self) -> None:
        """The one loop of this cluster: run what is due, then sleep until the next due time
        (at least tick_s, at most 1 s, woken early when something earlier is scheduled)."""
        assert self._wake is not None
        scale = self.config.time_scale
        while True:
            self.advance()
            delay = min(1.0, max(self.config.tick_s, (self.next_due() - self.now()) / scale))
            self._wake_at = self.now() + delay * scale
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake_at = math.inf
