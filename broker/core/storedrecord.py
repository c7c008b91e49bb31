"""Stored job records decoded with the spec parts jobs hold alike decoded once.

A restart reads 100,000 records whose specs mostly repeat a few gangs, policies and
workloads. Decoding each record whole built every part again, only for the core rebuild to
encode each part (`share_spec`, sharing.py) and drop it for the pooled copy: an eighth of a
restart, and a restarted broker left about 100 MiB larger than the one it replaced. Here a
record is first decoded with those parts left as their stored bytes (`msgspec.Raw`), and a
set of parts is decoded (and validated) only the first time its bytes are seen; after that
they are the pooled copies, which `share_spec` recognises without an encode. Equal bytes are
equal values, the rule the pools already rely on.

The result equals what `record_decoder` gives, and validation is as strict: each part is
decoded with its field's own type, the rest of the spec with the spec's own field types, and
the spec built with its checks. A record this path refuses is decoded again the plain way,
so a corrupt record fails with the plain decoder's own error. One the plain way takes after
this path refused it would be a fault of this path that shows only as slowness, so each is
counted (`plain_decodes`), and the mirror says so when it reads any (broker/store.py).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import msgspec

from broker.core.records import JobRecord, record_decoder
from broker.core.sharing import POOL_LIMIT, SHARE_PART, is_shared
from schemas.job import JobSpec

_astuple = msgspec.structs.astuple
# What an absent part's bytes are: 0xc1 begins no msgpack value, so the parts' bytes joined
# end to end (each a whole value or this byte) name one set of parts only.
ABSENT = b"\xc1"


def _fields(
    fields: Iterable[msgspec.structs.FieldInfo], stored: frozenset[str]
) -> list[tuple[Any, ...]]:
    """Fields as `defstruct` takes them; those in `stored` kept as their bytes (`ABSENT`
    when absent)."""
    out: list[tuple[Any, ...]] = []
    for f in fields:
        if f.encode_name != f.name:  # no renamed field in these structs
            raise TypeError(f"field {f.name} is renamed: decode it another way")
        if f.name in stored:
            out.append((f.name, msgspec.Raw, msgspec.Raw(ABSENT)))
        elif f.default is not msgspec.NODEFAULT:
            out.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            out.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            out.append((f.name, f.type))
    return out


def _config(cls: type[msgspec.Struct]) -> dict[str, Any]:
    c = cls.__struct_config__
    return {"omit_defaults": c.omit_defaults, "forbid_unknown_fields": c.forbid_unknown_fields}


def _part_decoder(field: msgspec.structs.FieldInfo) -> Any:
    """Decodes one stored part with its field's type (constraints included); absent, it is
    the field's default."""
    decode = msgspec.msgpack.Decoder(field.type).decode
    factory, default = field.default_factory, field.default

    def part(stored: bytes) -> Any:
        if stored != ABSENT:
            return decode(stored)
        return factory() if factory is not msgspec.NODEFAULT else default

    return part


class StoredRecordDecoder:
    """Decodes stored job records as `record_decoder` does, sharing the spec parts
    (`SHARE_PART`) and decoding each distinct set of them once. What it remembers is bounded
    (`sharing.POOL_LIMIT` sets), and holds only pooled parts."""

    def __init__(self) -> None:
        parts = frozenset(SHARE_PART)
        spec_fields = msgspec.structs.fields(JobSpec)
        # The stored spec lists its own fields first, then the shared parts' bytes.
        own = [f for f in spec_fields if f.name not in parts]
        shared = [f for f in spec_fields if f.name in parts]
        stored_spec = msgspec.defstruct(
            "StoredJobSpec",
            [*_fields(own, frozenset()), *_fields(shared, parts)],
            **_config(JobSpec),
        )
        record_fields = [
            (f[0], stored_spec, *f[2:]) if f[0] == "spec" else f
            for f in _fields(msgspec.structs.fields(JobRecord), frozenset())
        ]
        stored_record = msgspec.defstruct("StoredJobRecord", record_fields, **_config(JobRecord))
        self._decode = msgspec.msgpack.Decoder(stored_record).decode
        self._own = len(own)
        self._parts = [(f.name, _part_decoder(f)) for f in shared]
        stored_order = [f.name for f in own + shared]
        self._spec_order = operator.itemgetter(*(stored_order.index(f.name) for f in spec_fields))
        if [f.name for f in msgspec.structs.fields(JobRecord)].index("spec") != 1:
            raise TypeError("JobRecord.spec moved: StoredRecordDecoder.decode assumes it second")
        self._seen: dict[bytes, tuple[Any, ...]] = {}
        # Records this path refused and the plain decoder took: none unless this path is wrong.
        self.plain_decodes = 0

    def decode(self, data: bytes) -> JobRecord:
        try:
            fields = _astuple(self._decode(data))
            spec = _astuple(fields[1])
            key = b"".join(spec[self._own :])
            parts = self._seen.get(key)
            if parts is None:
                parts = self._first(key, spec[self._own :])
            return JobRecord(
                fields[0], JobSpec(*self._spec_order(spec[: self._own] + parts)), *fields[2:]
            )
        except Exception:
            # Refused the plain way, with the plain decoder's own error (or, should this
            # path alone have refused it, decoded and counted).
            record = record_decoder.decode(data)
            self.plain_decodes += 1
            return record

    def _first(self, key: bytes, stored: tuple[msgspec.Raw, ...]) -> tuple[Any, ...]:
        """The shared parts stored as `stored` (`key` joined), decoded and validated (the
        first time seen)."""
        parts = tuple(
            SHARE_PART[name](decode(bytes(raw)))
            for (name, decode), raw in zip(self._parts, stored, strict=True)
        )
        pooled = all(is_shared(name, v) for (name, _), v in zip(self._parts, parts, strict=True))
        if pooled and len(self._seen) < POOL_LIMIT:
            self._seen[key] = parts
        return parts


stored_record_decoder = StoredRecordDecoder()
