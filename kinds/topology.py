"""Kueue's Topology Aware Scheduling annotations on a pod template, as a podset's topology.

Kueue reads `kueue.x-k8s.io/podset-required-topology` and `podset-preferred-topology` from
`template.metadata.annotations` (values: a node label that is a level of the flavor's
`Topology`; kubernetes-sigs/kueue site/content/en/docs/concepts/topology_aware_scheduling.md,
Apache-2.0). Muster keeps the label as the level name: the broker matches it against each
pool's declared levels (broker/core/topology.py). `podset-unconstrained-topology` asks for no
level, which is Muster's default apart from staying within one zone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kinds.base import KindError

REQUIRED = "kueue.x-k8s.io/podset-required-topology"
PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def podset_topology(template: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`{"topology": {...}}` for a PodSet from the template's TAS annotations, else `{}`
    (spread into the podset's fields). A value that is not a label key is refused."""
    meta = template.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(annotations, Mapping):
        return {}
    out: dict[str, str] = {}
    for key, field in ((REQUIRED, "required"), (PREFERRED, "preferred")):
        value = annotations.get(key)
        if value is None:
            continue
        text = str(value).strip()
        if not _LABEL_KEY.match(text) or len(text) > 317:
            raise KindError(
                f"{path}.template.metadata.annotations[{key}]: {text!r} is not a node label "
                "key; name a topology level such as cloud.google.com/gce-topology-block"
            )
        out[field] = text
    return {"topology": out} if out else {}
