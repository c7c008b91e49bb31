"""The broker's sans-IO effect rules (`broker/sequencer.py`): over any interleaving of Cancels,
Dispatches ordered after them, acks, lost clusters and step-downs, no Dispatch leaves before
every Cancel it waits on is settled, and every held Dispatch leaves once they are; records persist
first, newest per job; Cancels are resent until heard or their cluster is lost; each copy's
ack wait follows the cluster's round trips; only a batch applied in full is acknowledged."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.effects import Effect, Forget, Persist, Publish, Send, refusal
from broker.core.records import JobRecord
from broker.sequencer import (
    APPLIED_EVERY_S,
    RecordWrites,
    Sequencer,
    acknowledges,
    attempt_token,
    persist_first,
)
from schemas.agent import (
    AgentEvent,
    Cancel,
    CheckpointNow,
    CommandAck,
    Dispatch,
    EventBatch,
    Heartbeat,
    Resync,
    WorkloadPhase,
    WorkloadStatus,
)
from schemas.api import JobEvent
from schemas.config import Timeouts
from schemas.job import JobSpec, PodSet
from tests.core.harness import Sim

SPEC = JobSpec(name="j", gang=[PodSet(name="worker", replicas=1, gpu=1)])
TIMEOUTS = Timeouts(dispatch_ack_s=2.0, dispatch_ack_max_s=20.0, dispatch_retries=2)


def dispatch(job_id: str, attempt: int) -> Dispatch:
    return Dispatch(job_id=job_id, attempt=attempt, epoch=1, spec=SPEC, flavor="f", assignment=[])


def cancel(job_id: str, attempt: int) -> Cancel:
    return Cancel(job_id=job_id, epoch=1, attempt=attempt)


def record(job_id: str, order: int) -> JobRecord:
    return JobRecord(job_id=job_id, spec=SPEC, queue="q", order=order, submitted_at=0.0)


@dataclass
class Model:
    """What the test knows: the Cancels on their way (per attempt, in send order), each one
    settled or not, and the Dispatches waiting or sent."""

    out: dict[tuple[str, int], list[tuple[int, bool]]] = field(default_factory=dict)
    waiting: list[tuple[str, Dispatch]] = field(default_factory=list)
    sent: list[Dispatch] = field(default_factory=list)

    def unsettled(self, job_id: str, attempt: int) -> bool:
        return any(not done for _, done in self.out.get((job_id, attempt), []))


JOBS = st.sampled_from(["a", "b"])
ATTEMPTS = st.integers(1, 3)
Op = tuple[str, object, object]
ANSWERS = ["ack", "healthy", "unreachable", "lost", None]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("cancel"), JOBS, ATTEMPTS),
        st.tuples(st.just("dispatch"), JOBS, ATTEMPTS),
        # a Cancel's round ends: acknowledged, or unheard from a cluster in that health
        # (None: gone from the fleet)
        st.tuples(st.just("answer"), st.integers(0, 30), st.sampled_from(ANSWERS)),
        st.tuples(st.just("reset"), st.just(""), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_a_dispatch_never_leaves_before_the_cancel_it_waits_on(ops: list[Op]) -> None:
    seq = Sequencer(TIMEOUTS)
    model = Model()
    tickets: list[tuple[Cancel, int]] = []

    def leaves(d: Dispatch) -> None:
        # The newest Cancel of every attempt before it is acknowledged or given up on; an
        # older copy still in flight is not waited for (the newest one decides).
        for after in range(1, d.attempt):
            newest = model.out.get((d.job_id, after), [])
            assert not newest or newest[-1][1], (d.job_id, d.attempt, after, newest)
        model.sent.append(d)

    for op, a, b in ops:
        if op == "cancel":
            assert isinstance(a, str) and isinstance(b, int)
            cmd = cancel(a, b)
            ticket = seq.cancel(cmd)
            tickets.append((cmd, ticket))
            # A Dispatch of the attempt cancelled, still held, is dropped: the core gave it up.
            model.waiting = [(c, d) for c, d in model.waiting if (d.job_id, d.attempt) != (a, b)]
            assert sorted(h.command.attempt for h in seq.held() if h.command.job_id == a) == (
                sorted(d.attempt for _, d in model.waiting if d.job_id == a)
            )
            model.out.setdefault((a, b), []).append((ticket, False))
        elif op == "dispatch":
            assert isinstance(a, str) and isinstance(b, int)
            d = dispatch(a, b + 1)
            # Ordered after every earlier attempt, as the core orders one after each that may
            # still run (the one before it and any whose Cancel is unacknowledged).
            if seq.dispatch("c2", d, tuple(range(1, b + 1))):
                leaves(d)
            else:
                held = any(model.unsettled(a, n) for n in range(1, b + 1))
                assert held, "held though no Cancel of an earlier attempt is out"
                model.waiting.append(("c2", d))
        elif op == "answer" and tickets:
            assert isinstance(a, int) and (b is None or isinstance(b, str))
            cmd, ticket = tickets[a % len(tickets)]
            # The drivers' rule: a Cancel unheard is asked again unless the sequencer gives
            # up on it; only an ack or giving up settles it.
            if b != "ack" and seq.cancel_again(b) is not None:
                assert b in ("healthy", "unreachable"), f"asked again of a {b} cluster"
                continue
            assert b in ("ack", "lost", None), f"gave up on a Cancel to a {b} cluster"
            key = (cmd.job_id, cmd.attempt or 0)
            model.out[key] = [(t, done or t == ticket) for t, done in model.out.get(key, [])]
            for held in seq.settled(cmd, ticket):
                assert held.cluster == "c2"
                leaves(held.command)
                model.waiting.remove(("c2", held.command))
        elif op == "reset":
            seq.reset()
            tickets.clear()
            model = Model(sent=model.sent)
    # Once every Cancel still tracked settles, nothing stays held.
    for cmd, ticket in list(tickets):
        key = (cmd.job_id, cmd.attempt or 0)
        model.out[key] = [(t, done or t == ticket) for t, done in model.out.get(key, [])]
        for held in seq.settled(cmd, ticket):
            leaves(held.command)
            model.waiting.remove((held.cluster, held.command))
    assert model.waiting == [] and seq.held() == [] and seq.in_flight() == 0


def test_an_older_copy_of_a_cancel_releases_nothing_while_a_newer_one_is_out() -> None:
    seq = Sequencer(TIMEOUTS)
    first = seq.cancel(cancel("j", 1))
    second = seq.cancel(cancel("j", 1))
    assert not seq.dispatch("c2", dispatch("j", 2), (1,))
    assert seq.settled(cancel("j", 1), first) == []
    released = seq.settled(cancel("j", 1), second)
    assert [h.command.attempt for h in released] == [2]
    assert seq.dispatch("c2", dispatch("j", 3), (1, 2))  # nothing of 1 or 2 is being cancelled


def test_a_dispatch_waits_for_every_cancel_it_names_not_only_the_last() -> None:
    """Attempt 1's Cancel is unheard, attempt 2 was given up (its Cancel heard at once):
    attempt 3 leaves only once attempt 1's Cancel settles too."""
    seq = Sequencer(TIMEOUTS)
    one = seq.cancel(cancel("j", 1))
    two = seq.cancel(cancel("j", 2))
    assert not seq.dispatch("c1", dispatch("j", 3), (1, 2))
    assert seq.settled(cancel("j", 2), two) == []
    assert [h.command.attempt for h in seq.held()] == [3]
    released = seq.settled(cancel("j", 1), one)
    assert [(h.cluster, h.command.attempt) for h in released] == [("c1", 3)]
    assert seq.held() == [] and seq.in_flight() == 0
    # The other order: the first Cancel heard while the second is still out keeps it held.
    one, two = seq.cancel(cancel("j", 1)), seq.cancel(cancel("j", 2))
    assert not seq.dispatch("c1", dispatch("j", 3), (1, 2))
    assert seq.settled(cancel("j", 1), one) == []
    assert [h.command.attempt for h in seq.settled(cancel("j", 2), two)] == [3]


def test_a_step_down_sends_nothing_it_held() -> None:
    seq = Sequencer(TIMEOUTS)
    ticket = seq.cancel(cancel("j", 1))
    assert not seq.dispatch("c2", dispatch("j", 2), (1,))
    seq.reset()
    assert seq.settled(cancel("j", 1), ticket) == [] and seq.held() == []


# p: persist a record of the job, P: publish its event, s: send it a command
BATCHES = st.lists(
    st.lists(st.tuples(st.sampled_from("pPs"), st.sampled_from("xyz")), max_size=8), max_size=5
)


@settings(max_examples=200, deadline=None)
@given(BATCHES)
def test_records_persist_first_the_newest_of_each_job(batches: list[list[tuple[str, str]]]) -> None:
    n = 0
    effects: list[list[Effect]] = []
    newest: dict[str, JobRecord] = {}
    for batch in batches:
        made: list[Effect] = []
        for kind, job_id in batch:
            n += 1
            if kind == "p":
                rec = record(job_id, n)
                newest[job_id] = rec
                made.append(Persist(rec))
            elif kind == "P":
                made.append(Publish(JobEvent(job_id=job_id, kind="queued", state="queued", at=n)))
            else:
                made.append(Send("c1", CheckpointNow(job_id=job_id, attempt=1, epoch=1)))
        effects.append(made)
    records = persist_first(effects)
    assert {r.job_id: r.order for r in records} == {j: r.order for j, r in newest.items()}
    assert len(records) == len(newest)


def test_a_deferred_write_waits_at_most_its_bound_and_writes_the_newest_state() -> None:
    writes = RecordWrites(2.0)
    rec = record("x", 1)
    assert writes.take([[Persist(rec, deferred=True)]], 10.0) == []
    assert writes.due_at() == 12.0
    rec.order = 2  # changed again, deferred again: still due when first filed
    assert writes.take([[Persist(rec, deferred=True)]], 11.0) == []
    assert writes.due_at() == 12.0 and writes.take([], 11.9) == []
    assert [r.order for r in writes.take([], 12.0)] == [2]
    assert writes.waiting() == 0 and writes.due_at() is None


def test_deferred_writes_due_together_go_out_in_one_take_never_late() -> None:
    """Once one deferred record is due, those due within `gather_s` after it are written with
    it (early, never late); the ones due later wait, and none is taken before one is due."""
    writes = RecordWrites(2.0)
    recs = [record(f"j{i}", i) for i in range(5)]
    for i, at in enumerate([0.0, 0.03, 0.06, 0.5, 0.9]):
        assert writes.take([[Persist(recs[i], deferred=True)]], at) == []
    assert writes.take([], 1.99) == []  # the first is due at 2.0: nothing yet
    assert [r.job_id for r in writes.take([], 2.0)] == ["j0", "j1", "j2"]  # due by 2.1
    assert writes.due_at() == 2.5 and writes.take([], 2.49) == []
    assert [r.job_id for r in writes.take([], 2.95)] == ["j3", "j4"]  # both due by then
    assert writes.waiting() == 0


def test_an_urgent_write_of_the_job_carries_its_deferred_one() -> None:
    writes = RecordWrites(2.0)
    x, y = record("x", 1), record("y", 2)
    assert writes.take([[Persist(x, deferred=True), Persist(y, deferred=True)]], 0.0) == []
    assert writes.take([[Persist(x)]], 1.0) == [x]
    assert writes.waiting() == 1 and writes.take([], 2.0) == [y]
    # In one batch, either order: one write, the urgent one.
    assert writes.take([[Persist(x), Persist(x, deferred=True)]], 3.0) == [x]
    assert writes.take([[Persist(x, deferred=True)], [Persist(x)]], 3.0) == [x]
    assert writes.waiting() == 0


def test_deferred_writes_of_a_job_forgotten_or_a_leadership_ended_are_dropped() -> None:
    writes = RecordWrites(2.0)
    x, y = record("x", 1), record("y", 2)
    writes.take([[Persist(x, deferred=True), Persist(y, deferred=True)]], 0.0)
    writes.take([[Forget("x")]], 0.5)  # deleted: a write now would bring it back
    assert writes.take([], 5.0) == [y]
    writes.take([[Persist(x, deferred=True)]], 6.0)
    writes.reset()
    assert writes.take([], 60.0) == [] and writes.due_at() is None


def test_no_delay_writes_every_record_at_once() -> None:
    writes = RecordWrites(0.0)
    x = record("x", 1)
    assert writes.take([[Persist(x, deferred=True)]], 0.0) == [x]
    assert writes.waiting() == 0


def test_a_cancel_is_asked_again_until_heard_or_its_cluster_is_lost() -> None:
    seq = Sequencer(TIMEOUTS)
    assert seq.cancel_again("healthy") == TIMEOUTS.dispatch_ack_s
    assert seq.cancel_again("unreachable") == TIMEOUTS.dispatch_ack_s
    assert seq.cancel_again("lost") is None
    assert seq.cancel_again(None) is None  # a cluster gone from the fleet


def test_copies_and_their_waits_follow_the_cluster() -> None:
    seq = Sequencer(TIMEOUTS)
    assert seq.attempts(dispatch("j", 1)) == TIMEOUTS.dispatch_retries + 1
    assert seq.attempts(cancel("j", 1)) == 3
    assert [seq.ack_wait("c1", i) for i in range(4)] == [2.0, 4.0, 8.0, 16.0]
    for _ in range(20):
        seq.acked("slow", 5.0)
    assert seq.ack_wait("slow", 0) > 5.0 and seq.ack_wait("c1", 0) == 2.0
    assert seq.ack_wait("slow", 5) == TIMEOUTS.dispatch_ack_max_s
    assert [seq.empty_pause(i) for i in (0, 1, 10)] == [0.1, 0.2, 2.0]


def test_the_dispatch_token_is_keyed_and_per_attempt() -> None:
    token = attempt_token(b"k1", "j", 1)
    assert token == attempt_token(b"k1", "j", 1) and len(token) == 32
    others = {
        attempt_token(b"k1", "j", 2),
        attempt_token(b"k1", "i", 1),
        attempt_token(b"k2", "j", 1),
    }
    assert token not in others and len(others) == 3


def test_a_refusal_does_not_outvote_a_later_copy_still_unanswered() -> None:
    refused = CommandAck(ok=False, error="API server busy")
    assert not Sequencer.decides(refused, outstanding=True)
    assert Sequencer.decides(refused, outstanding=False)
    assert Sequencer.decides(CommandAck(ok=True), outstanding=True)
    assert Sequencer.decides(CommandAck(ok=False, stale_epoch=True, epoch=9), outstanding=True)
    assert "did not ack in 2s" in Sequencer.silence("c1", 2.0).error


def test_only_a_batch_applied_in_full_is_acknowledged_and_heartbeats_are_paced() -> None:
    """The agent drops what it kept and renews its fences on Applied: a replay the core
    refused or a batch out of sequence it answered with a resync gets none; one without
    outcomes is acknowledged at most every APPLIED_EVERY_S, one with outcomes always."""
    w = Sim(("a",))
    now = w.now
    beat = w.batch("a", Heartbeat(at=now))
    fx = w.m.handle(beat, now)
    assert acknowledges(fx, beat.batch, now, None)
    assert not acknowledges(fx, beat.batch, now, now - APPLIED_EVERY_S / 2)
    assert acknowledges(fx, beat.batch, now, now - APPLIED_EVERY_S)
    replay = w.batch("a", Heartbeat(at=now), seq=beat.batch.seq)
    fx = w.m.handle(replay, now)
    assert refusal(fx) is not None and not acknowledges(fx, replay.batch, now, None)
    gap = w.batch("a", Heartbeat(at=now), seq=beat.batch.seq + 5)
    fx = w.m.handle(gap, now)
    assert any(isinstance(e, Send) and isinstance(e.command, Resync) for e in fx)
    assert not acknowledges(fx, gap.batch, now, None)
    w.cluster("a")  # a snapshot puts the cluster back in sequence
    ended = w.batch("a", WorkloadStatus(job_id="gone", attempt=1, phase="failed"))
    fx = w.m.handle(ended, now)
    assert acknowledges(fx, ended.batch, now, now)  # an outcome: at once


def reported(*keys: tuple[str, int], phase: WorkloadPhase = "created") -> EventBatch:
    events: list[AgentEvent] = [WorkloadStatus(job_id=j, attempt=a, phase=phase) for j, a in keys]
    return EventBatch(cluster="c1", instance="i", seq=1, events=events)


def test_a_dispatch_is_waited_for_again_only_while_its_cluster_moves_on_others() -> None:
    """The busy-agent rule (broker/ackwait.py), on the sequencer alone: progress is another
    Dispatch of ours answered or reported in any phase (a kube attempt's pods may run before
    its Dispatch is answered, so its first report is `running`); heartbeats, answers to other
    commands and reports of Dispatches not awaited are not; one reported itself is asked again;
    patience is the ceiling times the copies; a step-down forgets what was awaited."""
    seq = Sequencer(TIMEOUTS)  # ceiling 20 s, 3 copies of a Dispatch: 60 s of patience
    mine, other = dispatch("a", 1), dispatch("b", 1)
    key, copies = [("a", 1)], seq.attempts(mine)
    seq.dispatch_sent("c1", mine)
    seq.dispatch_sent("c1", other)
    heard = seq.heard("c1")
    seq.acked("c1", 0.1)  # an Applied or a Cancel answered: not the Dispatch path
    seq.carried_out("c1", reported(("z", 9)))  # a workload not awaited here
    seq.carried_out("c2", reported(("b", 1)))  # another cluster's report
    assert not seq.still_busy("c1", heard, 2.0, copies, key)
    seq.carried_out("c1", reported(("b", 1), phase="running"))
    assert seq.still_busy("c1", heard, 2.0, copies, key)
    assert not seq.still_busy("c1", heard, 60.0, copies, key), "past its patience"
    heard = seq.heard("c1")
    seq.carried_out("c1", reported(("b", 1)))  # reported again: no news
    assert not seq.still_busy("c1", heard, 4.0, copies, key)
    seq.acked("c1", 0.1, dispatch=True)  # a batch answered
    assert seq.still_busy("c1", heard, 4.0, copies, key)
    seq.carried_out("c1", reported(("a", 1), phase="succeeded"))  # carried out: answer lost
    assert not seq.still_busy("c1", heard, 4.0, copies, key)
    seq.dispatch_answered(mine)
    seq.reset()  # a step-down: nothing is awaited, nothing is busy
    heard = seq.heard("c1")
    seq.dispatch_sent("c1", mine)
    seq.reset()
    seq.acked("c1", 0.1, dispatch=True)
    assert not seq.still_busy("c1", heard, 4.0, copies, key)
