"""The spot policies in the simulator: workloads follow the broker's checkpoint advice, jobs
that fell back to on-demand return to spot make-before-break, and the switches that turn
them off really turn them off."""

from __future__ import annotations

import itertools

import pytest

from load.sim import Sim, SimResult
from tests.load.test_sim import SMALL


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
