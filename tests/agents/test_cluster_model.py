"""The cluster model on a clock the test moves: exact steps, deadlines and evictions."""

from __future__ import annotations

import msgspec
import pytest

from agents.backend import BackendError
from agents.config import FakeClusterConfig, FakeFlavor
from agents.fake.model import ClusterModel, ManualClock, WorkloadTiming
from schemas.agent import (
    AgentEvent,
    CheckpointRef,
    CheckpointReport,
    Dispatch,
    GpuHealth,
    LogRequest,
    NodeGone,
    PodSetAssignment,
    SpotNotice,
    WorkloadStatus,
)
from schemas.job import Simulation
from tests.agents.cluster_model import CONFIG, model, run_until, statuses
from tests.agents.helpers import dispatch


def test_a_workload_starts_steps_checkpoints_and_succeeds_on_time() -> None:
    m, clock, got = model()
    sim = Simulation(total_steps=100, steps_per_second=10.0, checkpoint_every=25)
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    assert [s.phase for s in statuses(got, "created")] == ["created"]
    run_until(m, clock, 0.75)
    assert statuses(got, "running") == []  # start_delay_s is 1 s
    run_until(m, clock, 1.0)
    assert len(statuses(got, "running")) == 1
    run_until(m, clock, 5.0)  # 40 steps in: the checkpoint at 25 is written, 50 not yet
    assert [r.step for r in got if isinstance(r, CheckpointReport)] == [25]
    assert m.workload("j", 1).step == 40  # type: ignore[union-attr]
    run_until(m, clock, 10.75)
    assert statuses(got, "succeeded") == []  # 100 steps at 10/s take 10 s after the start
    run_until(m, clock, 11.0)
    (done,) = statuses(got, "succeeded")
    assert done.step == 100 and done.exit_codes == [0]
    assert [r.step for r in got if isinstance(r, CheckpointReport)] == [25, 50, 75]
    assert m.free_gpus(m.nodes_of("od-a100")[0]) == 8


def test_time_scale_maps_simulated_deadlines_to_unix_seconds() -> None:
    m, clock, got = model(scale=20.0)
    node = m.nodes_of("spot-a100")[0]
    deadline = m.spot_notice(node, lead_s=60.0)
    assert deadline == pytest.approx(clock.unix0 + 60.0 / 20.0)  # 60 simulated s = 3 real s
    (notice,) = [e for e in got if isinstance(e, SpotNotice)]
    assert notice.deadline == deadline


def test_a_spot_notice_reclaims_the_node_at_its_deadline_and_loses_progress() -> None:
    m, clock, got = model()
    sim = Simulation(total_steps=10_000, steps_per_second=10.0, checkpoint_every=25)
    nodes = m.nodes_of("spot-a100")
    m.create(dispatch("j", nodes, sim=sim))
    run_until(m, clock, 4.5)  # 35 steps: checkpoint at 25
    deadline = m.spot_notice(nodes[1], lead_s=2.0)
    assert deadline == pytest.approx(clock.unix() + 2.0)
    run_until(m, clock, 6.25)
    assert statuses(got, "evicted") == []  # still before the deadline
    run_until(m, clock, 6.5)
    (evicted,) = statuses(got, "evicted")
    assert evicted.reason == "spot-reclaimed" and evicted.step == 55
    (gone,) = [e for e in got if isinstance(e, NodeGone)]
    assert gone.node == nodes[1]
    (rec,) = m.history["j"]
    assert (rec.last_checkpoint_step, rec.last_step, rec.end_phase) == (50, 55, "evicted")
    assert m.free_gpus(nodes[0]) == 8  # the whole gang went


def test_a_lapsed_fence_stops_the_attempt_as_of_the_fence() -> None:
    m, clock, got = model()
    sim = Simulation(total_steps=10_000, steps_per_second=10.0, checkpoint_every=1000)
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    run_until(m, clock, 2.0)
    m.set_fence("j", 1, clock.unix() + 3.0)
    run_until(m, clock, 4.0)
    assert m.live_workloads() == [("j", 1)]
    m.set_fence("j", 1, clock.unix() + 3.0)  # extended before it lapsed
    clock.advance(10.0)  # frozen for 10 s: nothing ran meanwhile
    assert m.live_workloads() == []
    (evicted,) = statuses(got, "evicted")
    assert "fence lapsed" in evicted.reason
    assert evicted.step == 60  # stopped at t=7 (1 s start delay, 6 s of steps), not t=14
    assert m.history["j"][0].ended_at == pytest.approx(clock.unix0 + 7.0)
    m.set_fence("j", 1, clock.unix() + 100.0)  # a lapsed fence cannot be extended
    assert m.live_workloads() == []


def test_fences_end_only_the_attempts_whose_latest_fence_lapsed() -> None:
    """Eight attempts with fences at different times, some extended (some more than once),
    one ended by its own removal: each attempt ends exactly when its latest fence lapses, as
    of that moment, and an extended or removed one is never ended by an old fence."""
    m, clock, got = model(FakeClusterConfig(flavors=[FakeFlavor(name="od", nodes=4)], seed=7))
    sim = Simulation(total_steps=100_000, steps_per_second=10.0, checkpoint_every=10_000)
    nodes = m.nodes_of("od")
    jobs = [f"j{i}" for i in range(8)]
    for i, job in enumerate(jobs):
        m.create(dispatch(job, [nodes[i // 2]], flavor="od", gpu=4, sim=sim))
    run_until(m, clock, 2.0)
    t0 = clock.unix()
    fences = {job: t0 + 1.0 + i for i, job in enumerate(jobs)}  # j0 at +1 ... j7 at +8
    for job, until in fences.items():
        m.set_fence(job, 1, until)
    for job in ("j1", "j4"):  # extended before they lapse, j4 twice
        fences[job] += 10.0
        m.set_fence(job, 1, fences[job])
    fences["j4"] += 5.0
    m.set_fence("j4", 1, fences["j4"])
    m.set_fence("j5", 1, t0)  # an earlier fence does not shorten a later one
    m.remove("j6", 1, "cancelled")
    del fences["j6"]
    while clock.unix() < t0 + 20.0:
        run_until(m, clock, clock.now() + 0.5, step=0.5)
        live = {job for job, _ in m.live_workloads()}
        for job, until in fences.items():
            assert (job in live) == (until > clock.unix()), (job, clock.unix() - t0)
    assert "j6" not in {s.job_id for s in statuses(got, "evicted")}
    for s in statuses(got, "evicted"):
        assert "fence lapsed" in s.reason
        assert m.history[s.job_id][0].ended_at == pytest.approx(fences[s.job_id])
    assert sorted(s.job_id for s in statuses(got, "evicted")) == sorted(fences)
    assert m.counters["fenced"] == len(fences)


def test_checkpoint_now_writes_the_current_step_after_the_write_time() -> None:
    m, clock, got = model(msgspec.structs.replace(CONFIG, checkpoint_write_s=2.0))
    sim = Simulation(total_steps=10_000, steps_per_second=10.0, checkpoint_every=1000)
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    m.checkpoint("j", 1)  # not running yet: nothing to save
    run_until(m, clock, 3.0)
    m.checkpoint("j", 1)
    run_until(m, clock, 4.75)
    assert [e for e in got if isinstance(e, CheckpointReport)] == []
    run_until(m, clock, 5.0)
    (report,) = [e for e in got if isinstance(e, CheckpointReport)]
    assert report.step == 20 and report.at == pytest.approx(clock.unix0 + 5.0)


def test_resume_counts_from_the_checkpoint_step() -> None:
    m, clock, got = model()
    sim = Simulation(total_steps=60, steps_per_second=10.0, checkpoint_every=10)
    ref = CheckpointRef(step=35, uri="s3://ckpt/j/step-35")
    m.create(dispatch("j", m.nodes[:1], attempt=2, sim=sim, resume_from=ref))
    run_until(m, clock, 3.25)
    assert statuses(got, "succeeded") == []  # 25 steps left: 1 s start + 2.5 s
    run_until(m, clock, 3.5)
    (done,) = statuses(got, "succeeded")
    assert done.step == 60
    assert [r.step for r in got if isinstance(r, CheckpointReport)] == [40, 50]


def test_a_gpu_failure_evicts_and_shrinks_the_node() -> None:
    m, _, got = model()
    node = m.nodes_of("od-a100")[0]
    m.create(dispatch("j", [node], flavor="od-a100"))
    assert m.fail_gpu(node, count=2, xid=48)
    (health,) = [e for e in got if isinstance(e, GpuHealth)]
    assert (health.healthy, health.xid) == (6, 48)
    assert "xid-48" in statuses(got, "evicted")[0].reason
    with pytest.raises(BackendError, match="over-committed: 8 GPUs asked, 6 free"):
        m.create(dispatch("j2", [node], flavor="od-a100"))


def test_logs_follow_the_clock() -> None:
    m, clock, _ = model()
    sim = Simulation(total_steps=100, steps_per_second=10.0, checkpoint_every=10)
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    run_until(m, clock, 3.0)
    tail = m.logs(LogRequest(job_id="j", attempt=1))
    assert not tail.ended and any("step 20" in line for line in tail.lines)
    assert not any("step 30" in line for line in tail.lines)


def test_poisson_spot_notices_are_seeded_and_only_on_spot_nodes() -> None:
    config = FakeClusterConfig(
        flavors=[
            FakeFlavor(name="spot", capacity_type="spot", nodes=20),
            FakeFlavor(name="od", nodes=20),
        ],
        spot_rate_per_node_hour=1.0,
        spot_notice_s=60.0,
        seed=1,
    )

    def one_hour() -> list[AgentEvent]:
        m, clock, got = model(config)
        run_until(m, clock, 3600.0, step=5.0)
        assert len(m.nodes_of("od")) == 20
        return got

    got = one_hour()
    notices = [e for e in got if isinstance(e, SpotNotice)]
    assert 8 <= len(notices) <= 20  # 20 spot node-hours at one per node-hour, fewer as they go
    assert all("-spot-" in n.node for n in notices)
    assert len([e for e in got if isinstance(e, NodeGone)]) >= len(notices) - 1
    assert one_hour() == got  # the same seed, the same hour


# -- per-dispatch timing (the simulator's GPU speeds and checkpoint costs) -----------------


def timed(timing: WorkloadTiming) -> tuple[ClusterModel, ManualClock, list[AgentEvent]]:
    """A model whose every dispatch gets `timing`."""
    m, clock, got = model()

    def hook(_: Dispatch) -> WorkloadTiming:
        return timing

    m.timing = hook
    return m, clock, got


def reports(got: list[AgentEvent]) -> list[tuple[int, float]]:
    return [(e.step, e.at - 1_700_000_000.0) for e in got if isinstance(e, CheckpointReport)]


def test_speed_start_delay_and_restore_come_from_the_timing() -> None:
    m, clock, got = timed(WorkloadTiming(start_delay_s=2.0, restore_s=3.0, speed=2.0))
    sim = Simulation(total_steps=100, steps_per_second=10.0, checkpoint_every=1000)
    ref = CheckpointRef(step=20, uri="s3://ckpt/j/step-20")
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    m.create(dispatch("r", m.nodes_of("od-a100")[1:], flavor="od-a100", sim=sim, resume_from=ref))
    run_until(m, clock, 2.0)  # a fresh start takes 2 s; a resume 3 s more to read back
    assert [s.job_id for s in statuses(got, "running")] == ["j"]
    assert m.workload("j", 1).step == 0  # type: ignore[union-attr]
    run_until(m, clock, 4.0)  # 20 steps a second on this GPU
    assert m.workload("j", 1).step == 40  # type: ignore[union-attr]
    run_until(m, clock, 5.0)
    assert [s.job_id for s in statuses(got, "running")] == ["j", "r"]
    run_until(m, clock, 7.0)  # j: 100 steps in 5 s after t=2
    assert [(s.job_id, s.step) for s in statuses(got, "succeeded")] == [("j", 100)]
    run_until(m, clock, 9.0)  # r: 80 steps left, 4 s after t=5
    assert [(s.job_id, s.step) for s in statuses(got, "succeeded")] == [("j", 100), ("r", 100)]


def test_periodic_checkpoints_every_so_many_seconds_stall_the_steps() -> None:
    timing = WorkloadTiming(checkpoint_every_s=10.0, checkpoint_stall_s=5.0)
    m, clock, got = timed(timing)
    sim = Simulation(total_steps=30, steps_per_second=1.0, checkpoint_every=1)
    m.create(dispatch("j", m.nodes_of("od-a100")[:1], flavor="od-a100", sim=sim))
    run_until(m, clock, 13.0)  # runs from t=1; 10 s of compute, then stalled writing
    assert m.workload("j", 1).step == 10  # type: ignore[union-attr]
    assert reports(got) == []
    run_until(m, clock, 16.0)  # written as the stall ends, the steps go on
    assert reports(got) == [(10, 16.0)]
    run_until(m, clock, 20.0)
    assert m.workload("j", 1).step == 14  # type: ignore[union-attr]
    # 30 s of compute and two stalls (none after the last step): done at 1 + 30 + 10.
    run_until(m, clock, 40.75)
    assert statuses(got, "succeeded") == []
    run_until(m, clock, 41.0)
    assert statuses(got, "succeeded")[0].step == 30
    assert reports(got) == [(10, 16.0), (20, 31.0)]


def test_an_asked_checkpoint_takes_its_write_time_and_is_lost_with_the_node() -> None:
    timing = WorkloadTiming(checkpoint_every_s=float("inf"), checkpoint_write_s=4.0)
    m, clock, got = timed(timing)
    sim = Simulation(total_steps=10_000, steps_per_second=10.0, checkpoint_every=5)
    nodes = m.nodes_of("spot-a100")
    m.create(dispatch("j", nodes[:1], sim=sim))
    run_until(m, clock, 3.0)
    assert reports(got) == []  # inf: no periodic checkpoints at all
    m.checkpoint("j", 1)
    run_until(m, clock, 5.0)
    m.checkpoint("j", 1)  # still writing the first: the same checkpoint
    run_until(m, clock, 7.0)
    assert reports(got) == [(20, 7.0)]
    run_until(m, clock, 10.0)
    m.checkpoint("j", 1)
    m.spot_notice(nodes[0], lead_s=1.0)
    run_until(m, clock, 15.0)  # the node went at t=11, before the write finished at t=14
    assert reports(got) == [(20, 7.0)]
    assert statuses(got, "evicted")[0].step == 100


def test_a_resized_workload_outlives_the_reclaim_of_the_node_it_left() -> None:
    m, clock, got = model()
    a, b = m.nodes_of("spot-a100")
    sim = Simulation(total_steps=1000, steps_per_second=10.0, checkpoint_every=25)
    first = dispatch("e", [a, b], sim=sim)
    worker = msgspec.structs.replace(first.spec.gang[0], min_replicas=1, max_replicas=2)
    first = msgspec.structs.replace(first, spec=msgspec.structs.replace(first.spec, gang=[worker]))
    m.create(first)
    run_until(m, clock, 2.0)
    m.spot_notice(a)
    shrunk = msgspec.structs.replace(
        first, revision=1, assignment=[PodSetAssignment(podset="worker", nodes=[b])]
    )
    m.resize_workload(shrunk)
    assert m.free_gpus(a) == 8 and m.free_gpus(b) == 0
    run_until(m, clock, 40.0)  # past the 30 s notice: node a is reclaimed
    wl = m.workload("e", 1)
    assert wl is not None and wl.step > 300  # the same attempt went on
    assert not [s for s in got if isinstance(s, WorkloadStatus) and s.phase != "created"][1:]
    assert m.counters["resized"] == 1
