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
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from schemas.job import GangTopology, JobSpec, Workload

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

_sets: Pool[frozenset[Any], frozenset[Any]] = Pool()
_tuples: Pool[tuple[Any, ...], tuple[Any, ...]] = Pool()
_no_labels: dict[str, str] = {}
_no_types: list[str] = []


class PartPool:
    """Spec parts by name and encoding: equal encodings are equal values. It knows its own
    values by identity, so a part that already is the pooled copy costs no encode."""

    __slots__ = ("_values", "held")

    def __init__(self) -> None:
        self._values: dict[tuple[str, bytes], Any] = {}
        # id of each pooled value (kept alive here, so its id is not reused) -> its part
        self.held: dict[int, str] = {id(_no_labels): "labels", id(_no_types): "gpu_types"}

    def share(self, name: str, value: V) -> V:
        if self.held.get(id(value)) == name:
            return value
        key = (name, _encode(value))
        have = self._values.get(key)
        if have is not None:
            return have  # type: ignore[no-any-return]
        if len(self._values) < POOL_LIMIT:
            self._values[key] = value
            self.held[id(value)] = name
        return value

    def holds(self, name: str, value: object) -> bool:
        """Whether `value` is what every job's equal part `name` is (pooled, or none)."""
        return value is None or self.held.get(id(value)) == name

    def __len__(self) -> int:
        return len(self._values)


_parts = PartPool()


def shared(name: str, value: V) -> V:
    """The pooled copy of a spec part (a Struct, or a list or dict of them), keyed by its
    encoding: equal encodings are equal values."""
    return _parts.share(name, value)


def is_shared(name: str, value: object) -> bool:
    """Whether `value`, what `SHARE_PART[name]` returned, is the one copy all jobs hold."""
    return _parts.holds(name, value)


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


def _workload(value: Workload) -> Workload:
    return shared("workload", value) if value.manifest is None else value


def _labels(value: dict[str, str]) -> dict[str, str]:
    return shared("labels", value) if value else _no_labels


def _gpu_types(value: list[str]) -> list[str]:
    return shared("gpu_types", value) if value else _no_types


def _topology(value: GangTopology | None) -> GangTopology | None:
    return shared("topology", value) if value is not None else None


# What becomes of each shareable spec part, by field name: the one rule `share_spec` and a
# decode of stored records (storedrecord.py) follow. A submitted manifest stays each job's own.
SHARE_PART: dict[str, Callable[[Any], Any]] = {
    "gang": lambda value: shared("gang", value),
    "spot": lambda value: shared("spot", value),
    "restart": lambda value: shared("restart", value),
    "workload": _workload,
    "labels": _labels,
    "gpu_types": _gpu_types,
    "topology": _topology,
}


def share_spec(spec: JobSpec) -> None:
    """Replace the parts of `spec` that other jobs hold alike with the shared copies. What is
    each job's own (its id, its checkpoint URI, a submitted manifest) stays as it is."""
    spec.name = sys.intern(spec.name)
    spec.capacity = sys.intern(spec.capacity)  # type: ignore[assignment]
    if spec.queue is not None:
        spec.queue = sys.intern(spec.queue)
    # A restored spec's parts already are the pooled copies (storedrecord.py): known by
    # identity, without a call each. The same rules as SHARE_PART, written out: a loop over
    # that table measured 1.7 us per pooled spec against 0.6-0.9 (0.1 s of a 100,000-job restart).
    held = _parts.held
    if held.get(id(spec.gang)) != "gang":
        spec.gang = shared("gang", spec.gang)
    if held.get(id(spec.spot)) != "spot":
        spec.spot = shared("spot", spec.spot)
    if held.get(id(spec.restart)) != "restart":
        spec.restart = shared("restart", spec.restart)
    if held.get(id(spec.workload)) != "workload":
        spec.workload = _workload(spec.workload)
    if held.get(id(spec.labels)) != "labels":
        spec.labels = _labels(spec.labels)
    if held.get(id(spec.gpu_types)) != "gpu_types":
        spec.gpu_types = _gpu_types(spec.gpu_types)
    if spec.topology is not None:
        spec.topology = shared("topology", spec.topology)
