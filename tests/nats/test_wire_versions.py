"""Version skew between a broker and an agent one minor release apart, both ways, against the
previous release's (0.1.0) messages and schema kept in fixtures/release-0.1.0: what it sent
decodes here, and what this release sends validates against its schema (which an older agent
or broker decodes with). The previous release's job records decode too, so a new broker
restores an old broker's bucket (a rolling upgrade of the brokers, standby first)."""

from __future__ import annotations

from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.core.records import RECORD_FORMAT, record_decoder
from schemas.agent import (
    Cancel,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    EventBatch,
    FlavorInfo,
    Heartbeat,
    PodSetAssignment,
    ProvisionPool,
    WorkloadStatus,
)
from schemas.codec import decode_command, decode_command_ack, decode_event_batch
from schemas.job import JobSpec
from schemas.wire import UNVERSIONED, WIRE_VERSION, compatible, parse
from tests.nats.previous_release import previous_messages, previous_schema


def test_the_previous_releases_messages_decode_here() -> None:
    old = previous_messages()
    batch = decode_event_batch(old["EventBatch"])
    assert batch.cluster == "east" and batch.wire == ""
    assert [type(e) for e in batch.events] == [ClusterSnapshot, Heartbeat]
    assert compatible(batch.wire)  # unversioned: 1.0, the same major
    dispatch = decode_command(old["Dispatch"])
    assert isinstance(dispatch, Dispatch)
    assert (dispatch.job_id, dispatch.epoch, dispatch.checkpoint_token) == ("fx-1", 7, "t0k")
    assert isinstance(decode_command(old["Cancel"]), Cancel)
    assert decode_command_ack(old["CommandAck"]).ok
    record = record_decoder.decode(old["JobRecord"])
    assert (record.job_id, record.state, record.spec.gang[0].replicas) == ("fx-1", "queued", 2)
    assert record.format == RECORD_FORMAT == 1  # written before records had a format


def _current_messages() -> dict[str, Any]:
    spec = msgspec.convert(
        {
            "name": "fx",
            "job_id": "fx-2",
            "gang": [{"name": "worker", "replicas": 1, "gpu": 8}],
            "checkpoint": {"uri": "s3://ckpt/fx"},
        },
        JobSpec,
    )
    flavor = FlavorInfo(
        name="od", capacity_type="on-demand", gpu_type="A100", price_per_gpu_hour=3.0
    )
    # An autoscaled pool (wire 1.2): an optional field a 0.1.0 peer ignores.
    grown = FlavorInfo(
        name="spot",
        capacity_type="spot",
        provision=ProvisionPool(max_nodes=4, node_gpu=8, labels={"pool": "a"}, ready_s=240.0),
    )
    return {
        "EventBatch": EventBatch(
            cluster="east",
            instance="i-2",
            seq=3,
            events=[
                ClusterSnapshot(flavors=[flavor, grown], nodes=[], workloads=[]),
                Heartbeat(),
            ],
            sent_at=1.0,
            wire=WIRE_VERSION,
        ),
        "Command": Dispatch(
            job_id="fx-2",
            attempt=2,
            epoch=9,
            flavor="od",
            assignment=[PodSetAssignment(podset="worker", nodes=["n1"])],
            spec=spec,
            fence_after_s=20.0,
            checkpoint_token="t",
            checkpoint_interval_s=600.0,
            revision=1,  # wire 1.2: an elastic attempt's nodes changed in place
        ),
        "CommandAck": CommandAck(ok=False, error="stale", stale_epoch=True, epoch=10),
        # wire 1.4: a Cancel's answer with the attempt's ending, which a 0.1.0 broker ignores
        "CancelAck": CommandAck(
            ok=True, ended=WorkloadStatus(job_id="fx-2", attempt=1, phase="succeeded")
        ),
    }


@pytest.mark.parametrize("name", ["EventBatch", "Command", "CommandAck", "CancelAck"])
def test_this_releases_messages_fit_the_previous_releases_schema(name: str) -> None:
    message = msgspec.to_builtins(_current_messages()[name])
    schema = "CommandAck" if name == "CancelAck" else name
    jsonschema.validate(message, previous_schema(schema))


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
def test_peers_interoperate_exactly_within_a_major(a: int, b: int, c: int, d: int) -> None:
    assert compatible(f"{a}.{b}", f"{c}.{d}") == (a == c)


def test_versions_read_as_documented() -> None:
    assert parse("") == parse(UNVERSIONED) == (1, 0)
    assert compatible("", WIRE_VERSION) and compatible("1.9", WIRE_VERSION)
    assert not compatible("2.0", WIRE_VERSION) and not compatible("one", WIRE_VERSION)
