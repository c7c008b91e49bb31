"""Read-only views of the kube backend's parts, for tests, benchmarks and diagnostics: what the
node watch, the attempts and the foreign usage hold, as copies, so a reader can neither edit
the parts' state nor come to depend on how they store it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from agents.kube.attempts import Attempts
from agents.kube.nodewatch import NodeSignals, NodeWatch
from agents.kube.usage import ForeignUsage


class KubeViews:
    """Mixed into `KubeBackend`, whose parts these read."""

    node_watch: NodeWatch
    attempts: Attempts
    usage: ForeignUsage
    _background: set[asyncio.Task[Any]]

    def node_signals(self) -> Mapping[str, NodeSignals]:
        """Each node of a configured flavor or once reported: its latest judged signals."""
        return self.node_watch.node_signals()

    def attempt_pods(self, job_id: str, attempt: int) -> Mapping[str, str]:
        """The pods seen of one attempt: pod uid -> pod name."""
        return MappingProxyType(dict(self.attempts.pod_names.get((job_id, attempt), {})))

    def attempt_objects(self, job_id: str, attempt: int) -> tuple[tuple[str, str], ...]:
        """The objects created or seen for one attempt: (collection path, name)."""
        w = self.attempts.workloads.get((job_id, attempt))
        return tuple(w.objects) if w is not None else ()

    @property
    def foreign_pod_count(self) -> int:
        """Pods not of a running attempt that hold usage on some node."""
        return len(self.usage.pods)

    @property
    def background_work(self) -> int:
        """Background tasks still running (node checks, releases of finished pods)."""
        return len(self._background)
