"""`KubeBackend`: the `agents.backend.Backend` for a real Kubernetes cluster.

What it watches
---------------
Nodes, every unfinished pod, Muster's pods and its workload objects with a status, each with a
`Reflector` (`watches.py`).

What it emits, and where
------------------------
Node events (`NodeUpsert`, `NodeGone`, `SpotNotice`, `GpuHealth`): `nodewatch.py`. Attempt
status (`WorkloadStatus`, `CheckpointReport`): `attempts.py`, from pods and object verdicts
(`status.py`). Objects created, deleted and patched: `objects.py`. The fence Lease:
`fencing.py`. Foreign usage of nodes: `usage.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import structlog
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration

from agents.backend import BackendError, Emit, JobRefused, LogTail, NodeOpResult
from agents.kube.attempts import Attempts, AttemptWatch, Key
from agents.kube.auth import TokenRefresher
from agents.kube.client import (
    BadInput,
    KubeApiError,
    KubeRest,
    RateLimit,
    Reflector,
    sleep_or_stop,
)
from agents.kube.config import (
    FlavorConfig,
    KubeBackendConfig,
    build_workload,
    convert_kube_config,
)
from agents.kube.decode import KJob, KNode, KPod
from agents.kube.fencing import LeaseKeeper
from agents.kube.logs import read_pod_logs
from agents.kube.nodeops import kube_node_op
from agents.kube.nodes import Rules
from agents.kube.nodewatch import NodeWatch
from agents.kube.objects import WorkloadObjects
from agents.kube.pools import Autoscaling
from agents.kube.quota import QuotaReads, attempt_usage
from agents.kube.report import REPORT_PATH, ReportBody, ReportServer, Verdict
from agents.kube.status import STATUS_RESOURCES, Workload
from agents.kube.usage import ForeignPods, ForeignUsage
from agents.kube.views import KubeViews
from agents.kube.watches import Watches
from kinds.base import KindError as ManifestError
from kinds.base import Resource
from kinds.plan import WorkloadPlan
from schemas.agent import (
    AgentEvent,
    ClusterSnapshot,
    Dispatch,
    FlavorInfo,
    LogRequest,
    NodeOpName,
    Provision,
    ProvisionPool,
    WorkloadStatus,
)

log = structlog.get_logger("muster.agent.kube")


class KubeBackend(KubeViews):
    """Kubernetes cluster side of the agent: watches nodes and pods, creates workloads."""

    def __init__(
        self,
        cluster: str,
        config: KubeBackendConfig,
        api_client: ApiClient | None = None,
        clock: Callable[[], float] = time.time,
        tick_s: float = 1.0,
        topology_levels: Sequence[str] = (),
        declared_pools: Mapping[str, ProvisionPool] | None = None,
    ) -> None:
        self.cluster = cluster
        self.config = config
        # The agent config's `pools:` (node groups, GKE NAP): asked for like read ones, and
        # they win over a NodePool read for the same flavor.
        self.declared_pools = dict(declared_pools or {})
        # The agent's `topology.levels`: node labels reported per node, coarsest first.
        self.topology_levels = tuple(topology_levels)
        self._api = api_client
        self._owns_api = api_client is None
        self._clock = clock
        self._emit: Emit | None = None
        self._rest: KubeRest | None = None
        self.rules = Rules(config)
        # What pods Muster did not place (and its own of ended attempts, still terminating)
        # hold on each node, per GPU resource of every flavor.
        self.usage = ForeignUsage(self.rules.resource(f) for f in config.flavors)
        self.bad_input = BadInput()
        self.tick_s = tick_s
        self._tasks: list[asyncio.Task[None]] = []
        # Attempts being created at once: no more than requests may be in flight (`_create`).
        self._dispatching = asyncio.Semaphore(config.api_inflight)
        self._background: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self._started = False
        self._live = False  # emit deltas only after the initial lists
        self.refresher: TokenRefresher | None = None
        # Where workloads run (per team or queue, `KubeBackendConfig.namespaces`).
        self._namespaces = config.workload_namespaces()
        # Workload objects with a status, by collection path (in every workload namespace).
        self._status_kinds: dict[str, Resource] = {
            r.collection(ns): r for ns in self._namespaces for r in STATUS_RESOURCES
        }
        self.log = log.bind(cluster=cluster)
        # Each attempt's status from its pods and objects (agents/kube/attempts.py).
        self.attempts = Attempts(self._namespaces, self._status_kinds, clock, self.log)
        self.node_watch = NodeWatch(
            config,
            self.rules,
            self.usage.other,
            self._namespaces,
            self.topology_levels,
            clock,
            self.bad_input,
            self.log,
            self._send,
            lambda: self.rest,
            self._spawn,
            lambda name: self.attempt_watch.node_gone(name),
        )
        self.foreign_pods = ForeignPods(
            self.usage, self.node_watch, self.attempts, self._namespaces
        )
        self.objects = WorkloadObjects(
            config,
            self._namespaces,
            self.attempts,
            lambda: self.rest,
            self._muster_pods,
            self.log,
        )
        self.attempt_watch = AttemptWatch(
            self.attempts,
            self._namespaces,
            self.node_watch.gone,
            self.log,
            self._send,
            lambda: self._live,
            self._muster_pods,
            self.node_watch.note_disruption,
            self.foreign_pods.hold,
            self._forget_held,
            self._ended,
        )
        self.watches = Watches(
            config,
            self._namespaces,
            self._status_kinds,
            self.bad_input,
            self.node_watch,
            self.foreign_pods,
            (self.attempt_watch.replace_pods, self.attempt_watch.pod_event),
            lambda res: (self.attempt_watch.job_replacer(res), self.attempt_watch.job_handler(res)),
            self.objects.scan,
            self._stop,
            self.log,
        )
        self.quotas = QuotaReads(lambda: self.rest)  # read before an attempt is created
        # The cluster's fence Lease (agents/kube/fencing.py, fence.py).
        self.lease = LeaseKeeper(cluster, config.namespace, lambda: self.rest, clock, self.log)
        self.fence_state = self.lease.state
        # Checkpoint reports from pods (agents/kube/report.py); the URL pods get, once bound.
        self.report_server: ReportServer | None = None
        self.report_url: str | None = None
        self.autoscaling: Autoscaling | None = None  # autoscaled pools (agents/kube/pools.py)

    @property
    def node_reflector(self) -> Reflector[KNode] | None:
        return self.watches.node

    @property
    def pod_reflector(self) -> Reflector[KPod] | None:
        """Every unfinished pod."""
        return self.watches.pod

    @property
    def muster_pod_reflector(self) -> Reflector[KPod] | None:
        """Muster's pods, any phase."""
        return self.watches.muster_pod

    @property
    def job_reflectors(self) -> dict[str, Reflector[KJob]]:
        """Muster's workload objects with a status, by collection."""
        return self.watches.jobs

    def _muster_pods(self) -> dict[str, KPod]:
        """Muster's pods as last seen, by uid."""
        return self.muster_pod_reflector.cache if self.muster_pod_reflector else {}

    @property
    def bad_objects(self) -> int:
        """Workload objects whose status did not decode."""
        return self.attempts.bad_objects

    @classmethod
    def from_config(
        cls,
        cluster: str,
        raw: dict[str, Any],
        topology_levels: Sequence[str] = (),
        declared_pools: Mapping[str, ProvisionPool] | None = None,
    ) -> KubeBackend:
        """Build from the agent config's `kube:` mapping, `topology.levels` and `pools:`;
        KubeConfigError names a bad field. The API client is created in `start` (loading a
        kubeconfig is async)."""
        return cls(
            cluster,
            convert_kube_config(raw),
            topology_levels=topology_levels,
            declared_pools=declared_pools,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def _make_api(self) -> ApiClient:
        cfg = Configuration()
        if self.config.in_cluster:
            kube_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            self.refresher = await TokenRefresher.load(
                cfg, self.config.kubeconfig, self.config.context
            )
        return ApiClient(configuration=cfg)

    async def _refresh_credentials(self) -> bool:
        return self.refresher is not None and await self.refresher.force()

    @property
    def rest(self) -> KubeRest:
        if self._rest is None:
            raise BackendError("kube backend not started")
        return self._rest

    async def start(self, emit: Emit) -> None:
        """List nodes, pods and Muster's objects (so `snapshot` is complete when this
        returns), emit outstanding spot notices and GPU failures, then watch."""
        if self._started:
            return
        self._started = True
        try:
            await self._start(emit)
        except BaseException:
            self._started = False  # let the caller retry after e.g. an unreachable API server
            raise

    async def _start(self, emit: Emit) -> None:
        self._emit = emit
        if self._api is None:
            self._api = await self._make_api()
        cfg = self.config
        limit = RateLimit(cfg.api_qps, cfg.api_burst, cfg.api_inflight)
        self._rest = KubeRest(self._api, cfg.request_timeout_s, self._refresh_credentials, limit)
        common = self.watches.build(self._rest)
        await self.watches.initial_lists()
        self.autoscaling = await Autoscaling.start(
            self._rest, cfg, self.declared_pools, common, self._flavors_changed
        )
        await self.lease.adopt()
        self._live = True  # before the report endpoint: a report it takes is emitted
        await self._start_report_server()
        self.node_watch.send_outstanding()
        reflectors: list[Reflector[Any]] = [
            *self.watches.all(),
            *(self.autoscaling.reflectors if self.autoscaling else ()),
        ]
        self._tasks = [
            *(
                asyncio.create_task(r.run(), name=f"kube-{r.name}-{self.cluster}")
                for r in reflectors
            ),
            asyncio.create_task(self._housekeeping(), name=f"kube-gc-{self.cluster}"),
            asyncio.create_task(self._timers(), name=f"kube-timers-{self.cluster}"),
        ]
        nodes, workloads = len(self.node_watch.nodes), len(self.attempts.workloads)
        self.log.info("kube backend started", nodes=nodes, workloads=workloads)

    async def _start_report_server(self) -> None:
        """Serve checkpoint reports. A port that cannot be bound leaves the agent running
        without them (pods then get no MUSTER_REPORT_URL and the SDK's other routes)."""
        if not self.config.report.enabled:
            return
        server = ReportServer(self.config.report, self.accept_report, self.cluster)
        try:
            base = await server.start()
        except OSError as exc:
            self.log.error(
                "checkpoint report endpoint not started; pods cannot report checkpoints. "
                "Free the port or set kube.report.listen_port",
                host=self.config.report.listen_host,
                port=self.config.report.listen_port,
                error=str(exc)[:300],
            )
            return
        self.report_server, self.report_url = server, base + REPORT_PATH

    def stale_s(self) -> float:
        """Seconds the node or pod watches have been failing, once past `stale_after_s`
        (0 = fresh): the heartbeat carries it and the broker stops placing work here."""
        return self.watches.stale_s(self.config.stale_after_s)

    @property
    def counters(self) -> dict[str, int]:
        """What the agent exports as metrics: watch health and bad input per kind/reason."""
        out = self.watches.counters()
        if self._rest is not None:
            out["credential_refreshes"] = self._rest.refreshes
            out["throttled"] = self._rest.throttled
            out["api_requests"] = self._rest.sent
        for (kind, reason), n in self.bad_input.counts.items():
            out[f"bad_input{{kind={kind},reason={reason}}}"] = n
        for how, n in self.objects.deletions.items():
            out[f"attempt_deletions{{by={how}}}"] = n
        return out

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self.report_server is not None:
            await self.report_server.stop()
            self.report_server = self.report_url = None
        if self.autoscaling is not None:
            await self.autoscaling.stop()
        for b in list(self._background):
            b.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await b
        if self._owns_api and self._api is not None:
            await self._api.close()
            self._api = None

    def _send(self, event: AgentEvent) -> None:
        if self._live and self._emit is not None:
            self._emit(event)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background; `stop` cancels it."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _forget_held(self, uid: str) -> None:
        """A Muster pod is gone: it holds nothing and disrupts no node any more."""
        self.foreign_pods.set(uid, None, ())
        self.node_watch.drop_disruption(uid)

    def _ended(self, w: Workload, st: WorkloadStatus) -> None:
        """An attempt reached a terminal phase: withdraw the autoscaler request it consumed
        and, when it finished, free the GPUs of its pods that still run."""
        if self.autoscaling is not None and w.job_id in self.autoscaling.asks:
            self.autoscaling.withdraw_later(w.job_id, 0.0)  # the request it consumed
        if st.phase in ("succeeded", "failed") and self.config.release_finished_pods:
            self._spawn(self.objects.release_finished((w.job_id, w.attempt)))

    # -- nodes -----------------------------------------------------------------------------
    def evaluate_timers(self) -> None:
        """Re-read the nodes whose verdict depends on time (`NodeWatch.evaluate_timers`)."""
        self.node_watch.evaluate_timers()

    async def _timers(self) -> None:
        while not await sleep_or_stop(self._stop, self.tick_s):
            try:
                self.evaluate_timers()
            except Exception as exc:  # keep ticking; a bad node is logged, not fatal
                self.bad_input.note(
                    "Node", f"evaluation failed: {type(exc).__name__}", error=str(exc)[:200]
                )

    # -- commands --------------------------------------------------------------------------
    def _plan(self, cmd: Dispatch) -> tuple[FlavorConfig, str, WorkloadPlan]:
        flavor = self.config.flavor(cmd.flavor)
        if flavor is None:
            known = [f.name for f in self.config.flavors]
            raise BackendError(f"flavor {cmd.flavor!r} is not configured here (known: {known})")
        ns = self.config.namespace_for(cmd.spec.queue)
        grown = self.autoscaling.consume(cmd.job_id) if self.autoscaling else {}
        try:
            plan = build_workload(
                cmd,
                flavor,
                ns,
                self.rules.resource(flavor),
                self.config,
                self.node_watch.provider_of(cmd),
                self.report_url,
                grown,
            )
        except ManifestError as exc:
            raise BackendError(str(exc)) from None
        return flavor, ns, plan

    async def dispatch(self, cmd: Dispatch) -> None:
        flavor, ns, plan = self._plan(cmd)
        if self.autoscaling is not None:
            await self.autoscaling.release(cmd.job_id, keep_request=True)
        key = (cmd.job_id, cmd.attempt)
        w = self.attempts.workloads.get(key)
        if w is None or not w.objects:  # a retried dispatch's own pods are in the quota's usage
            usage = attempt_usage(cmd, self.rules.resource(flavor))
            over = await self.quotas.refusal(ns, usage)
            if over is not None:
                raise JobRefused(over)  # nothing exists yet: the broker places it elsewhere
        async with self._dispatching:
            await self._create(cmd, ns, plan)
        if cmd.attempt > 1:
            # Older attempts go in the background: the ack (and so the new attempt's start)
            # must not wait for a list of every workload kind.
            self._spawn(self.objects.gc_older(cmd.job_id, cmd.attempt))

    async def _create(self, cmd: Dispatch, ns: str, plan: WorkloadPlan) -> None:
        """Make the attempt's objects, with no more attempts being made at once than requests
        may be in flight (the quota checks before share their reads, `QuotaReads`): begun all
        at once, a burst's requests queued behind each other's at the API budget and none was
        done (reported, answered) until nearly all were, so the broker heard no progress and
        asked every Dispatch again (broker/ackwait.py)."""
        w = self.attempts.dispatched(cmd, plan.total_replicas, ns)
        if cmd.fence_after_s > 0:
            # The Lease covers the attempt before anything of it exists. A Lease already kept
            # is renewed by the runtime, from when the broker last acknowledged this agent, not
            # from this Dispatch's arrival (agents/gate.py); the first one starts now.
            self.fence_state.granted(cmd.fence_after_s)
            if self.fence_state.until is None:
                await self.renew_fence(self._clock())
        await self.objects.create(cmd, ns, plan, w)
        self.attempt_watch.report(w)

    async def resize(self, cmd: Dispatch) -> None:
        """A Dispatch revision of a running attempt (an elastic podset shrank or grew): its
        object is merge-patched to what the revision renders (`Adapter.resize_patch`: the
        kind's own replica field). CannotResize when the kind cannot change size in place."""
        w = self.attempts.workloads.get((cmd.job_id, cmd.attempt))
        if w is None or not w.objects:
            raise BackendError(f"attempt {cmd.attempt} of job {cmd.job_id} does not run here")
        _, ns, plan = self._plan(cmd)
        await self.objects.resize(cmd, ns, plan)
        w.total = plan.total_replicas
        self.attempt_watch.report(w)

    async def cancel(self, job_id: str, attempt: int | None, reason: str) -> None:
        if attempt is None:
            self.attempts.cancel_upto[job_id] = float("inf")
        else:
            self.attempts.cancelled.add((job_id, attempt))

        def keep(a: int) -> bool:
            return attempt is not None and a != attempt

        try:
            await self.objects.delete_attempts(job_id, keep, reason or "cancel", attempt)
        except KubeApiError as exc:
            raise BackendError(f"cancel {job_id}: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise BackendError(f"cancel {job_id}: {exc!r}") from None
        for key in [k for k in self.attempts.workloads if k[0] == job_id and not keep(k[1])]:
            self.attempts.workloads[key].cancelled = True
            self.attempt_watch.hold_all(key)
        if self.autoscaling is not None and attempt is None:
            await self.autoscaling.release(job_id)

    # -- fencing: one Lease per cluster, renewed while the broker hears this agent; the fence
    # watchdog and the in-pod self-fence read it (agents/kube/fence.py)
    def fences(self, job_id: str, attempt: int) -> bool:
        """Whether the cluster itself ends this attempt when its fence lapses: with a fence
        watchdog beside this agent, every kind in the namespace it watches (the default one);
        elsewhere (a team's namespace) and without one, the agent's self-fence."""
        watched = self.namespace_of((job_id, attempt)) == self.config.namespace
        return self.config.fence_watchdog and self.fence_state.window_s > 0 and watched

    def fence_after(self, job_id: str, attempt: int) -> float:
        """The fence window of an attempt found at startup: the cluster's, which the Lease
        records, for every kind (0: no fence)."""
        return self.fence_state.window_s

    async def fence(self, job_id: str, attempt: int, until: float) -> None:
        """Per-attempt form of `renew_fence`: the one Lease covers every attempt."""
        window = self.fence_state.window_s
        if window > 0:
            await self.renew_fence(until - window)

    async def renew_fence(self, since: float) -> None:
        """The broker heard this agent at `since`: move the cluster's Lease (`LeaseKeeper`)."""
        await self.lease.renew(since)

    async def checkpoint_now(self, job_id: str, attempt: int, deadline: float) -> None:
        """Ask every pod of the attempt for a checkpoint (`WorkloadObjects.checkpoint_now`)."""
        await self.objects.checkpoint_now(job_id, attempt, deadline)

    def accept_report(self, report: ReportBody) -> Verdict:
        """A checkpoint report a pod posted (`Attempts.accept_report`); a taken one is sent."""
        verdict, event = self.attempts.accept_report(report, self.cluster)
        if event is not None:
            self._send(event)
            self.log.info(
                "checkpoint reported",
                job_id=report.job_id,
                attempt=report.attempt,
                step=report.step,
            )
        return verdict

    async def node_op(self, op: NodeOpName, node: str | None, reason: str) -> NodeOpResult:
        """An operator's cordon, uncordon or drain (agents/kube/nodeops.py)."""
        nodes, ns = list(self.node_watch.nodes), self.config.namespace
        args = (self.rest, self.cluster, ns, nodes, self._muster_pods(), self.attempts.pod_key)
        return await kube_node_op(*args, op, node, reason)

    async def read_logs(self, req: LogRequest) -> LogTail:
        """The attempt's container logs (agents/kube/logs.py); ended once its workload is."""
        key = (req.job_id, req.attempt)
        lines = await read_pod_logs(self.rest, self.namespace_of(key), self.cluster, req)
        w = self.attempts.workloads.get(key)
        ended = w is None or w.cancelled or w.current_phase() in ("succeeded", "failed", "evicted")
        return LogTail(lines=lines, ended=ended)

    def namespace_of(self, key: Key) -> str:
        """Where an attempt's pods are: where it was seen, else the default namespace."""
        return self.attempts.namespace_of(key, self.config.namespace)

    # -- snapshot and housekeeping ---------------------------------------------------------
    def flavors(self) -> list[FlavorInfo]:
        mem = self.node_watch.gpu_memory_mib()
        levels = self.topology_levels
        pools: dict[str, ProvisionPool] = {}
        if self.autoscaling is not None:
            have: dict[str, int] = {}
            for n in self.node_watch.nodes.values():
                if n.flavor is not None:
                    have[n.flavor.name] = have.get(n.flavor.name, 0) + 1
            pools = self.autoscaling.pools_by_flavor(have)
        return [
            msgspec.structs.replace(
                f.info(mem.get(f.name, 0)), topology_levels=levels, provision=pools.get(f.name)
            )
            for f in self.config.flavors
        ]

    def _flavors_changed(self) -> None:
        """What a flavor reports changed (a NodePool): the runtime sends a full snapshot."""
        if self._live:
            self._send(ClusterSnapshot(flavors=[], nodes=[]))

    async def provision(self, cmd: Provision) -> None:
        """Ask the autoscaler behind `cmd.flavor` for the gang's nodes (agents/kube/pools.py)."""
        if self.autoscaling is None:
            raise BackendError(
                f"cluster {self.cluster} reads and declares no autoscaled pool (set "
                "kube.autoscaling, or declare the pool in the agent's `pools:`)"
            )
        read = {f.name: f.provision for f in self.flavors() if f.provision is not None}
        await self.autoscaling.ask(cmd, read, self._clock(), self.cluster)

    async def snapshot(self) -> ClusterSnapshot:
        nodes = [n.info for n in self.node_watch.nodes.values() if n.info is not None]
        workloads = [w.status() for w in self.attempts.workloads.values() if not w.cancelled]
        return ClusterSnapshot(flavors=self.flavors(), nodes=nodes, workloads=workloads)

    async def _housekeeping(self) -> None:
        """Every resync period: delete objects of attempts older than the newest one known
        for the same job, and forget finished, object-less workloads. A pass is also what
        lets a cancel delete what it knows without listing (`known_in_full`)."""
        while not await sleep_or_stop(self._stop, self.config.resync_period_s):
            try:
                await self.collect_garbage()
            except Exception as exc:  # keep the loop alive; the next period retries
                self.log.warning("garbage collection failed", error=str(exc)[:300])

    async def collect_garbage(self) -> int:
        """Delete objects of attempts older than the newest known for the same job; forget
        finished, object-less workloads. The count deleted."""
        return await self.objects.collect_garbage()
