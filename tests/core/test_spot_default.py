"""The default placement of a job that writes no checkpoint: on-demand, not the cheaper spot
(a reclaim would lose all its work), unless the job or its queue says spot is fine; spot only
when no on-demand pool could ever host it."""

from __future__ import annotations

from typing import Any

from broker.core.effects import Send
from broker.core.machine import Machine
from schemas.agent import Dispatch
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import CheckpointSpec
from tests.core.harness import OD, SPOT, Sim, node, sends


def _world(**queue: Any) -> Sim:
    w = Sim.empty()
    w.m = Machine(BrokerConfig(queues=[QueueConfig(name="q", **queue)]), epoch=3)
    return w


def _mixed(w: Sim) -> None:
    """Cluster `s` has cheap spot, cluster `o` dearer on-demand, one 8-GPU node each."""
    w.cluster("s", flavor=SPOT)
    w.cluster("o", flavor=OD)


def _placed(w: Sim, job_id: str) -> str:
    (where,) = [
        f"{e.cluster}/{e.command.flavor}"
        for e in w.cycle()
        if isinstance(e, Send) and isinstance(e.command, Dispatch) and e.command.job_id == job_id
    ]
    return where


def test_a_job_without_checkpoints_goes_on_demand() -> None:
    w = _world()
    _mixed(w)
    assert _placed(w, w.submit("plain")) == "o/od"


def test_a_job_with_checkpoints_takes_the_cheaper_spot() -> None:
    w = _world()
    _mixed(w)
    job = w.submit("ckpt", checkpoint=CheckpointSpec(uri="s3://b/ckpt"))
    assert _placed(w, job) == "s/spot"


def test_the_job_or_its_queue_may_say_spot_is_fine() -> None:
    w = _world()
    _mixed(w)
    assert _placed(w, w.submit("said", labels={"muster.dev/spot-ok": "true"})) == "s/spot"
    w = _world(spot_without_checkpoint=True)
    _mixed(w)
    job = w.submit("queue-said")
    assert _placed(w, job) == "s/spot"
    assert w.m.jobs[job].spec.labels["muster.dev/spot-ok"] == "queue"


def test_a_full_on_demand_pool_is_waited_for_with_the_reason() -> None:
    w = _world()
    _mixed(w)
    first = w.submit("first")
    assert _placed(w, first) == "o/od"
    second = w.submit("second")
    assert not [d for d in sends(w.cycle(), Dispatch) if d.job_id == second]
    reason = w.m.views.first_reason(second) or ""
    assert "waiting for on-demand capacity" in reason, reason
    assert "writes no checkpoint" in reason


def test_spot_only_fleets_still_run_such_jobs() -> None:
    w = _world()
    w.cluster("s", flavor=SPOT)
    assert _placed(w, w.submit("only-spot")) == "s/spot"
    # an on-demand pool too small to ever host the gang does not hold it back either
    w = _world()
    w.cluster("s", flavor=SPOT)
    w.send("o", node_snapshot(OD, gpu=4))
    assert _placed(w, w.submit("big")) == "s/spot"


def node_snapshot(flavor: Any, gpu: int) -> Any:
    from schemas.agent import ClusterSnapshot

    n = node("o", 0, flavor.name)
    return ClusterSnapshot(flavors=[flavor], nodes=[n.__class__(**{**_fields(n), "gpu": gpu})])


def _fields(n: Any) -> dict[str, Any]:
    return {f: getattr(n, f) for f in n.__struct_fields__}


def test_why_says_why_a_running_job_got_its_pool_and_how_an_ended_one_ended() -> None:
    from rich.console import Console

    from broker.core.inputs import CancelJob
    from broker.render import why_view

    w = _world()
    _mixed(w)
    job = w.submit("plain")
    assert _placed(w, job) == "o/od"
    why = w.m.views.why(job, w.now)
    assert why is not None
    (placed,) = why.reasons
    assert placed.code == "placed"
    assert placed.message.startswith("on o/od (on-demand, A100, $3/GPU-h): the job writes no")
    w.m.handle(CancelJob(job, "done"), w.now)
    why = w.m.views.why(job, w.now)
    assert why is not None
    (ended,) = why.reasons
    assert ended.code == "ended" and "its last attempt (#1) ran on o/od" in ended.message
    console = Console(width=200, record=True, color_system=None)
    console.print(why_view(why))
    text = console.export_text()
    assert f"{job} has ended: cancelled" in text and "is cancelled" not in text


def test_why_names_the_spot_fallback_rule_that_moved_a_job_to_on_demand() -> None:
    from schemas.agent import SpotNotice, WorkloadStatus
    from schemas.job import SpotPolicy
    from tests.core.harness import run

    w = _world()
    _mixed(w)
    job = w.submit(
        "fb",
        capacity="spot-then-on-demand",
        checkpoint=CheckpointSpec(uri="s3://b/fb"),
        spot=SpotPolicy(fallback_after_preemptions=1),
    )
    assert _placed(w, job) == "s/spot"
    run(w, job, "s", 1)
    w.send("s", SpotNotice(node="s-0", deadline=w.now + 120))
    for _ in range(200):  # the checkpoint grace runs out; the next attempt starts on-demand
        w.cycle(1.0)
        if w.m.jobs[job].attempt == 2 and w.m.jobs[job].state in ("admitted", "running"):
            break
    record = w.m.jobs[job]
    assert record.current is not None and record.current.flavor == "od"
    w.send(
        "o",
        WorkloadStatus(
            job_id=job, attempt=2, phase="running", running_replicas=1, total_replicas=1
        ),
    )
    why = w.m.views.why(job, w.now)
    assert why is not None
    (placed,) = why.reasons
    assert placed.message.endswith(
        "fell back to on-demand after 1 spot preemptions (spot.fallback_after_preemptions: 1)"
    )


def test_jobs_alike_but_for_spot_ok_are_placed_apart_in_one_cycle() -> None:
    """The cycle's memo of candidate pools must tell them apart (neither checkpoints; one may
    use spot)."""
    w = _world()
    w.cluster("s", flavor=SPOT)
    w.cluster("o", flavor=OD)
    ckpt = w.submit("ok", labels={"muster.dev/spot-ok": "true"}, gpu=4)
    plain = w.submit("plain", gpu=4)
    where = {
        e.command.job_id: f"{e.cluster}/{e.command.flavor}"
        for e in w.cycle()
        if isinstance(e, Send) and isinstance(e.command, Dispatch)
    }
    assert where == {ckpt: "s/spot", plain: "o/od"}


def test_a_service_account_the_agents_refuse_is_refused_at_submission() -> None:
    """The agents allow `default` unless configured otherwise; the broker says so at submit,
    not as a failed dispatch later."""
    from broker.core.effects import split_reply
    from broker.core.inputs import SubmitJob
    from schemas.job import JobSpec, PodSet, Workload

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"serviceAccountName": "trainer", "containers": [{"name": "c", "image": "i"}]},
    }

    def submit(config: BrokerConfig) -> Any:
        m = Machine(config, epoch=3)
        spec = JobSpec(
            name="p",
            gang=[PodSet(name="pod", gpu=0)],
            workload=Workload(kind="manifest", manifest=pod),
        )
        reply, _ = split_reply(m.handle(SubmitJob(spec, subject_queue="q"), 0.0))
        return reply

    reply = submit(BrokerConfig(queues=[QueueConfig(name="q")]))
    assert not reply.accepted
    assert reply.error.startswith(
        "spec.serviceAccountName: service account 'trainer' is not one the clusters' agents "
        "allow (workload_service_accounts: default)"
    )
    allowed = BrokerConfig(
        queues=[QueueConfig(name="q")], workload_service_accounts=["default", "trainer"]
    )
    assert submit(allowed).accepted


def test_an_unknown_queue_gets_the_closest_name() -> None:
    from broker.core.submission import unknown_queue_text

    text = unknown_queue_text("reserch", ["default", "research"])
    assert (
        text == "unknown queue 'reserch'; did you mean 'research'? known queues: default, research"
    )
    assert unknown_queue_text("zzz", ["default"]) == "unknown queue 'zzz'; known queues: default"
