"""Encoders and decoders, built once and reused (msgspec is fastest that way).

Every decoder raises `DecodeError` and nothing else, whatever the bytes, so callers need one
`except` to turn hostile input into a clear reply.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from schemas.agent import CommandAck, DispatchAcks, EventBatch, WireCommand
from schemas.api import JobEvent, SubmitReply
from schemas.config import BrokerConfig
from schemas.fieldhints import explain
from schemas.job import JobSpec

T = TypeVar("T")

MAX_PAYLOAD = 1024 * 1024  # bytes; the broker's configured limit may be lower


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected type; the text says why."""


json_encoder = msgspec.json.Encoder()
msgpack_encoder = msgspec.msgpack.Encoder()


def encode_json(obj: Any) -> bytes:
    return json_encoder.encode(obj)


def every_field(value: Any, *, drop_none: bool = False) -> Any:
    """Builtins of a Struct with every field, defaults included (our Structs omit their
    defaults on the wire), for readers that must see them: the dashboard's pages, and
    `muster config` showing the defaults it applied. `drop_none` leaves unset optionals out."""
    if isinstance(value, msgspec.Struct):
        out = {}
        for f in value.__struct_fields__:
            item = getattr(value, f)
            if item is None and drop_none:
                continue
            out[f] = every_field(item, drop_none=drop_none)
        return out
    if isinstance(value, list | tuple):
        return [every_field(v, drop_none=drop_none) for v in value]
    if isinstance(value, dict):
        return {k: every_field(v, drop_none=drop_none) for k, v in value.items()}
    return msgspec.to_builtins(value)


def encode_msgpack(obj: Any) -> bytes:
    return msgpack_encoder.encode(obj)


class _Decoder(Generic[T]):
    """Wraps one msgspec decoder; turns every failure into DecodeError with a readable text."""

    __slots__ = ("_decoder", "_hint_root", "_label", "_limit")

    def __init__(
        self, decoder: Any, label: str, limit: int = MAX_PAYLOAD, hint_root: Any = None
    ) -> None:
        self._decoder = decoder
        self._label = label
        self._limit = limit
        self._hint_root = hint_root  # a Struct type: name the field, "did you mean" typos

    @property
    def label(self) -> str:
        """What the decoder reads, as its error messages name it."""
        return self._label

    def __call__(self, data: bytes | bytearray | memoryview | str, limit: int | None = None) -> T:
        cap = self._limit if limit is None else limit
        if len(data) > cap:
            raise DecodeError(
                f"{self._label} is {len(data)} bytes, over the limit of {cap} bytes; "
                "send a smaller message"
            )
        if not data:
            raise DecodeError(f"{self._label} is empty; send a {self._label} object")
        try:
            return self._decoder.decode(data)  # type: ignore[no-any-return]
        except msgspec.ValidationError as exc:
            text = str(exc) if self._hint_root is None else explain(str(exc), self._hint_root)
            raise DecodeError(f"invalid {self._label}: {text}") from None
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed {self._label}: {exc}") from None
        except (RecursionError, MemoryError, OverflowError, ValueError, TypeError) as exc:
            raise DecodeError(f"invalid {self._label}: {type(exc).__name__}: {exc}") from None


def json_decoder(kind: type[T], label: str) -> _Decoder[T]:
    return _Decoder(msgspec.json.Decoder(kind), label)


def msgpack_decoder(kind: type[T], label: str, limit: int = MAX_PAYLOAD) -> _Decoder[T]:
    return _Decoder(msgspec.msgpack.Decoder(kind), label, limit)


# Client-facing (JSON)
decode_jobspec: _Decoder[JobSpec] = _Decoder(
    msgspec.json.Decoder(JobSpec), "JobSpec", hint_root=JobSpec
)
decode_json_object: _Decoder[dict[str, Any]] = json_decoder(dict[str, Any], "JSON object")
decode_submit_reply: _Decoder[SubmitReply] = json_decoder(SubmitReply, "SubmitReply")
decode_job_event: _Decoder[JobEvent] = json_decoder(JobEvent, "JobEvent")

# Agent protocol (msgpack). Snapshots of big clusters are larger than client messages.
decode_event_batch: _Decoder[EventBatch] = msgpack_decoder(EventBatch, "EventBatch", 64 * 2**20)
decode_command: _Decoder[WireCommand] = msgpack_decoder(WireCommand, "Command", 16 * 2**20)  # type: ignore[arg-type]
decode_command_ack: _Decoder[CommandAck] = msgpack_decoder(CommandAck, "CommandAck")
decode_dispatch_acks: _Decoder[DispatchAcks] = msgpack_decoder(DispatchAcks, "DispatchAcks")


def convert_config(raw: Any) -> BrokerConfig:
    """Validate an already-parsed YAML document as a BrokerConfig."""
    try:
        return msgspec.convert(raw, BrokerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid broker config: {exc}") from None
