"""The deterministic simulation with a retention (`python -m load.vopr --retention-s 2`): ended
jobs are forgotten and their records deleted as the shell does, and no record is deleted while
it marks a Cancel unacknowledged (`invariants.unsettled_forgets`), since a restored leader would
no longer send that Cancel again."""

from __future__ import annotations

import pytest

from broker.core.records import JobRecord
from load.vopr import SimFailure, retaining, run_many, run_seed, sim_config

RETENTION_S = 2.0  # shorter than the simulation's lost_after_s (30 s): Cancels outlive it
SEEDS = 200
# An ended job whose newer attempt's Cancel is still unheard when its retention has passed.
# (Seed 287 was one until an agent's answer to a Cancel carried the attempt's ending: its
# replacements are now cancelled before they are dispatched, and nothing waits.)
KEPT_SEED = 533


def test_seeds_with_a_retention_keep_every_invariant_and_forget_ended_jobs() -> None:
    n, failures, totals = run_many(range(SEEDS), config=retaining(sim_config(), RETENTION_S))
    assert n == SEEDS and failures == []
    assert totals["forgotten"] > 0 and totals["kept-past-retention"] > 0


def test_a_job_forgotten_with_its_cancel_unheard_fails_the_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = retaining(sim_config(), RETENTION_S)
    assert run_seed(KEPT_SEED, config=config).stats["forgotten"] > 0
    # A core that forgets whatever its Cancels: what the check is there to catch.
    monkeypatch.setattr(JobRecord, "cancels_unsettled", property(lambda self: False))
    with pytest.raises(SimFailure) as err:
        run_seed(KEPT_SEED, config=config)
    assert "forgotten with the Cancels of attempts" in str(err.value)
    assert f"python -m load.vopr --seed {KEPT_SEED} --retention-s 2 --verbose" in str(err.value)
