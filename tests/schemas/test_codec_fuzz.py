"""Fuzzing every decoder in schemas/codec.py: whatever the bytes, a decoder returns a valid
Struct of its type or raises schemas.codec.DecodeError, never anything else. Valid messages
round-trip exactly."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.agent import (
    Cancel,
    CheckpointNow,
    CommandAck,
    Dispatch,
    DispatchAcks,
    DispatchBatch,
    EventBatch,
    Provision,
    Resync,
    WireRefused,
)
from schemas.api import JobEvent, SubmitReply
from schemas.codec import (
    MAX_PAYLOAD,
    DecodeError,
    convert_config,
    decode_command,
    decode_command_ack,
    decode_dispatch_acks,
    decode_event_batch,
    decode_job_event,
    decode_jobspec,
    decode_json_object,
    decode_submit_reply,
    encode_json,
    encode_msgpack,
)
from schemas.config import BrokerConfig
from schemas.job import JobSpec

from .strategies import (
    broker_configs,
    command_acks,
    commands,
    dispatch_acks,
    event_batches,
    job_events,
    jobspecs,
    json_values,
    msgpack_values,
    submit_replies,
)

# Sized to keep tests/schemas near 20 s on a 2-core machine; raise max_examples locally when
# hunting for bugs.
FUZZ = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MUTATE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# (decoder, the type it returns, the encoder of its wire format, a strategy of valid messages)
JSON_DECODERS: list[tuple[Any, Any, Any, Any]] = [
    (decode_jobspec, JobSpec, encode_json, jobspecs),
    (decode_submit_reply, SubmitReply, encode_json, submit_replies),
    (decode_job_event, JobEvent, encode_json, job_events),
    (decode_json_object, dict, encode_json, st.dictionaries(st.text(max_size=8), json_values)),
]
MSGPACK_DECODERS: list[tuple[Any, Any, Any, Any]] = [
    (decode_event_batch, EventBatch, encode_msgpack, event_batches),
    (
        decode_command,
        (Dispatch, DispatchBatch, Cancel, CheckpointNow, Resync, WireRefused, Provision),
        encode_msgpack,
        commands,
    ),
    (decode_command_ack, CommandAck, encode_msgpack, command_acks),
    (decode_dispatch_acks, DispatchAcks, encode_msgpack, dispatch_acks),
]
DECODERS = JSON_DECODERS + MSGPACK_DECODERS
IDS = [d[0].label for d in DECODERS]


def check(decoder: Any, kind: Any, data: bytes) -> None:
    """The contract: a value of the right type, or DecodeError (anything else fails here)."""
    try:
        value = decoder(data)
    except DecodeError:
        return
    assert isinstance(value, kind)


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(decoder: Any, kind: Any, encode: Any, valid: Any, data: bytes) -> None:
    check(decoder, kind, data)


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@FUZZ
@given(value=json_values)
def test_random_json_values(decoder: Any, kind: Any, encode: Any, valid: Any, value: Any) -> None:
    check(decoder, kind, encode_json(value))


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@FUZZ
@given(value=msgpack_values)
def test_random_msgpack_values(
    decoder: Any, kind: Any, encode: Any, valid: Any, value: Any
) -> None:
    check(decoder, kind, encode_msgpack(value))


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@ROUND_TRIP
@given(data=st.data())
def test_valid_messages_round_trip(
    decoder: Any, kind: Any, encode: Any, valid: Any, data: st.DataObject
) -> None:
    message = data.draw(valid)
    assert decoder(encode(message)) == message


# -- mutated valid messages --------------------------------------------------------------


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _replace(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _replace(tree[head], rest, value)}
    copy = list(tree)
    copy[head] = _replace(tree[head], rest, value)
    return copy


def _delete(tree: Any, path: tuple[Any, ...]) -> Any:
    if len(path) == 1:
        if isinstance(tree, dict):
            return {k: v for k, v in tree.items() if k != path[0]}
        return [v for i, v in enumerate(tree) if i != path[0]]
    head = path[0]
    if isinstance(tree, dict):
        return {**tree, head: _delete(tree[head], path[1:])}
    copy = list(tree)
    copy[head] = _delete(tree[head], path[1:])
    return copy


WEIRD = st.one_of(
    json_values,
    st.sampled_from(
        [
            10**30,
            -(10**30),
            2**63,
            -(2**63) - 1,
            1e308,
            -1e308,
            5e-324,
            "",
            "x" * 5000,
            "1e9999",
            "NaN",
            [],
            {},
            [[[[[]]]]],
            {"type": "dispatch"},
            {"type": "nope"},
            True,
            None,
        ]
    ),
)


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@MUTATE
@given(data=st.data())
def test_structurally_mutated_messages(
    decoder: Any, kind: Any, encode: Any, valid: Any, data: st.DataObject
) -> None:
    tree = msgspec.to_builtins(data.draw(valid))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(tree)))
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete" and path:
            tree = _delete(tree, path)
        elif action == "add" and path == ():
            if isinstance(tree, dict):
                tree = {**tree, data.draw(st.text(max_size=8)): data.draw(WEIRD)}
        else:
            tree = _replace(tree, path, data.draw(WEIRD))
    try:
        payload = encode(tree)
    except (OverflowError, TypeError, msgspec.EncodeError):
        return  # e.g. an int msgpack cannot carry: nothing to send
    check(decoder, kind, payload)


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@MUTATE
@given(data=st.data())
def test_byte_mutated_messages(
    decoder: Any, kind: Any, encode: Any, valid: Any, data: st.DataObject
) -> None:
    payload = bytearray(encode(data.draw(valid)))
    for _ in range(data.draw(st.integers(1, 4))):
        if not payload:
            break
        i = data.draw(st.integers(0, len(payload) - 1))
        match data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"])):
            case "flip":
                payload[i] ^= data.draw(st.integers(1, 255))
            case "truncate":
                del payload[i:]
            case "insert":
                payload[i:i] = data.draw(st.binary(min_size=1, max_size=4))
            case "delete":
                del payload[i]
    check(decoder, kind, bytes(payload))


# -- hand-picked hostile input -----------------------------------------------------------

HOSTILE_JSON = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"name":"a","workload":{"manifest":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}}",
    b'{"name":"a","gang":[{"name":"w"}],"workload":{"manifest":{"a":'
    + b"[" * 5000
    + b"]" * 5000
    + b"}}}",
    b'{"name":"a","gang":[{"name":"w"}],"priority":' + b"9" * 4000 + b"}",
    b'{"name":"a","gang":[{"name":"w","gpu":1e400}]}',
    b'{"name":"a","gang":[{"name":"w","cpu":1e308}]}',
    b'{"name":"a","gang":[{"name":"w","cpu":-1}]}',
    b'{"name":"a","gang":[{"name":"w","memory":"1e60"}]}',
    b'{"name":"a","gang":[{"name":"w","memory":true}]}',
    b'{"job_id":"x","kind":"queued","at":NaN,"state":"queued"}',
    b'{"job_id":"x","kind":"queued","at":1e999,"state":"queued"}',
    b'{"accepted":"yes"}',
    b'{"name":"\xff\xfe"}',
    b'"\\ud800"',
    b"\x00" * 64,
    b"{" + b'"a":1,' * 50_000 + b'"b":2}',
    b"   ",
    b"null",
]
HOSTILE_MSGPACK = [
    b"\x91" * 100_000,
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion entries
    b"\xc1",
    encode_msgpack({"cluster": "c", "instance": "i", "seq": 0, "events": []}),
    encode_msgpack({"cluster": "c.d", "instance": "i", "seq": 1, "events": []}),
    encode_msgpack({"cluster": "c", "instance": "i", "seq": 1, "events": [{"type": "bogus"}]}),
    encode_msgpack({"type": "dispatch", "job_id": "j"}),
    encode_msgpack({"ok": True, "error": "x" * 2000}),
    encode_msgpack(2**64 - 1),
]


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
@pytest.mark.parametrize("payload", HOSTILE_JSON + HOSTILE_MSGPACK)
def test_hostile_payloads(decoder: Any, kind: Any, encode: Any, valid: Any, payload: bytes) -> None:
    check(decoder, kind, payload)


@pytest.mark.parametrize(("decoder", "kind", "encode", "valid"), DECODERS, ids=IDS)
def test_empty_and_oversized(decoder: Any, kind: Any, encode: Any, valid: Any) -> None:
    with pytest.raises(DecodeError, match="is empty"):
        decoder(b"")
    with pytest.raises(DecodeError, match="over the limit of 10 bytes"):
        decoder(b"x" * 11, 10)
    with pytest.raises(DecodeError, match="over the limit"):
        decoder(b" " * (64 * 2**20 + 1))
    assert MAX_PAYLOAD == 2**20


def test_huge_quantity_exponent_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_jobspec(b'{"name":"a","gang":[{"name":"w","cpu":"1e9999999"}]}')


# -- convert_config (already-parsed YAML) ------------------------------------------------


@FUZZ
@given(value=json_values)
def test_convert_config_random_values(value: Any) -> None:
    try:
        config = convert_config(value)
    except DecodeError:
        return
    assert isinstance(config, BrokerConfig)


@ROUND_TRIP
@given(config=broker_configs())
def test_convert_config_round_trip(config: BrokerConfig) -> None:
    assert convert_config(msgspec.to_builtins(config)) == config


@MUTATE
@given(data=st.data())
def test_convert_config_mutated(data: st.DataObject) -> None:
    tree = msgspec.to_builtins(data.draw(broker_configs()))
    path = data.draw(st.sampled_from(_paths(tree)))
    tree = _replace(tree, path, data.draw(WEIRD))
    try:
        config = convert_config(tree)
    except DecodeError:
        return
    assert isinstance(config, BrokerConfig)
