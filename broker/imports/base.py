"""What the importers of Kubernetes config objects share: the tables they fill, the error
they raise, quantities, and the helpers every source system's importer uses.

Each source system has its importer in this package (`kueue.py`, `volcano.py`, `elastic.py`);
`broker.imports.Importer` hands each object to the one that reads its kind, and broker/config.py
merges what they collected into the Muster config.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.quantity import QuantityError, cpu_milli, memory_bytes, parse_quantity

# The flavor class that Volcano and Koordinator quotas (which know no flavors) are written
# against: it has no capacity or GPU type, so every cluster flavor matches it.
ANY_FLAVOR = "any"

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class ConfigError(ValueError):
    """An invalid config file: the text names the file, the field path and the fix."""


# A name -> (the Muster entry, where it came from) table: flavors, queues, cohorts.
Table = dict[str, tuple[dict[str, Any], str]]


@dataclass
class Imported:
    """What the importers collected: flavor classes, queues, cohorts, aliases, priority
    classes, and a note for everything an import ignored or assumed."""

    flavors: Table = field(default_factory=dict)
    queues: Table = field(default_factory=dict)
    cohorts: Table = field(default_factory=dict)
    aliases: dict[str, tuple[str, str]] = field(default_factory=dict)
    priority_classes: dict[str, tuple[int, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    needs_any_flavor: bool = False


class SourceImporter:
    """The importer of one source system's objects, writing into the shared `Imported`."""

    def __init__(self, out: Imported) -> None:
        self.out = out

    def finish(self) -> None:
        """Called once every object was added: settle what depended on the others."""

    def _unknown(self, spec: Any, known: Iterable[str], ctx: str, where: str) -> None:
        """A note for every field Muster does not read, so none is dropped silently."""
        if not isinstance(spec, Mapping):
            return
        known = set(known)
        for key in spec:
            if str(key) not in known:
                self.out.notes.append(f"{ctx}: {where}.{key} ignored (Muster does not read it)")

    def _resources(self, value: Any, where: str) -> dict[str, int]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping like {{cpu: '64', memory: '256Gi'}}")
        out: dict[str, int] = {}
        for key, amount in value.items():
            ours = kube_resource(str(key))
            if ours is None:
                self.out.notes.append(
                    f"{where}: resource {key!r} ignored (Muster counts gpu, cpu and memory)"
                )
                continue
            out[ours] = out.get(ours, 0) + resource_amount(ours, amount, f"{where}[{key}]")
        return out

    @staticmethod
    def _label(value: Any, where: str) -> str:
        if not isinstance(value, str) or not DNS_LABEL.match(value) or len(value) > 63:
            raise ConfigError(
                f"{where}: {value!r} is not a valid name; use a DNS label (lower-case letters, "
                "digits and '-')"
            )
        return value

    @staticmethod
    def _put(
        table: dict[str, tuple[dict[str, Any], str]],
        name: str,
        value: dict[str, Any],
        ctx: str,
        what: str,
    ) -> None:
        if name in table:
            raise ConfigError(
                f"{ctx}: a {what} named {name!r} is already defined by {table[name][1]}; "
                "names must be unique across imported files"
            )
        table[name] = (value, ctx)


class DeferredImporter(SourceImporter):
    """An importer whose objects wait in `pending` until `finish`: whether one is a leaf (a
    queue) or a parent (a cohort) depends on the other objects of the import."""

    def __init__(self, out: Imported) -> None:
        super().__init__(out)
        self.pending: dict[str, Pending] = {}


@dataclass
class Pending:
    """A Volcano queue or an ElasticQuota until the import knows whether it is a parent."""

    name: str
    ctx: str
    parent: str | None
    low: dict[str, int]  # deserved / min
    high: dict[str, int]  # capability / max
    keep: dict[str, int]  # guarantee
    weight: float
    reclaimable: bool
    hierarchy: list[tuple[str, float]] | None
    is_parent: bool = False
    lends: bool = True
    policy: str = "Priority"


def resource_amount(resource: str, value: Any, where: str) -> int:
    """cpu -> millicores, memory -> bytes, gpu -> devices; Kubernetes quantity semantics."""
    if value is None:
        raise ConfigError(f"{where}: missing amount; write e.g. 8, '64' or '256Gi'")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: expected a quantity like 8, '64' or '256Gi', got {value!r}")
    try:
        if resource == "cpu":
            return cpu_milli(value)
        if resource == "memory":
            return memory_bytes(value)
        amount = parse_quantity(value)
    except QuantityError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if amount != amount.to_integral_value():
        raise ConfigError(f"{where}: {value!r} is not a whole number of GPUs; write e.g. 8")
    return int(amount)


def amount_text(resource: str, amount: int) -> str:
    if resource == "cpu":
        return f"{amount / 1000:g} cores"
    if resource == "memory":
        return str(memory_text(amount))
    return str(amount)


def kube_resource(name: str) -> str | None:
    if name in ("cpu", "memory"):
        return name
    if name.endswith("/gpu"):
        return "gpu"
    return None


def memory_text(n: int) -> str | int:
    for suffix, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return n
