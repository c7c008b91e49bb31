"""Spot-return prices the destination's reclaim exposure (spotreturn.worth_returning): each
reclaim the gang expects over the time it has left costs another restart, so a return that
pays on a calm pool does not on one that reclaims often."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.core.records import AttemptRecord, JobRecord
from broker.core.spotreturn import worth_returning
from schemas.job import CheckpointSpec, JobSpec, PodSet

NOW = 1_800_000_000.0
OD_PRICE = 3.0  # $/GPU-h


def running_on_demand(ran_s: float, cost_s: float = 60.0) -> tuple[JobRecord, AttemptRecord]:
    spec = JobSpec(
        name="j",
        capacity="spot-then-on-demand",
        gang=[PodSet(name="w", replicas=1, gpu=8)],
        checkpoint=CheckpointSpec(uri="s3://c", interval_s=600, cost_s=cost_s),
    )
    attempt = AttemptRecord(
        attempt=1,
        cluster="a",
        flavor="od",
        flavor_class="od",
        assignment=[],
        dispatched_at=NOW - ran_s - 60,
        capacity_type="on-demand",
        price_per_gpu_hour=OD_PRICE,
        running_at=NOW - ran_s,
    )
    record = JobRecord(
        job_id="j", spec=spec, queue="q", order=1, submitted_at=0.0, attempts=[attempt]
    )
    return record, attempt


def test_a_return_that_pays_on_a_calm_pool_does_not_on_a_stormy_one() -> None:
    record, current = running_on_demand(ran_s=2 * 3600)  # 2 h run: 2 h expected left
    spot = 1.0 * 8  # $/h for the gang on spot, risk included
    # Saving (24 - 8) * 2 = $32; one restart (60 + 2 * 60 s) at $24/h = $1.2.
    assert worth_returning(record, current, spot, 0.0, NOW)
    # 15 reclaims per hour over 2 h: 30 more restarts, $37 more than the saving.
    assert not worth_returning(record, current, spot, 15.0, NOW)


@given(
    rate=st.floats(min_value=0.0, max_value=50.0),
    more=st.floats(min_value=0.0, max_value=50.0),
    ran_h=st.floats(min_value=0.2, max_value=48.0),
)
def test_more_reclaim_exposure_never_makes_a_return_pay(
    rate: float, more: float, ran_h: float
) -> None:
    record, current = running_on_demand(ran_s=ran_h * 3600)
    if worth_returning(record, current, 8.0, rate + more, NOW):
        assert worth_returning(record, current, 8.0, rate, NOW)
