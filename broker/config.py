"""The broker's YAML config: loading, merging the imported Kueue / Volcano / Koordinator
objects users already write (their importers are in broker/imports/), and printing it back.

A config file is YAML with one or more documents:

- at most one Muster document (a mapping without `apiVersion`/`kind`) holding the fields of
  `schemas.config.BrokerConfig`, plus two loader-only keys:
  `import: [kueue.yaml, volcano-queues.yaml]` (paths relative to the config file; those files
  hold Kubernetes objects only) and `queue_aliases: {local-name: queue}`;
- any number of Kubernetes documents (they have `apiVersion` and `kind`), imported as if they
  had been listed under `import`: Kueue ResourceFlavor / ClusterQueue / LocalQueue / Cohort,
  Volcano Queue, ElasticQuota of Koordinator or scheduler-plugins. A `kind: List` is unpacked.

Imports mean what the source system means (the field-by-field table is docs/compat.md):
parent quotas and parent queues become cohorts, an imported Kueue ClusterQueue admits only the
resources it lists, and every field Muster does not honour yields a note naming it.

Merging: imported flavors and queues come first; an entry of the Muster document with the same
name replaces the imported one, so a Muster file can override one imported queue. Two imports
defining the same name is an error. If nothing defines queues, the default `default` queue
stays.

Units: in YAML, quota `cpu` is a Kubernetes quantity in cores ("64", 64, "500m") and `memory`
one in bytes ("256Gi", 1073741824); both are normalised to millicores and bytes before
validation, as `BrokerConfig` stores them. `gpu` is a whole number of devices.

Every error is a ConfigError naming the file, the document, the field path and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from broker.imports import Importer
from broker.imports.base import (
    ANY_FLAVOR,
    DNS_LABEL,
    ConfigError,
    Imported,
    memory_text,
    resource_amount,
)
from broker.manifests import is_manifest
from schemas.codec import DecodeError, convert_config, every_field
from schemas.config import BrokerConfig
from schemas.fieldhints import explain

__all__ = [
    "ANY_FLAVOR",
    "ConfigError",
    "LoadedConfig",
    "config_to_yaml",
    "from_elastic_quota",
    "from_kueue",
    "from_volcano",
    "import_documents",
    "kueue_aliases",
    "load_config",
    "load_config_full",
    "parse_config",
]

_LOADER_KEYS = ("import", "queue_aliases")
_QUOTA_FIELDS = ("nominal", "borrowing_limit", "lending_limit")
_PRIORITY_RANGE = 1_000_000  # a job's priority lies within +-this (schemas.job.JobSpec)


@dataclass
class LoadedConfig:
    """A config with what the loader learnt beside it.

    `aliases` maps a Kueue LocalQueue name (or a `queue_aliases` entry) to the queue it feeds;
    BrokerConfig has no field for it yet. `notes` lists what an import ignored or assumed.
    """

    config: BrokerConfig
    aliases: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


# -- public API --------------------------------------------------------------------------


def load_config(path: str | Path | None) -> BrokerConfig:
    """Load the broker config from a YAML file; None gives the defaults."""
    return load_config_full(path).config


def load_config_full(path: str | Path | None) -> LoadedConfig:
    """Like load_config, and also return queue aliases and import notes."""
    if path is None:
        return LoadedConfig(BrokerConfig())
    p = Path(path)
    return parse_config(_read(p, str(path)), source=str(path), base_dir=p.parent)


def parse_config(
    text: str, *, source: str = "config", base_dir: Path | None = None
) -> LoadedConfig:
    """Parse config YAML text (see the module docstring for the layout)."""
    docs = _yaml_documents(text, source)
    muster_doc: dict[str, Any] | None = None
    kube_docs: list[tuple[str, int, Mapping[str, Any]]] = []
    for index, doc in enumerate(docs, start=1):
        if is_manifest(doc):
            kube_docs.extend((source, n, d) for n, d in _unpack_list(doc, index))
        elif isinstance(doc, Mapping):
            if muster_doc is not None:
                raise ConfigError(
                    f"{source}: document {index}: a second Muster config document; keep one "
                    "mapping of broker settings per file (Kubernetes objects may follow it)"
                )
            muster_doc = {str(k): v for k, v in doc.items()}
        else:
            raise ConfigError(
                f"{source}: document {index}: expected a mapping of broker settings, "
                f"got {type(doc).__name__}"
            )
    raw = muster_doc or {}
    imports = raw.get("import", [])
    if isinstance(imports, str):
        imports = [imports]
    if not isinstance(imports, list) or not all(isinstance(i, str) for i in imports):
        raise ConfigError(
            f"{source}: import: expected a list of file paths, e.g. import: [kueue.yaml]"
        )
    sources = [source]
    for rel in imports:
        p = Path(rel)
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        sub_docs = _yaml_documents(_read(p, f"{source}: import {rel!r}"), rel)
        for index, doc in enumerate(sub_docs, start=1):
            if not is_manifest(doc):
                raise ConfigError(
                    f"{rel}: document {index}: imported files hold Kubernetes objects only "
                    "(apiVersion and kind); put broker settings in the main config file"
                )
            kube_docs.extend((rel, n, d) for n, d in _unpack_list(doc, index))
        sources.append(rel)

    importer = Importer()
    for src, index, doc in kube_docs:
        importer.add(doc, src, index)
    loaded = _assemble(raw, importer.finish(), source)
    loaded.sources = sources
    return loaded


def import_documents(
    docs: Iterable[Mapping[str, Any]], *, source: str = "documents"
) -> LoadedConfig:
    """Import Kubernetes objects (any mix of the supported kinds) into a config."""
    importer = Importer()
    for index, doc in enumerate(docs, start=1):
        for n, d in _unpack_list(doc, index):
            importer.add(d, source, n)
    return _assemble({}, importer.finish(), source)


def from_kueue(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """Kueue ResourceFlavor -> FlavorClass, ClusterQueue -> QueueConfig, LocalQueue -> an
    entry of `queue_aliases`."""
    return import_documents(_only(docs, "kueue.x-k8s.io", "Kueue"), source="Kueue objects").config


def kueue_aliases(docs: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """LocalQueue name -> ClusterQueue name, for the LocalQueues in `docs`."""
    return import_documents(_only(docs, "kueue.x-k8s.io", "Kueue"), source="Kueue objects").aliases


def from_volcano(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """Volcano Queue: weight -> weight, capability -> nominal quota with no borrowing (on the
    flavor class `any`), reclaimable -> reclaimable."""
    return import_documents(
        _only(docs, "scheduling.volcano.sh", "Volcano"), source="Volcano objects"
    ).config


def from_elastic_quota(docs: Iterable[Mapping[str, Any]]) -> BrokerConfig:
    """ElasticQuota of Koordinator (scheduling.sigs.k8s.io) or scheduler-plugins
    (scheduling.x-k8s.io): min -> nominal, max - min -> borrowing limit; a Koordinator parent
    quota becomes a cohort; the top level shares the cohort `elastic-quota`."""
    return import_documents(
        _only(docs, ("scheduling.sigs.k8s.io", "scheduling.x-k8s.io"), "ElasticQuota"),
        source="ElasticQuota objects",
    ).config


# -- reading -----------------------------------------------------------------------------


def _read(path: Path, label: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{label}: file not found ({path}); check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{label}: cannot read {path}: {exc}") from None


def _yaml_documents(text: str, source: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def _unpack_list(doc: Any, index: int) -> list[tuple[int, Mapping[str, Any]]]:
    if isinstance(doc, Mapping) and doc.get("kind") == "List":
        items = doc.get("items") or []
        return [(index, d) for d in items if isinstance(d, Mapping)]
    return [(index, doc)]


def _only(
    docs: Iterable[Mapping[str, Any]], group: str | tuple[str, ...], what: str
) -> list[Mapping[str, Any]]:
    groups = (group,) if isinstance(group, str) else group
    out = []
    for i, doc in enumerate(docs, start=1):
        if not is_manifest(doc) or str(doc["apiVersion"]).rpartition("/")[0] not in groups:
            kind = doc.get("kind") if isinstance(doc, Mapping) else type(doc).__name__
            raise ConfigError(
                f"document {i} ({kind}): not a {what} object (apiVersion {groups[0]}/...); "
                "use import_documents for a mix of kinds"
            )
        out.append(doc)
    return out


# -- quantities --------------------------------------------------------------------------


def _normalise_quotas(raw: dict[str, Any], source: str) -> None:
    """Turn the quantities of a Muster document's quotas into integers, in place."""
    for key in ("queues", "cohorts"):
        entries = raw.get(key)
        if isinstance(entries, list):
            _normalise_entries(entries, f"{source}: {key}")


def _normalise_entries(entries: list[Any], where: str) -> None:
    for qi, queue in enumerate(entries):
        if not isinstance(queue, Mapping) or not isinstance(queue.get("quotas"), list):
            continue
        for fi, fq in enumerate(queue["quotas"]):
            if not isinstance(fq, Mapping) or not isinstance(fq.get("resources"), Mapping):
                continue
            base = f"{where}[{qi}].quotas[{fi}].resources"
            for res, rq in fq["resources"].items():
                if res not in ("gpu", "cpu", "memory"):
                    hint = (
                        " (Kubernetes' nvidia.com/gpu is `gpu` here)" if "gpu" in str(res) else ""
                    )
                    raise ConfigError(
                        f"{base}.{res}: unknown resource; use gpu, cpu or memory{hint}"
                    )
                if not isinstance(rq, dict):
                    if isinstance(rq, str | int | float) and not isinstance(rq, bool):
                        raise ConfigError(
                            f"{base}.{res}: expected a mapping like {{nominal: {rq!r}}}, "
                            f"got the bare amount {rq!r}"
                        )
                    continue
                for key in _QUOTA_FIELDS:
                    if rq.get(key) is not None:
                        rq[key] = resource_amount(res, rq[key], f"{base}.{res}.{key}")


# -- assembling --------------------------------------------------------------------------


def _assemble(raw: dict[str, Any], imported: Imported, source: str) -> LoadedConfig:
    raw = dict(raw)
    aliases_raw = raw.pop("queue_aliases", None) or {}
    raw.pop("import", None)
    if not isinstance(aliases_raw, Mapping):
        raise ConfigError(f"{source}: queue_aliases: expected a mapping of alias: queue")
    _normalise_quotas(raw, source)

    def merged(key: str, imported: dict[str, tuple[dict[str, Any], str]]) -> None:
        own = raw.get(key)
        if own is not None and not isinstance(own, list):
            raise ConfigError(f"{source}: {key}: expected a list, got {type(own).__name__}")
        if not imported:
            return
        own_names = {e.get("name") for e in own or [] if isinstance(e, Mapping)}
        raw[key] = [v for n, (v, _) in imported.items() if n not in own_names] + list(own or [])

    flavors = dict(imported.flavors)
    if imported.needs_any_flavor and ANY_FLAVOR not in flavors:
        own = raw.get("flavors")
        if not (
            isinstance(own, list)
            and any(isinstance(f, Mapping) and f.get("name") == ANY_FLAVOR for f in own)
        ):
            flavors[ANY_FLAVOR] = ({"name": ANY_FLAVOR}, "imports")
    merged("flavors", flavors)
    merged("queues", imported.queues)
    merged("cohorts", imported.cohorts)
    _merge_priority_classes(raw, imported.priority_classes, source)

    try:
        config = convert_config(raw)
    except DecodeError as exc:
        raise ConfigError(f"{source}: {_explain(str(exc))}") from None

    aliases = {name: target for name, (target, _) in imported.aliases.items()}
    queue_names = {q.name for q in config.queues}
    for name, (target, ctx) in imported.aliases.items():
        if name in queue_names and name != target:
            # A Volcano queue and a Kueue LocalQueue of one name (two systems describing the
            # same team): the queue keeps the name, as a job naming it reaches a queue either
            # way; the ClusterQueue stays reachable by its own name.
            del aliases[name]
            imported.notes.append(
                f"{ctx}: LocalQueue {name!r} has the name of the queue imported from another "
                f"object; jobs naming {name!r} go to that queue, and ClusterQueue {target!r} is "
                f"reached by its own name (or give it another alias under queue_aliases)"
            )
    for alias, target in aliases_raw.items():
        aliases[str(alias)] = str(target)
    _check_references(config, aliases, source)
    config = msgspec.structs.replace(config, queue_aliases=aliases)
    return LoadedConfig(config=config, aliases=aliases, notes=list(imported.notes))


def _merge_priority_classes(
    raw: dict[str, Any], imported: Mapping[str, tuple[int, str]], source: str
) -> None:
    """Imported classes under the Muster document's own `priority_classes` (which win)."""
    own = raw.get("priority_classes")
    if own is not None and not isinstance(own, Mapping):
        raise ConfigError(f"{source}: priority_classes: expected a mapping of class name: priority")
    if not imported:
        return
    merged: dict[str, Any] = {}
    for name, (value, ctx) in imported.items():
        if own is not None and name in own:
            continue
        if abs(value) > _PRIORITY_RANGE:
            raise ConfigError(
                f"{ctx}: value {value} is outside Muster's job priorities "
                f"(-{_PRIORITY_RANGE:,} to {_PRIORITY_RANGE:,}); map the class in the Muster "
                f"document, e.g. `priority_classes: {{{name}: 1000}}`"
            )
        merged[name] = value
    raw["priority_classes"] = {**merged, **(own or {})}


def _check_references(config: BrokerConfig, aliases: Mapping[str, str], source: str) -> None:
    queue_names = {q.name for q in config.queues}
    flavor_names = {f.name for f in config.flavors}
    if config.flavors:
        owners = [("queues", q.quotas or []) for q in config.queues]
        owners += [("cohorts", c.quotas) for c in config.cohorts]
        seen: dict[str, int] = {}
        for key, quotas in owners:
            qi = seen[key] = seen.get(key, -1) + 1
            for fi, fq in enumerate(quotas):
                if fq.flavor not in flavor_names:
                    close = difflib.get_close_matches(fq.flavor, sorted(flavor_names), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ConfigError(
                        f"{source}: {key}[{qi}].quotas[{fi}].flavor: {fq.flavor!r} is not a "
                        f"declared flavor class{hint}; add it under flavors: or fix the name"
                    )
    names = [f.name for f in config.flavors]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{source}: flavors: {name!r} is declared twice; keep one")
    for alias, target in aliases.items():
        if not DNS_LABEL.match(alias) or len(alias) > 63:
            raise ConfigError(f"{source}: queue_aliases: {alias!r} is not a valid queue name")
        if target not in queue_names:
            raise ConfigError(
                f"{source}: queue alias {alias!r} points at {target!r}, which is not a queue; "
                f"known queues: {sorted(queue_names)}"
            )
        if alias in queue_names:
            raise ConfigError(
                f"{source}: queue alias {alias!r} has the name of a queue; rename the alias"
            )


def _explain(message: str) -> str:
    """Turn msgspec's "... - at `$.queues[0].quota`" into "queues[0].quota: ...", with a
    spelling hint for unknown fields."""
    return explain(message.removeprefix("invalid broker config: "), BrokerConfig)


def config_to_yaml(config: BrokerConfig, aliases: Mapping[str, str] | None = None) -> str:
    """The config as Muster YAML (cpu in millicores written as quantities), for `muster
    config`."""
    # Every setting, defaults included: what the broker will do is what it prints (a queue's
    # preemption policies, say, whose defaults differ from Kueue's).
    data = every_field(config, drop_none=True)
    for queue in [*data.get("queues", []), *data.get("cohorts", [])]:
        for fq in queue.get("quotas") or []:
            for res, rq in fq.get("resources", {}).items():
                for key in _QUOTA_FIELDS:
                    if key in rq and res == "cpu":
                        milli = rq[key]
                        rq[key] = str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
                    elif key in rq and res == "memory":
                        rq[key] = memory_text(rq[key])
    data = {k: v for k, v in data.items() if v != {}}
    if aliases:
        data["queue_aliases"] = dict(aliases)
    return yaml.safe_dump(data, sort_keys=False)
