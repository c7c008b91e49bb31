"""The SkyPilot baselines (load/skypilot.py): price-ranked placement, a fresh VM provisioned
for every attempt, EAGER_NEXT_REGION keeping the next attempt off the pool that lost the job
(FAILOVER not), and none of Muster's spot rules (no give-up, no fallback after preemptions)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from load import skypilot
from load.sim import POLICIES, Sim, SimResult, broker_config, job_spec
from tests.load.small_sim import SMALL

CFG = replace(SMALL, jobs=150)


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Sim, SimResult]]:
    out = {}
    for policy in ("skypilot-like", "skypilot-failover"):
        sim = Sim(CFG, policy)
        out[policy] = (sim, sim.run())
    return out


def test_the_broker_places_by_price_and_has_none_of_musters_spot_rules() -> None:
    for name, strategy in (
        ("skypilot-like", "EAGER_NEXT_REGION"),
        ("skypilot-failover", "FAILOVER"),
    ):
        policy = POLICIES[name]
        assert policy.skypilot == strategy and not policy.notices and not policy.spot_return
        assert policy.detect_s == 15.0  # JOB_STATUS_CHECK_GAP_SECONDS
        config = broker_config(CFG, policy)
        assert config.scheduling.risk_weight == 0.0
        # The start timeout leaves room for a VM's provisioning.
        assert config.timeouts.image_pull_s >= skypilot.PROVISION_S[1]
        spot = job_spec(Sim(replace(CFG, jobs=1), name).jobs[0], policy).spot
        assert spot.max_preemptions_without_progress is None
        assert spot.fallback_after_wait_s == 0.0 and spot.fallback_after_preemptions >= 1000
    assert broker_config(CFG, POLICIES["skypilot-like"]).scheduling.avoid_lost_pool_s == 156.0
    assert broker_config(CFG, POLICIES["skypilot-failover"]).scheduling.avoid_lost_pool_s == 0.0
    assert broker_config(CFG, POLICIES["muster"]).scheduling.risk_weight > 0


def test_every_attempt_waits_for_a_fresh_vm(runs: dict[str, tuple[Sim, SimResult]]) -> None:
    for name, (_, res) in runs.items():
        assert res.violations == [], (name, res.violations[:3])
        starts = [
            log.running_at - log.dispatched_at
            for logs in res.logs.values()
            for log in logs
            if log.running_at is not None
        ]
        assert starts and min(starts) >= skypilot.PROVISION_S[0], name
        assert max(starts) <= skypilot.PROVISION_S[1] + 60.0 + 5 * 3 + 6.0 + 1.0, name
    muster = Sim(replace(CFG, jobs=20), "checkpoint-restart").run()
    assert all(
        log.running_at - log.dispatched_at < 120.0
        for logs in muster.logs.values()
        for log in logs
        if log.running_at is not None
    )


def relaunches(res: SimResult) -> list[tuple[bool, float]]:
    """(same pool?, seconds after the loss) of every attempt that followed a lost one."""
    out = []
    for logs in res.logs.values():
        for old, new in itertools.pairwise(logs):
            if old.cause == "node-gone" and old.ended_at is not None:
                same = (old.cluster, old.flavor) == (new.cluster, new.flavor)
                out.append((same, new.dispatched_at - old.ended_at))
    return out


def test_eager_next_region_relaunches_away_from_the_lost_pool(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    eager = relaunches(runs["skypilot-like"][1])
    assert len(eager) >= 5
    assert not any(same and after < skypilot.EAGER_BLOCK_S for same, after in eager), eager
    failover = relaunches(runs["skypilot-failover"][1])
    assert any(same and after < skypilot.EAGER_BLOCK_S for same, after in failover), failover


def test_no_job_gives_up_on_spot_or_falls_back_after_preemptions(
    runs: dict[str, tuple[Sim, SimResult]],
) -> None:
    for name, (_, res) in runs.items():
        failed = [r for r in res.records.values() if r.state == "failed"]
        assert failed == [], (name, [(r.job_id, r.reason) for r in failed][:3])
