"""Kueue's Topology Aware Scheduling annotations on a pod template, as a podset's topology.

Kueue reads `kueue.x-k8s.io/podset-required-topology` and `podset-preferred-topology` from
`template.metadata.annotations` (values: a node label that is a level of the flavor's
`Topology`; kubernetes-sigs/kueue site/content/en/docs/concepts/topology_aware_scheduling.md,
Apache-2.0). Muster keeps the label as the level name: the broker matches it against each
pool's declared levels (broker/core/topology.py). `podset-unconstrained-topology` asks for no
level, which is Muster's default apart from staying within one zone.

The kinds' own topology fields map onto the same levels:
- Volcano Job `spec.networkTopology` (volcano-sh/apis pkg/apis/batch/v1alpha1/job.go,
  Apache-2.0): `mode: hard` (the CRD's default) is `required`, `soft` is `preferred`;
  `highestTierAllowed: N` is the level `tier-N` (HyperNode tiers count from the switches
  nearest the nodes; broker/core/topology.py resolves it against each pool's levels), 1 when
  unset as the CRD defaults it; `highestTierName` names a level directly.
- JobSet `alpha.jobset.sigs.k8s.io/exclusive-topology` (kubernetes-sigs/jobset
  api/jobset/v1alpha2/jobset_types.go, Apache-2.0) on the JobSet or on a replicatedJob's
  `template.metadata.annotations`: each child Job gets a domain of that label to itself. One
  child Job is one domain, so it is `required`; several child Jobs may not all fit one domain
  (JobSet spreads them one per domain), so it is `preferred`: the gang is kept in the
  tightest domain that fits. That no other job shares the domain is not enforced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kinds.base import KindError

JOBSET_EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
REQUIRED = "kueue.x-k8s.io/podset-required-topology"
PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def _level(value: Any, path: str) -> str:
    text = str(value).strip()
    if not _LABEL_KEY.match(text) or len(text) > 317:
        raise KindError(
            f"{path}: {text!r} is not a node label key; name a topology level such as "
            "cloud.google.com/gce-topology-block"
        )
    return text


def volcano_topology(spec: Mapping[str, Any]) -> dict[str, str]:
    """A Volcano Job's `spec.networkTopology` as the gang's topology fields (`{}` if unset)."""
    raw = spec.get("networkTopology")
    if raw is None:
        return {}
    at = "spec.networkTopology"
    if not isinstance(raw, Mapping):
        raise KindError(f"{at}: expected a mapping with mode and highestTierAllowed")
    mode = raw.get("mode") or "hard"
    if mode not in ("hard", "soft"):
        raise KindError(f"{at}.mode: {mode!r} is neither hard nor soft; write one of them")
    tier, name = raw.get("highestTierAllowed"), raw.get("highestTierName")
    if tier is not None and name:
        raise KindError(
            f"{at}: highestTierAllowed and highestTierName are both set; keep one of them"
        )
    if name:
        level = _level(name, f"{at}.highestTierName")
    else:
        tier = 1 if tier is None else tier
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 1:
            raise KindError(
                f"{at}.highestTierAllowed: {tier!r} is not a tier; tiers count from 1 (the "
                "switches nearest the nodes), e.g. highestTierAllowed: 2"
            )
        level = f"tier-{tier}"
    return {"required" if mode == "hard" else "preferred": level}


def exclusive_topology(annotations: Any, child_jobs: int, path: str) -> dict[str, str]:
    """A JobSet's exclusive-topology annotation as topology fields (`{}` if absent), for a
    scope of `child_jobs` child Jobs (see the module docstring)."""
    if not isinstance(annotations, Mapping) or annotations.get(JOBSET_EXCLUSIVE) is None:
        return {}
    level = _level(annotations[JOBSET_EXCLUSIVE], f"{path}[{JOBSET_EXCLUSIVE}]")
    return {"required" if child_jobs == 1 else "preferred": level}


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
        out[field] = _level(value, f"{path}.template.metadata.annotations[{key}]")
    return {"topology": out} if out else {}
