"""A stored record decoded with its alike spec parts decoded once (`StoredRecordDecoder`, what
a restart and the standby's mirror take records with) is the record the plain decoder gives,
is refused exactly when and as the plain decoder refuses it, and restores the same core."""

from __future__ import annotations

import random
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.inputs import Restore
from broker.core.machine import Machine
from broker.core.records import (
    RECORD_FORMAT,
    AttemptRecord,
    JobRecord,
    record_decoder,
    record_encoder,
)
from broker.core.storedrecord import StoredRecordDecoder
from schemas.agent import PodSetAssignment
from schemas.config import BrokerConfig, QueueConfig
from schemas.job import GangTopology, JobSpec, PodSet, Workload
from tests.schemas.strategies import jobspecs, msgpack_values

T0 = 1_800_000_000.0
SPEC_FIELDS = [f.name for f in msgspec.structs.fields(JobSpec)]


def record_of(spec: JobSpec, job_id: str, queue: str = "q", order: int = 1) -> JobRecord:
    return JobRecord(job_id=job_id, spec=spec, queue=queue, order=order, submitted_at=T0)


def outcome(decode: Any, data: bytes) -> tuple[str, Any]:
    """What a decode gives: the record, or the refusal's type and message."""
    try:
        return "record", decode(data)
    except Exception as exc:
        return "refused", (type(exc), str(exc))


@settings(max_examples=300, deadline=None)
@given(spec=jobspecs)
def test_a_stored_record_decodes_to_what_the_plain_decoder_gives(spec: JobSpec) -> None:
    decoder = StoredRecordDecoder()
    data = record_encoder.encode(record_of(spec, "a"))
    first, again = decoder.decode(data), decoder.decode(data)
    assert first == again == record_decoder.decode(data)
    assert decoder.plain_decodes == 0  # taken by the shared-parts path, not its fallback
    assert record_encoder.encode(first) == record_encoder.encode(record_decoder.decode(data))
    # Equal stored parts become one copy (a manifest's workload stays each job's own).
    assert first.spec.gang is again.spec.gang and first.spec.spot is again.spec.spot
    assert (first.spec.workload is again.spec.workload) == (spec.workload.manifest is None)


def test_parts_alike_in_bytes_but_in_other_fields_are_told_apart() -> None:
    """A label map and a gang topology can be the same bytes: which field holds them is part
    of what a set of parts is remembered by."""
    gang = [PodSet(name="w", gpu=1)]
    labelled = JobSpec(name="j", gang=gang, labels={"required": "rack"})
    placed = JobSpec(name="j", gang=gang, topology=GangTopology(required="rack"))
    decoder = StoredRecordDecoder()
    for spec in (labelled, placed, labelled):
        data = record_encoder.encode(record_of(spec, "a"))
        assert decoder.decode(data) == record_decoder.decode(data)
    assert decoder.plain_decodes == 0


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(jobspecs, min_size=2, max_size=8))
def test_one_decoder_takes_many_records_each_as_the_plain_decoder_does(
    specs: list[JobSpec],
) -> None:
    decoder = StoredRecordDecoder()
    for i, spec in enumerate(specs * 2):
        data = record_encoder.encode(record_of(spec, f"j{i}"))
        assert decoder.decode(data) == record_decoder.decode(data)
    assert decoder.plain_decodes == 0


@settings(max_examples=500, deadline=None)
@given(
    spec=jobspecs,
    field=st.sampled_from([*SPEC_FIELDS, "unknown"]),
    value=msgpack_values,
)
def test_a_stored_spec_field_is_refused_exactly_as_the_plain_decoder_refuses_it(
    spec: JobSpec, field: str, value: Any
) -> None:
    fields = msgspec.to_builtins(record_of(spec, "a"))
    fields["spec"][field] = value
    data = msgspec.msgpack.encode(fields)
    decoder = StoredRecordDecoder()
    decoder.decode(record_encoder.encode(record_of(spec, "b")))  # its parts seen before
    assert outcome(decoder.decode, data) == outcome(record_decoder.decode, data)
    assert decoder.plain_decodes == 0  # what the plain decoder takes, this path takes too


def hostile(base: dict[str, Any]) -> list[bytes]:
    """Stored records a broker must refuse, or of a newer format, each as bytes."""
    spec = base["spec"]
    out = [b"\x93\x01\x02", b"", b"\xc1", msgspec.msgpack.encode(base)[:-3]]
    changes: list[dict[str, Any]] = [
        {"gang": [spec["gang"][0], spec["gang"][0]]},  # podset names not unique
        {"gang": [{**spec["gang"][0], "name": f"p{i}"} for i in range(17)]},  # too many
        {"gang": [], "workload": {}},  # neither a gang nor a manifest
        {"priority": 10**7},
        {"labels": {f"k{i}": "v" for i in range(65)}},
        {"gpu_types": ["x" * 65]},
        {"topology": {"unknown": 1}},
        {"spot": []},
        {"surplus": 1},  # a spec refuses unknown fields
        {"capacity": "spot", "deadline": {"within_s": 3600, "runtime_s": 60, "total_steps": 9}},
    ]
    for change in changes:
        out.append(msgspec.msgpack.encode({**base, "spec": {**spec, **change}}))
    out.append(msgspec.msgpack.encode({**base, "format": RECORD_FORMAT + 1, "later": [1, 2]}))
    out.append(msgspec.msgpack.encode({**base, "format": 0}))
    out.append(msgspec.msgpack.encode({k: v for k, v in base.items() if k != "spec"}))
    return out


def test_corrupt_and_newer_records_are_refused_or_kept_as_the_plain_decoder_does() -> None:
    spec = JobSpec(name="j", gang=[PodSet(name="w", gpu=8)], checkpoint=None)
    base = msgspec.to_builtins(record_of(spec, "a"))
    decoder = StoredRecordDecoder()
    decoder.decode(record_encoder.encode(record_of(spec, "b")))
    outcomes = [outcome(decoder.decode, data) for data in hostile(base)]
    assert outcomes == [outcome(record_decoder.decode, data) for data in hostile(base)]
    assert decoder.plain_decodes == 0  # the newer record too
    assert sum(kind == "refused" for kind, _ in outcomes) == len(outcomes) - 1
    assert outcomes[-3][1].format == RECORD_FORMAT + 1  # a newer one decodes, to be kept out


def varied_records(count: int) -> list[bytes]:
    """Stored records of many jobs that hold a few gangs, workloads and labels alike, some
    with a manifest, some placed, each stored as the store writes it."""
    rng = random.Random(11)
    gangs = [[PodSet(name="w", replicas=r, gpu=g)] for r in (1, 2, 4) for g in (1, 8)]
    workloads = [Workload(image=f"trainer:{v}") for v in range(3)]
    out = []
    for i in range(count):
        manifest = {"kind": "Job", "n": i} if i % 17 == 0 else None
        spec = JobSpec(
            name=f"j{i % 5}",
            job_id=f"job-{i}",
            gang=[] if manifest else rng.choice(gangs),
            priority=rng.randint(0, 3),
            capacity=rng.choice(["spot", "on-demand", "any"]),
            workload=Workload(manifest=manifest) if manifest else rng.choice(workloads),
            labels={"team": f"t{i % 3}"} if i % 2 else {},
            gpu_types=["a100"] if i % 3 else [],
        )
        record = record_of(spec, f"job-{i}", queue=f"q{i % 4}", order=i)
        if i % 7 == 0 and spec.gang:
            record.state, record.attempt = "running", 1
            record.attempts = [
                AttemptRecord(
                    attempt=1,
                    cluster=f"c{i % 2}",
                    flavor="f",
                    flavor_class="gpu",
                    assignment=[
                        PodSetAssignment(
                            podset="w", nodes=[f"n{k}" for k in range(spec.gang[0].replicas)]
                        )
                    ],
                    dispatched_at=T0,
                    running_at=T0,
                )
            ]
        out.append(record_encoder.encode(record))
    return out


def test_a_restore_from_stored_records_builds_the_core_the_plain_decode_builds() -> None:
    stored = varied_records(2000)
    config = BrokerConfig(queues=[QueueConfig(name=f"q{i}") for i in range(4)])
    cores = []
    for decode in (record_decoder.decode, StoredRecordDecoder().decode):
        m = Machine(config, epoch=1)
        m.handle(Restore([decode(data) for data in stored]), T0)
        cores.append(m)
    plain, shared = cores
    assert {k: record_encoder.encode(r) for k, r in shared.jobs.items()} == {
        k: record_encoder.encode(r) for k, r in plain.jobs.items()
    }
    assert dict(shared.registry.all_demands) == dict(plain.registry.all_demands)
    a, b = shared.jobs["job-1"].spec, shared.jobs["job-13"].spec
    assert (a.labels is b.labels) and a.gpu_types is b.gpu_types
