"""A stand-in for the broker's client-facing API, for client and CLI tests.

It is not a mock of NATS: it runs on the real nats-server from the fixtures and speaks the wire
contract (JSON JobSpec on `muster.submit.<queue>`, ApiReply on `muster.api.<verb>`, JobEvent on
`muster.events.job.<id>`) with a few lines of state. The real broker's end-to-end tests belong
to the lead; these pin down the client side of the contract.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.api import (
    TERMINAL_STATES,
    Accounting,
    ApiReply,
    AttemptView,
    CancelRequest,
    CheckpointView,
    ClusterView,
    FlavorUsage,
    FlavorView,
    JobEvent,
    JobRef,
    JobView,
    ListRequest,
    PendingReason,
    QueueView,
    ResourceUsage,
    SubmitReply,
    WhyView,
)
from schemas.codec import DecodeError, decode_jobspec, encode_json, json_decoder
from schemas.subjects import DEFAULT_SUBJECTS, Subjects
from shell.natsio import flush

_ref = json_decoder(JobRef, "JobRef")
_cancel = json_decoder(CancelRequest, "CancelRequest")
_list = json_decoder(ListRequest, "ListRequest")

NOW = 1_700_000_000.0


def sample_job(job_id: str = "train-1", state: str = "running") -> JobView:
    """A job with two attempts (one preempted), accounting and a checkpoint."""
    return JobView(
        job_id=job_id,
        name="train",
        queue="ml",
        state=state,  # type: ignore[arg-type]
        priority=5,
        submitted_at=NOW - 7200,
        gpus=16,
        attempt=2,
        cluster="gcp-west",
        flavor="a100-od",
        latest_checkpoint=CheckpointView(
            step=1200, uri="s3://ckpt/train/1200", at=NOW - 60, attempt=2
        ),
        attempts=[
            AttemptView(
                attempt=1,
                cluster="aws-east",
                flavor="a100-spot",
                capacity_type="spot",
                gpu_type="a100",
                dispatched_at=NOW - 7000,
                running_at=NOW - 6900,
                ended_at=NOW - 3600,
                end_cause="preempted",
                gpu_seconds=16 * 3300.0,
                gpu_seconds_lost=16 * 300.0,
                cost=40.0,
            ),
            AttemptView(
                attempt=2,
                cluster="gcp-west",
                flavor="a100-od",
                capacity_type="on-demand",
                gpu_type="a100",
                dispatched_at=NOW - 3590,
                running_at=NOW - 3500,
                resume_from_step=1000,
                gpu_seconds=16 * 3500.0,
                cost=150.0,
            ),
        ],
        accounting=Accounting(
            attempts=2,
            preemptions=1,
            gpu_seconds_used=16 * 6800.0,
            gpu_seconds_lost=16 * 300.0,
            goodput=0.956,
            cost=190.0,
        ),
    )


def sample_queue() -> QueueView:
    return QueueView(
        name="ml",
        cohort="research",
        strategy="BestEffortFIFO",
        weight=2.0,
        pending=3,
        admitted=1,
        dominant_share=0.5,
        flavors=[
            FlavorUsage(
                flavor="a100-od",
                resources=[
                    ResourceUsage(
                        resource="gpu", nominal=8, borrowing_limit=4, used=12, borrowed=4
                    ),
                    ResourceUsage(resource="cpu", nominal=64000, used=32000),
                    ResourceUsage(resource="memory", nominal=256 * 2**30, used=64 * 2**30),
                ],
            )
        ],
    )


def sample_cluster() -> ClusterView:
    return ClusterView(
        name="aws-east",
        health="healthy",
        last_heartbeat=NOW - 1,
        running_jobs=4,
        flavors=[
            FlavorView(
                name="a100-spot",
                capacity_type="spot",
                gpu_type="a100",
                price_per_gpu_hour=1.1,
                flavor_class="spot-a100",
                nodes=20,
                gpu_total=160,
                gpu_free=24,
                draining_nodes=1,
                interruptions=7,
                interruption_rate_per_node_hour=0.61,
            ),
            FlavorView(
                name="a100-od",
                capacity_type="on-demand",
                gpu_type="a100",
                price_per_gpu_hour=3.2,
                flavor_class="od-a100",
                nodes=4,
                gpu_total=32,
                gpu_free=8,
            ),
        ],
    )


class StandInBroker:
    """Answers the client-facing subjects from a dict of jobs."""

    def __init__(self, subjects: Subjects = DEFAULT_SUBJECTS) -> None:
        self.subjects = subjects
        self.jobs: dict[str, JobView] = {}
        self.submitted: list[tuple[str, bytes]] = []
        self.requests: list[tuple[str, bytes]] = []
        self.nc: Client | None = None
        self.fail_verb: str | None = None
        self.max_priority: int | None = None

    async def start(self, url: str) -> StandInBroker:
        self.nc = await nats.connect(url)
        await self.nc.subscribe(self.subjects.submit_all, cb=self._on_submit)
        await self.nc.subscribe(self.subjects.api_all, cb=self._on_api)
        await flush(self.nc)
        return self

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.drain()
            self.nc = None

    async def publish_event(self, event: JobEvent) -> None:
        assert self.nc is not None
        view = self.jobs.get(event.job_id)
        if view is not None:
            self.jobs[event.job_id] = msgspec.structs.replace(view, state=event.state)
        await self.nc.publish(self.subjects.job_events(event.job_id), encode_json(event))
        await flush(self.nc)

    async def _on_submit(self, msg: Msg) -> None:
        self.submitted.append((msg.subject, msg.data))
        queue = self.subjects.queue_of_submit_subject(msg.subject) or ""
        try:
            spec = decode_jobspec(msg.data)
        except DecodeError as exc:
            await msg.respond(encode_json(SubmitReply(accepted=False, error=str(exc))))
            return
        if spec.queue not in (None, queue):
            reply = SubmitReply(accepted=False, error=f"spec.queue {spec.queue!r} != {queue!r}")
            await msg.respond(encode_json(reply))
            return
        if self.max_priority is not None and spec.priority > self.max_priority:
            error = f"priority {spec.priority} is over this broker's limit of {self.max_priority}"
            await msg.respond(encode_json(SubmitReply(accepted=False, error=error)))
            return
        job_id = spec.job_id or f"{spec.name}-{len(self.jobs) + 1}"
        if job_id in self.jobs:
            await msg.respond(
                encode_json(SubmitReply(accepted=True, job_id=job_id, duplicate=True))
            )
            return
        self.jobs[job_id] = JobView(
            job_id=job_id,
            name=spec.name,
            queue=queue,
            state="queued",
            priority=spec.priority,
            submitted_at=NOW,
            gpus=spec.total_gpus,
            spec=spec,
        )
        await msg.respond(encode_json(SubmitReply(accepted=True, job_id=job_id)))

    async def _on_api(self, msg: Msg) -> None:
        verb = msg.subject.rpartition(".")[2]
        self.requests.append((verb, msg.data))
        try:
            result = self._answer(verb, msg.data)
            reply: ApiReply[Any] = ApiReply(ok=True, result=result)
        except (DecodeError, KeyError, ValueError) as exc:
            reply = ApiReply(ok=False, error=str(exc).strip('"'))
        await msg.respond(encode_json(reply))

    def _answer(self, verb: str, data: bytes) -> Any:
        if verb == self.fail_verb:
            raise ValueError(f"{verb} is broken today")
        if verb == "get":
            ref = _ref(data)
            if ref.job_id not in self.jobs:
                raise KeyError(f"unknown job {ref.job_id!r}")
            return self.jobs[ref.job_id]
        if verb == "list":
            req = _list(data)
            jobs = [
                j
                for j in self.jobs.values()
                if (req.queue is None or j.queue == req.queue)
                and (req.state is None or j.state == req.state)
                and (req.cluster is None or j.cluster == req.cluster)
            ]
            return jobs[: req.limit]
        if verb == "cancel":
            req2 = _cancel(data)
            if req2.job_id not in self.jobs:
                raise KeyError(f"unknown job {req2.job_id!r}")
            job = self.jobs[req2.job_id]
            if job.state not in TERMINAL_STATES:
                job = msgspec.structs.replace(job, state="cancelled", reason=req2.reason)
                self.jobs[req2.job_id] = job
            return job
        if verb == "why":
            ref = _ref(data)
            if ref.job_id not in self.jobs:
                raise KeyError(f"unknown job {ref.job_id!r}")
            return WhyView(
                job_id=ref.job_id,
                state=self.jobs[ref.job_id].state,
                position=0,
                reasons=[
                    PendingReason(
                        code="quota",
                        message="queue ml has 8 of 8 nominal a100 GPUs in use",
                        flavor="a100-od",
                    ),
                    PendingReason(
                        code="capacity",
                        message="largest free block is 6 GPUs on one node; podset worker needs 8",
                        cluster="aws-east",
                        flavor="a100-spot",
                    ),
                ],
            )
        if verb == "queues":
            return [sample_queue()]
        if verb == "clusters":
            return [sample_cluster()]
        raise ValueError(f"unknown API verb {verb!r}")


class ThreadedStandIn:
    """The stand-in on its own event loop in a thread, for the synchronous CLI tests."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.broker = StandInBroker()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> StandInBroker:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.broker.start(self.url), self._loop).result(10)
        return self.broker

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.broker.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
