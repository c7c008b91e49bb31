"""The spot policies in the simulator: workloads follow the broker's checkpoint advice, jobs
that fell back to on-demand return to spot make-before-break, and the switches that turn
them off really turn them off."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from agents.fake.model import ManualClock
from load.sim import ElasticModel, Sim, SimConfig, SimResult
from schemas.agent import AgentEvent, PodSetAssignment
from schemas.job import JobSpec, PodSet, Simulation
from tests.agents.cluster_model import CONFIG, run_until, statuses
from tests.agents.helpers import dispatch
from tests.load.small_sim import SMALL


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Sim, SimResult]]:
    out = {}
    for policy in ("muster", "muster-fixed", "muster-no-return"):
        sim = Sim(SMALL, policy)
        out[policy] = (sim, sim.run())
    return out


def test_the_policies_keep_every_invariant(runs: dict[str, tuple[Sim, SimResult]]) -> None:
    for name, (_, res) in runs.items():
        # (The simulated clusters also report a second live copy of a job as a violation.)
        assert res.violations == [], (name, res.violations[:3])


def test_workloads_checkpoint_at_the_advised_interval(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    sim, res = runs["muster"]
    advised = [
        (log.ckpt_every, sim.jobs_by_id[job_id].ckpt_every)
        for job_id, logs in res.logs.items()
        for log in logs
        if log.ckpt_every is not None
    ]
    assert advised and all(own is not None for _, own in advised)
    assert sum(1 for every, own in advised if every != own) > len(advised) // 2
    fixed_sim, fixed = runs["muster-fixed"]
    for job_id, logs in fixed.logs.items():
        for log in logs:
            assert log.ckpt_every in (None, fixed_sim.jobs_by_id[job_id].ckpt_every)


def test_spot_return_moves_jobs_back_make_before_break(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    _, res = runs["muster"]
    moves = 0
    for logs in res.logs.values():
        for old, new in itertools.pairwise(logs):
            if old.cause != "cancel: spot-return":
                continue
            moves += 1
            assert old.capacity_type == "on-demand" and new.capacity_type == "spot"
            # The new attempt was placed before the old one ended and started the instant it
            # did (never before it: no two live copies), from the checkpoint taken to move.
            assert new.dispatched_at == old.ended_at
            assert old.ckpt_steps and new.start_step == old.ckpt_steps[-1]
    assert moves >= 1
    _, off = runs["muster-no-return"]
    assert not any(log.cause == "cancel: spot-return" for v in off.logs.values() for log in v)


def _on(*nodes: str) -> PodSetAssignment:
    return PodSetAssignment(podset="worker", nodes=list(nodes))


def test_a_shrunk_elastic_workload_steps_slower_and_ends_later() -> None:
    """2 of 2 workers at 10 steps/s; shrunk to 1 at t=2 (step 10), it runs at 1/1.9 of that
    (linear scaling at 90%): the 990 steps left take 188 s, not 99 s."""
    clock = ManualClock()
    m = ElasticModel("m", CONFIG, clock)
    got: list[AgentEvent] = []
    m.emit = got.append
    a, b = m.nodes_of("spot-a100")
    plain = dispatch("e", [a, b], sim=Simulation(total_steps=1000, steps_per_second=10.0))
    elastic = JobSpec(
        name="e", gang=[PodSet(name="worker", replicas=2, gpu=8, min_replicas=1, max_replicas=2)]
    )
    whole = msgspec.structs.replace(
        plain, spec=msgspec.structs.replace(elastic, workload=plain.spec.workload)
    )
    m.create(whole)
    run_until(m, clock, 2.0)  # running since t=1
    m.resize_workload(msgspec.structs.replace(whole, revision=1, assignment=[_on(b)]))
    run_until(m, clock, 21.0)
    wl = m.workload("e", 1)
    assert wl is not None and wl.step == 10 + int(19 * 10 / 1.9)
    run_until(m, clock, 150.0)  # the unshrunk end (t=101) passed: not the end any more
    assert statuses(got, "succeeded") == []
    run_until(m, clock, 191.0)
    assert len(statuses(got, "succeeded")) == 1


def test_the_elastic_policy_resizes_multi_node_jobs_and_keeps_every_invariant() -> None:
    """The default world's first 2000 jobs hold multi-node (elastic) jobs; they are shrunk
    and grown in place, GPU-seconds count each size for its time. (Placed by cost per unit of
    work, few of the first 1000's multi-node jobs land on spot, so few are shrunk.)"""
    res = Sim(SimConfig(jobs=2000, seed=1), "elastic").run()
    assert res.violations == [], res.violations[:3]
    resized = [log for logs in res.logs.values() for log in logs if log.resized_at is not None]
    assert resized
    end = res.base + res.end
    jobs = {j.job_id: j for j in res.jobs}
    for log in resized:
        most = jobs[log.job_id].gpus
        assert 0 < log.gpu_s(end) <= log.held_s(end) * most + 1e-6
    assert any(log.gpu_s(end) < log.held_s(end) * jobs[log.job_id].gpus for log in resized)
