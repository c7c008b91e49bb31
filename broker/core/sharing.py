"""One resident copy of what many jobs hold alike.

At 100,000 pending jobs most of a job's resident bytes were equal copies: every decoded spec
held its own default spot and restart policies, its own empty workload (with empty lists and
dicts), its own gang list, its own "any"; every cached scheduling request its own empty
frozensets. Equal values are shared here, by value, once a job is registered. Nothing in the
broker changes a spec, a podset or a request in place (it replaces them), so sharing is not
observable but in memory (docs/benchmarks.md "Broker memory" has the figures).

Each pool keeps at most `POOL_LIMIT` distinct values; past that, new values stay each job's
own, so memory stays bounded whatever is submitted.
"""

from __future__ import annotations

import sys
from typing import Any, Generic, TypeVar

import msgspec

from schemas.job import JobSpec

K = TypeVar("K")
V = TypeVar("V")

POOL_LIMIT = 4096

_encode = msgspec.msgpack.Encoder().encode


class Pool(Generic[K, V]):
    """Values by key: the first one seen is the one every later equal value becomes."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: dict[K, V] = {}

    def share(self, key: K, value: V) -> V:
        have = self._values.get(key)
        if have is not None:
            return have
        if len(self._values) < POOL_LIMIT:
            self._values[key] = value
        return value

    def __len__(self) -> int:
        return len(self._values)


EMPTY: frozenset[Any] = frozenset()

_structs: Pool[tuple[str, bytes], Any] = Pool()
_sets: Pool[frozenset[Any], frozenset[Any]] = Pool()
_tuples: Pool[tuple[Any, ...], tuple[Any, ...]] = Pool()
_no_labels: dict[str, str] = {}
_no_types: list[str] = []


def shared(name: str, value: V) -> V:
    """The pooled copy of a spec part (a Struct, or a list or dict of them), keyed by its
    encoding: equal encodings are equal values."""
    return _structs.share((name, _encode(value)), value)  # type: ignore[no-any-return]


def frozen(items: frozenset[V]) -> frozenset[V]:
    """The pooled copy of a small set (GPU types, elastic podsets); the empty one is shared."""
    if not items:
        return EMPTY
    return _sets.share(items, items)


def interned_tuple(value: tuple[V, ...]) -> tuple[V, ...]:
    """The pooled copy of a hashable tuple (a job's gang demands)."""
    return _tuples.share(value, value)


class ByIdentity(Generic[K, V]):
    """What was derived from a value, by the value's identity: for values shared by
    `shared`, which many jobs hold as one object, the derivation runs once for them all. Each
    entry keeps its value alive (so its id cannot be reused), at most `POOL_LIMIT` of them."""

    __slots__ = ("_derived",)

    def __init__(self) -> None:
        self._derived: dict[int, tuple[K, V]] = {}

    def get(self, value: K) -> V | None:
        hit = self._derived.get(id(value))
        return hit[1] if hit is not None and hit[0] is value else None

    def put(self, value: K, derived: V) -> V:
        if len(self._derived) < POOL_LIMIT:
            self._derived[id(value)] = (value, derived)
        return derived


def share_spec(spec: JobSpec) -> None:
    """Replace the parts of `spec` that other jobs hold alike with the shared copies. What is
    each job's own (its id, its checkpoint URI, a submitted manifest) stays as it is."""
    spec.name = sys.intern(spec.name)
    spec.capacity = sys.intern(spec.capacity)  # type: ignore[assignment]
    if spec.queue is not None:
        spec.queue = sys.intern(spec.queue)
    spec.gang = shared("gang", spec.gang)
    spec.spot = shared("spot", spec.spot)
    spec.restart = shared("restart", spec.restart)
    if spec.workload.manifest is None:
        spec.workload = shared("workload", spec.workload)
    spec.labels = shared("labels", spec.labels) if spec.labels else _no_labels
    spec.gpu_types = shared("gpu_types", spec.gpu_types) if spec.gpu_types else _no_types
    if spec.topology is not None:
        spec.topology = shared("topology", spec.topology)
