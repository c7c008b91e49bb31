"""Admission-cycle pacing (broker/pacing.py): after a cycle the next waits CYCLE_GAP_FACTOR
times as long as the cycle took (ADMITTING_GAP_FACTOR times after one that admitted a job), at
most CYCLE_MAX_GAP_S, so a small cycle is followed at once and a long one lets inputs batch
up. A pure calculation, tested as one: no loop, no broker."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.core.effects import dispatches
from broker.core.inputs import CYCLE, AgentBatch, SubmitJob
from broker.core.machine import Machine
from broker.pacing import (
    ADMITTING_GAP_FACTOR,
    CYCLE_GAP_FACTOR,
    CYCLE_MAX_GAP_S,
    cycle_due,
    next_cycle_at,
)
from schemas.agent import ClusterSnapshot, EventBatch, FlavorInfo, NodeInfo
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import JobSpec, PodSet

T0 = 1000.0


def test_a_small_cycle_is_followed_almost_at_once() -> None:
    nxt = next_cycle_at(T0, T0 + 0.0005, admitted=False)
    assert nxt == T0 + 0.0005 + CYCLE_GAP_FACTOR * 0.0005
    assert not cycle_due(nxt - 1e-6, nxt, True)  # still in the pause
    assert cycle_due(nxt, nxt, True)


def test_a_long_cycle_pause_is_capped() -> None:
    for admitted in (False, True):
        nxt = next_cycle_at(T0, T0 + 0.2, admitted)
        assert nxt == T0 + 0.2 + CYCLE_MAX_GAP_S
        assert not cycle_due(T0 + 0.2 + CYCLE_MAX_GAP_S * 0.9, nxt, True)
        assert cycle_due(T0 + 0.2 + CYCLE_MAX_GAP_S * 1.1, nxt, True)


def test_a_cycle_that_admitted_is_followed_sooner_than_one_that_admitted_nothing() -> None:
    """Jobs arriving behind a cycle that admitted are likely to fit too; a backlog that did
    not fit is the cycle worth pausing after."""
    ended = T0 + 0.001
    sooner = next_cycle_at(T0, ended, admitted=True)
    later = next_cycle_at(T0, ended, admitted=False)
    assert sooner == ended + ADMITTING_GAP_FACTOR * (ended - T0)
    assert later == ended + CYCLE_GAP_FACTOR * (ended - T0)
    assert sooner < later


def test_a_cycle_that_starts_an_attempt_is_told_from_one_that_admits_nothing() -> None:
    """What the broker passes as `admitted` (whether the cycle's effects hold a Dispatch),
    from a real cycle: a job that fits its one free node is admitted; the next, with the node
    taken, is not."""
    m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]))
    flavor = FlavorInfo(name="od", capacity_type="on-demand", gpu_type="a100")
    node = NodeInfo(name="n0", flavor="od", gpu=8, cpu_milli=96_000, memory=2**40)
    snapshot = ClusterSnapshot(flavors=[flavor], nodes=[node])
    m.handle(AgentBatch("c0", EventBatch(cluster="c0", instance="i", seq=1, events=[snapshot])), T0)
    assert not dispatches(m.handle(CYCLE, T0))  # nothing queued

    def job(name: str) -> SubmitJob:
        gang = [PodSet(name="worker", replicas=1, gpu=8, cpu="4", memory="16Gi")]
        return SubmitJob(JobSpec(name=name, job_id=name, queue="q", gang=gang))

    m.handle(job("fits"), T0)
    assert dispatches(m.handle(CYCLE, T0 + 1))
    m.handle(job("waits"), T0 + 2)
    effects = m.handle(CYCLE, T0 + 2)
    assert not dispatches(effects)
    assert m.jobs["waits"].state == "queued"


def test_no_cycle_when_none_is_wanted() -> None:
    assert not cycle_due(T0 + 1.0, T0, False)
    assert cycle_due(T0 + 1.0, T0, True)


@given(
    cost=st.floats(min_value=0.0, max_value=10.0, allow_nan=False),
    started=st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    admitted=st.booleans(),
)
def test_cycles_never_take_more_than_their_share_of_the_loop(
    cost: float, started: float, admitted: bool
) -> None:
    """The pause is factor times cost, capped: a cycle shorter than the cap / factor takes at
    most 1 / (1 + factor) of the time until the next one may start, and no pause is ever
    longer than the cap."""
    factor = ADMITTING_GAP_FACTOR if admitted else CYCLE_GAP_FACTOR
    ended = started + cost
    pause = next_cycle_at(started, ended, admitted) - ended
    assert 0.0 <= pause <= CYCLE_MAX_GAP_S + 1e-9
    if cost * factor <= CYCLE_MAX_GAP_S:
        assert pause >= factor * cost * (1 - 1e-9) - 1e-9
