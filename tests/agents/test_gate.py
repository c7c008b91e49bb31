"""The agent's command gate: stale leaders, late and duplicate dispatches, cancels and
supersession, as a pure object; and over any sequence of commands, an agent never runs two
attempts of a job at once, nor an attempt the broker cancelled, nor one attempt twice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.gate import CommandGate, Duplicate, Refuse, Resize, Run
from schemas.agent import Dispatch
from schemas.job import JobSpec, PodSet

SPEC = JobSpec(name="j", gang=[PodSet(name="worker", replicas=1, gpu=1)])
NOW = 1_000_000.0


def dispatch(
    attempt: int, revision: int = 0, job_id: str = "j", fence_after_s: float = 0.0
) -> Dispatch:
    return Dispatch(
        job_id=job_id,
        attempt=attempt,
        epoch=1,
        spec=SPEC,
        flavor="f",
        assignment=[],
        revision=revision,
        fence_after_s=fence_after_s,
    )


def test_a_deposed_leader_is_refused_with_the_newest_epoch() -> None:
    gate = CommandGate()
    assert gate.epoch_refusal(5) is None
    ack = gate.epoch_refusal(4)
    assert ack is not None and ack.stale_epoch and ack.epoch == 5 and not ack.ok
    assert gate.epoch_refusal(5) is None and gate.epoch_refusal(6) is None
    assert gate.max_epoch == 6


def test_a_dispatch_read_after_the_fence_lapsed_starts_nothing() -> None:
    gate = CommandGate()
    # Before any batch of this process is acknowledged, a Dispatch is as fresh as the
    # subscription it came on, and its fence counts from its arrival.
    assert gate.judge(dispatch(1, fence_after_s=7.0), NOW) == Run(())
    assert gate.fence_base(NOW) == NOW
    gate.heard(NOW - 3.0)
    gate.heard(NOW - 5.0)  # an older batch's answer, late: proves nothing newer
    assert gate.fence_base(NOW) == NOW - 3.0
    assert gate.judge(dispatch(1, fence_after_s=7.0), NOW + 3.9) == Run(())
    # The agent was frozen: the broker last acknowledged it 7 s ago, the attempt's fence.
    late = gate.judge(dispatch(1, fence_after_s=7.0), NOW + 4.0)
    assert isinstance(late, Refuse) and not late.ack.ok
    assert "7.0s" in late.ack.error and "elsewhere" in late.ack.error
    # An attempt without a fence, and one already here, are not started by it either way.
    assert gate.judge(dispatch(1), NOW + 60.0) == Run(())
    gate.ran(dispatch(1, fence_after_s=7.0))
    assert isinstance(gate.judge(dispatch(1, fence_after_s=7.0), NOW + 60.0), Duplicate)
    gate.forget(NOW + 60.0)  # a new process, subscribed now: nothing acknowledged yet
    assert gate.judge(dispatch(2, fence_after_s=7.0), NOW + 60.0) == Run(())


def test_before_any_ack_the_fence_counts_from_the_subscription() -> None:
    """A process that subscribed and was then stopped reads a Dispatch no older than its
    subscription, but maybe older than the fence: from the subscription, as from a batch the
    broker acknowledged."""
    gate = CommandGate()
    gate.started(NOW)
    assert gate.fence_base(NOW + 2.0) == NOW
    assert gate.judge(dispatch(1, fence_after_s=7.0), NOW + 6.9) == Run(())
    late = gate.judge(dispatch(1, fence_after_s=7.0), NOW + 7.0)
    assert isinstance(late, Refuse) and late.fence_lapsed, late
    gate.heard(NOW + 5.0)  # the broker's first acknowledgement: from that batch on
    assert gate.fence_base(NOW + 7.0) == NOW + 5.0
    assert gate.judge(dispatch(1, fence_after_s=7.0), NOW + 7.0) == Run(())


def test_a_late_dispatch_of_a_cancelled_attempt_is_refused() -> None:
    gate = CommandGate()
    gate.cancelled("j", 2)
    verdict = gate.judge(dispatch(2), NOW)
    assert isinstance(verdict, Refuse) and "was cancelled here" in verdict.ack.error
    assert isinstance(gate.judge(dispatch(1), NOW), Refuse)
    assert isinstance(gate.judge(dispatch(3), NOW), Run)


def test_duplicates_resizes_older_attempts_and_supersession() -> None:
    gate = CommandGate()
    assert gate.judge(dispatch(1), NOW) == Run(())
    gate.ran(dispatch(1))
    assert isinstance(gate.judge(dispatch(1), NOW), Duplicate)
    assert isinstance(gate.judge(dispatch(1, revision=1), NOW), Resize)
    gate.resized(dispatch(1, revision=1))
    assert isinstance(gate.judge(dispatch(1, revision=1), NOW), Duplicate)
    assert gate.judge(dispatch(3), NOW) == Run((1,))  # the older live attempt ends first
    gate.ended("j", 1)
    gate.ran(dispatch(3))
    older = gate.judge(dispatch(2), NOW)
    assert isinstance(older, Refuse) and "older than attempt 3" in older.ack.error
    assert gate.live("j") == {3}


def test_an_adopted_attempt_blocks_its_own_redispatch_and_older_ones() -> None:
    gate = CommandGate()
    gate.adopt("j", 4, live=True, fence_after=20.0)
    assert isinstance(gate.judge(dispatch(4), NOW), Duplicate)
    assert isinstance(gate.judge(dispatch(3), NOW), Refuse)
    assert gate.track("j").fence_after == {4: 20.0}
    gate.cancelled("j", None)
    assert gate.live("j") == set() and isinstance(gate.judge(dispatch(4), NOW), Refuse)


def test_finished_jobs_are_forgotten_first_when_the_bound_is_reached() -> None:
    gate = CommandGate(max_tracked=20)
    gate.ran(dispatch(1, job_id="running"))
    for i in range(40):
        gate.ran(dispatch(1, job_id=f"done-{i}"))
        gate.ended(f"done-{i}", 1)
    assert gate.get("running") is not None and gate.live("running") == {1}
    assert sum(1 for _ in gate.tracks()) <= 20


command = st.one_of(
    st.tuples(st.just("dispatch"), st.integers(1, 6), st.integers(0, 2)),
    st.tuples(st.just("cancel"), st.one_of(st.none(), st.integers(1, 6)), st.just(0)),
    st.tuples(st.just("end"), st.integers(1, 6), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(command, max_size=40))
def test_no_sequence_of_commands_runs_two_copies_or_a_cancelled_attempt(
    commands: list[tuple[str, int | None, int]],
) -> None:
    gate = CommandGate()
    running: set[int] = set()  # what the simulated cluster runs
    started: list[int] = []
    cancelled_upto = 0
    for verb, attempt, revision in commands:
        if verb == "dispatch":
            assert attempt is not None
            verdict = gate.judge(dispatch(attempt, revision), NOW)
            if isinstance(verdict, Run):
                for old in verdict.supersede:
                    running.discard(old)
                    gate.ended("j", old)
                assert attempt > cancelled_upto and attempt not in started
                running.add(attempt)
                started.append(attempt)
                gate.ran(dispatch(attempt, revision))
            elif isinstance(verdict, Resize):
                assert attempt in started
                gate.resized(dispatch(attempt, revision))
        elif verb == "cancel":
            for a in gate.cancel_targets("j", attempt):
                running.discard(a)
            gate.cancelled("j", attempt)
            top = max(started, default=0) if attempt is None else attempt
            cancelled_upto = max(cancelled_upto, top)
        else:
            assert attempt is not None
            running.discard(attempt)
            gate.ended("j", attempt)
        assert len(running) <= 1
        assert running == gate.live("j")
