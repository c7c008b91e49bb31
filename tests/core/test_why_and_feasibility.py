"""What a user sees first: the queue a job lands in, submissions no quota can ever admit, and
`why` per cluster x flavor with the binding constraint and its numbers."""

from __future__ import annotations

from broker.core.effects import Refused, refusal, split_reply
from broker.core.inputs import CYCLE, AgentBatch, CancelJob, SubmitJob
from broker.core.machine import Machine
from schemas.agent import ClusterSnapshot, EventBatch, FlavorInfo, NodeInfo
from schemas.config import BrokerConfig, FlavorClass, QueueConfig
from schemas.job import JobSpec, PodSet
from tests.core.helpers import queue

T0 = 1_800_000_000.0
A100_OD = FlavorInfo(name="a100-od", capacity_type="on-demand", gpu_type="a100")
T4_SPOT = FlavorInfo(name="t4-spot", capacity_type="spot", gpu_type="t4")
CLASSES = [
    FlavorClass(name="gpu-a100", capacity_type="on-demand", gpu_type="a100"),
    FlavorClass(name="gpu-t4-spot", capacity_type="spot", gpu_type="t4"),
]


def machine(*queues: QueueConfig) -> Machine:
    return Machine(BrokerConfig(queues=list(queues), flavors=CLASSES), epoch=1)


def report(m: Machine, cluster: str, *flavors: FlavorInfo, nodes: int = 4) -> None:
    snap = ClusterSnapshot(
        flavors=list(flavors),
        nodes=[
            NodeInfo(name=f"{cluster}-{f.name}-{i}", flavor=f.name, gpu=8, cpu_milli=96_000,
                     memory=2**40)
            for f in flavors
            for i in range(nodes)
        ],
    )  # fmt: skip
    out = m.handle(
        AgentBatch(cluster, EventBatch(cluster=cluster, instance="i", seq=1, events=[snap])), T0
    )
    assert refusal(out) is None


def spec(name: str, gpus: int, queue_name: str | None = None, **kw: object) -> JobSpec:
    replicas, per = (gpus // 8, 8) if gpus > 8 else (1, gpus)
    gang = [PodSet(name="w", replicas=replicas, gpu=per, cpu="8", memory="8Gi")]
    return JobSpec(name=name, gang=gang, queue=queue_name, **kw)  # type: ignore[arg-type]


ML = queue(
    "ml",
    cohort="team",
    quotas={"gpu-a100": {"gpu": (8, 4, None)}, "gpu-t4-spot": {"gpu": (4, 0, None)}},
)
PEER = queue("peer", cohort="team", quotas={"gpu-a100": {"gpu": (8, None, None)}})


def test_a_job_naming_no_queue_goes_to_default_when_configured() -> None:
    m = machine(QueueConfig(name="default"), ML)
    reply, _ = split_reply(m.handle(SubmitJob(spec("j", 8)), T0))
    assert reply.accepted and reply.job_id
    assert m.jobs[reply.job_id].queue == "default"


def test_a_job_naming_no_queue_is_refused_without_a_default_queue() -> None:
    m = machine(ML)
    reply, effects = split_reply(m.handle(SubmitJob(spec("j", 8)), T0))
    assert not reply.accepted and effects == [] and not m.jobs
    assert reply.error == (
        "the job names no queue and the config has no queue named 'default' to take it; "
        "name one (--queue, `queue:`); known queues: ml"
    )


def test_submission_rejects_a_gang_above_nominal_plus_borrowing_everywhere() -> None:
    m = machine(ML, PEER)
    report(m, "east", A100_OD, T4_SPOT)
    reply, effects = split_reply(
        m.handle(SubmitJob(spec("big", 16, "ml", gpu_types=["a100", "t4"])), T0)
    )
    assert not reply.accepted and effects == [] and not m.jobs
    error = reply.error or ""
    assert "queue ml can never admit it" in error
    assert "gpu-a100: needs 16 gpu > 12 (nominal 8 + borrowing limit 4, of which" in error
    assert "gpu-t4-spot: needs 16 gpu > 4" in error
    # 12 = nominal 8 + borrowing limit 4 is admissible (it waits for quota, not forever).
    ok, _ = split_reply(m.handle(SubmitJob(spec("fits", 12, "ml", gpu_types=["a100"])), T0))
    assert ok.accepted, ok.error


def test_ceiling_is_checked_before_any_cluster_reports_and_ignores_foreign_classes() -> None:
    m = machine(ML, PEER)
    reply, _ = split_reply(m.handle(SubmitJob(spec("big", 16, "ml", gpu_types=["a100"])), T0))
    assert not reply.accepted
    assert "gpu-t4-spot" not in (reply.error or "")  # T4 is not a type the job accepts
    # Without a borrowing limit the cohort's lendable quota is the ceiling: 8 own + 8 of ml's.
    ok, _ = split_reply(m.handle(SubmitJob(spec("peer-big", 16, "peer")), T0))
    assert ok.accepted, ok.error
    no, _ = split_reply(m.handle(SubmitJob(spec("peer-huge", 24, "peer")), T0))
    assert not no.accepted and "all cohort team lends" in (no.error or "")


def test_why_names_the_binding_constraint_per_cluster_and_flavor() -> None:
    m = machine(ML, PEER)
    report(m, "east", A100_OD, T4_SPOT, nodes=1)
    report(m, "west", FlavorInfo(name="h100-od", capacity_type="on-demand", gpu_type="h100"))
    first, _ = split_reply(m.handle(SubmitJob(spec("first", 8, "ml", gpu_types=["a100"])), T0))
    m.handle(CYCLE, T0)
    assert m.jobs[first.job_id or ""].state == "admitted"
    second, _ = split_reply(m.handle(SubmitJob(spec("second", 4, "ml", gpu_types=["a100"])), T0))
    m.handle(CYCLE, T0)
    why = m.views.why(second.job_id or "", T0)
    assert why is not None and why.state == "queued" and why.position == 0
    per = {(c.cluster, c.flavor): c for c in why.candidates}
    assert set(per) == {("east", "a100-od"), ("east", "t4-spot"), ("west", "h100-od")}
    a100 = per[("east", "a100-od")]
    assert a100.code == "insufficient-capacity", a100
    assert "0 GPUs free on 1 nodes" in a100.message
    assert per[("east", "t4-spot")].code == "no-matching-flavor"
    assert "no T4 accepted" in per[("east", "t4-spot")].message
    assert "no H100 accepted" in per[("west", "h100-od")].message
    assert why.waiting_for == "capacity"
    assert why.queue == "ml"
    view = m.views.job_view(second.job_id or "", T0)
    assert view is not None and view.waiting and view.waiting.startswith("insufficient-capacity")


def test_why_shows_quota_numbers_when_quota_binds() -> None:
    m = machine(queue("solo", quotas={"gpu-a100": {"gpu": (8, None, None)}}))
    report(m, "east", A100_OD, nodes=4)
    first, _ = split_reply(m.handle(SubmitJob(spec("first", 8, "solo")), T0))
    split_reply(m.handle(SubmitJob(spec("second", 8, "solo")), T0))
    third, _ = split_reply(m.handle(SubmitJob(spec("third", 8, "solo")), T0))
    m.handle(CYCLE, T0)
    assert m.jobs[first.job_id or ""].state == "admitted"
    why = m.views.why(third.job_id or "", T0)
    assert why is not None and why.position == 1  # `second` is ahead of it
    (c,) = why.candidates
    assert c.code == "quota-exceeded"
    assert c.message == "quota solo gpu 8/8 used, needs 8 > 0 left of nominal 8 + borrow ∞"
    assert why.waiting_for == "quota"


def test_cancel_of_an_ended_job_reads_as_a_sentence() -> None:
    m = machine(QueueConfig(name="default"))
    reply, _ = split_reply(m.handle(SubmitJob(spec("j", 1)), T0))
    assert refusal(m.handle(CancelJob(reply.job_id or "", "user"), T0)) is None
    effects = m.handle(CancelJob(reply.job_id or "", "user"), T0)
    assert effects == [Refused(f"job {reply.job_id} is already cancelled; nothing to cancel")]
