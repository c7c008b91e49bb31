"""Jobs that hold equal spec parts share one copy once registered, and sharing changes no
value: a registered record encodes exactly as it did, and replacing a part of one job (its
compaction, a relabel) leaves every other job's spec as it was."""

from __future__ import annotations

import sys

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.effects import split_reply
from broker.core.inputs import Restore, SubmitJob
from broker.core.machine import Machine
from broker.core.records import (
    AttemptRecord,
    JobRecord,
    compact,
    demands_of,
    gang_request,
    record_decoder,
    record_encoder,
)
from broker.core.registry import JobRegistry
from broker.core.sharing import EMPTY, POOL_LIMIT, SHARE_PART, ByIdentity, Pool, share_spec
from broker.core.topology import need_of
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import GangTopology, JobSpec, PodSet, Workload
from tests.schemas.strategies import jobspecs

T0 = 1_800_000_000.0


def record_of(spec: JobSpec, job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, spec=spec, queue="q", order=1, submitted_at=T0)


def copy(spec: JobSpec) -> JobSpec:
    """An equal spec with every part its own, as each decoded submission has."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=JobSpec)


@settings(max_examples=200, deadline=None)
@given(spec=jobspecs)
def test_registering_changes_no_value_and_shares_equal_parts(spec: JobSpec) -> None:
    registry = JobRegistry()
    first, second = record_of(copy(spec), "a"), record_of(copy(spec), "b")
    before = [record_encoder.encode(first), record_encoder.encode(second)]
    registry.add(first)
    registry.add(second)
    assert [record_encoder.encode(first), record_encoder.encode(second)] == before
    a, b = first.spec, second.spec
    assert a.gang is b.gang and a.spot is b.spot and a.restart is b.restart
    assert a.labels is b.labels and a.gpu_types is b.gpu_types
    # A submitted manifest is each job's own (it is the bulk of a large spec, seldom alike).
    assert (a.workload is b.workload) == (spec.workload.manifest is None)
    assert registry.demands("a") is registry.demands("b")
    assert first.queue is sys.intern("q")


@settings(max_examples=200, deadline=None)
@given(spec=jobspecs)
def test_share_spec_and_the_part_table_give_each_part_the_same_copy(spec: JobSpec) -> None:
    """`share_spec` writes out the rules of `SHARE_PART` (what a restart's decode follows): a
    spec shared either way holds the very same object in every part."""
    by_spec, by_table = copy(spec), copy(spec)
    share_spec(by_spec)
    for name, share in SHARE_PART.items():
        setattr(by_table, name, share(getattr(by_table, name)))
    for name in SHARE_PART:
        assert getattr(by_spec, name) is getattr(by_table, name) or (
            name == "workload" and spec.workload.manifest is not None
        ), name
    assert by_spec == by_table == spec


def test_compacting_one_job_leaves_an_alike_job_its_workload() -> None:
    m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]))
    workload = Workload(image="trainer:1", command=["python", "train.py"], env={"A": "1"})
    for job_id in ("done", "waiting"):
        spec = JobSpec(name="j", job_id=job_id, gang=[PodSet(name="w", gpu=1)], workload=workload)
        reply, _ = split_reply(m.handle(SubmitJob(copy(spec), subject_queue="q"), T0))
        assert reply.accepted, reply.error
    done, waiting = m.jobs["done"], m.jobs["waiting"]
    assert done.spec.workload is waiting.spec.workload
    assert compact(done)
    assert done.spec.workload.image == ""
    assert waiting.spec.workload == workload


def test_alike_requests_share_their_sets_and_a_changed_one_does_not_leak() -> None:
    spec = JobSpec(name="j", gang=[PodSet(name="w", gpu=1)], gpu_types=["A100"])
    first = record_of(copy(spec), "a")
    second = record_of(copy(spec), "b")
    r1, r2 = gang_request(first, T0, ()), gang_request(second, T0, ())
    assert r1.gpu_types is r2.gpu_types == frozenset({"a100"})
    assert r1.avoid_pools is EMPTY and r1.elastic is EMPTY
    assert r1.min_replicas is r2.min_replicas == {}
    elastic = JobSpec(name="e", gang=[PodSet(name="w", gpu=1, min_replicas=1, max_replicas=4)])
    r3 = gang_request(record_of(elastic, "c"), T0, ())
    assert r3.min_replicas == {"w": 1} and r3.elastic == {"w"}
    assert r1.min_replicas == {} and r1.elastic == frozenset()


def test_a_restored_record_shares_its_spec_and_interns_its_attempt_names() -> None:
    m = Machine(BrokerConfig(queues=[QueueConfig(name="q")]))
    spec = JobSpec(name="j", job_id="r", gang=[PodSet(name="w", gpu=1)])
    attempt = AttemptRecord(
        attempt=1,
        cluster="c-1",
        flavor="a100-spot",
        flavor_class="a100",
        assignment=[],
        dispatched_at=T0,
        ended_at=T0 + 5,
        end_cause="spot-reclaimed",
    )
    stored = record_of(spec, "r")
    stored.attempts = [attempt]
    stored.attempt = 1
    for job_id in ("r", "s"):  # decoded from the bucket: every string its own copy
        data = record_encoder.encode(msgspec.structs.replace(stored, job_id=job_id))
        m.handle(Restore([record_decoder.decode(data)]), T0 + 10)
    r, s = m.jobs["r"], m.jobs["s"]
    assert r.spec.gang is s.spec.gang
    assert r.attempts[0].cluster is s.attempts[0].cluster is sys.intern("c-1")
    assert r.attempts[0].flavor is s.attempts[0].flavor
    assert r.state == s.state == "queued"


def test_a_pool_keeps_at_most_its_limit_of_values() -> None:
    pool: Pool[int, str] = Pool()
    for i in range(POOL_LIMIT + 10):
        pool.share(i, str(i))
    assert len(pool) == POOL_LIMIT
    late = str(POOL_LIMIT + 50)
    assert pool.share(POOL_LIMIT + 50, late) is late  # not kept: the job keeps its own
    assert len(pool) == POOL_LIMIT
    early = "0"
    assert pool.share(0, early) is not early and pool.share(0, early) == "0"


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(jobspecs, min_size=1, max_size=6), picks=st.lists(st.integers(0, 5)))
def test_every_job_gets_the_demands_of_its_own_gang(specs: list[JobSpec], picks: list[int]) -> None:
    """Demands are derived once per shared gang object: jobs of equal gangs get the same
    tuple, and no job ever gets another gang's."""
    registry = JobRegistry()
    chosen = [specs[i % len(specs)] for i in [*range(len(specs)), *picks]]
    for n, spec in enumerate(chosen):
        registry.add(record_of(copy(spec), f"j{n}"))
    for n, spec in enumerate(chosen):
        assert registry.demands(f"j{n}") == demands_of(spec)
    by_gang: dict[bytes, tuple[object, ...]] = {}
    for n, spec in enumerate(chosen):
        got = by_gang.setdefault(msgspec.msgpack.encode(spec.gang), registry.demands(f"j{n}"))
        assert got is registry.demands(f"j{n}")


def test_derived_by_identity_never_answers_for_an_equal_but_other_value() -> None:
    derived: ByIdentity[list[int], str] = ByIdentity()
    one, other = [1], [1]
    derived.put(one, "one's")
    assert derived.get(one) == "one's" and derived.get(other) is None
    for n in range(POOL_LIMIT + 10):
        derived.put([n], str(n))
    kept = [n, "x"]
    assert derived.put(kept, "past the limit") == "past the limit"
    assert derived.get(kept) is None  # not kept: bounded


@settings(max_examples=200, deadline=None)
@given(
    spec=jobspecs,
    topology=st.one_of(
        st.none(),
        st.builds(
            GangTopology,
            required=st.sampled_from([None, "rack", "zone"]),
            preferred=st.sampled_from([None, "block"]),
            spread=st.booleans(),
        ),
    ),
    gpu_types=st.lists(st.sampled_from(["A100", "h100", "L4"]), max_size=2),
)
def test_a_request_reads_its_own_spec_whatever_alike_jobs_share(
    spec: JobSpec, topology: GangTopology | None, gpu_types: list[str]
) -> None:
    """What a request derives from a shared gang or GPU type list is derived once for all the
    jobs holding it; a job with the same gang but its own topology or types still gets its
    own: each request holds what its own spec says."""
    registry = JobRegistry()
    first = record_of(copy(spec), "a")
    second = record_of(
        msgspec.structs.replace(copy(spec), topology=topology, gpu_types=gpu_types), "b"
    )
    for record in (first, second, record_of(copy(spec), "c")):
        registry.add(record)
        req, own = gang_request(record, T0, ()), record.spec
        assert req.topology == need_of(own)
        assert req.gpu_types == {t.lower() for t in own.gpu_types}
        assert req.min_replicas == {p.name: p.least for p in own.gang if p.least < p.most}
        assert req.elastic == {p.name for p in own.gang if p.elastic}
