"""One adapter per job kind, shared by the broker (deriving gangs) and the agent (writing,
watching and judging the objects). Imports only `schemas`. See docs/kinds.md."""

from kinds.adapter import Adapter
from kinds.base import KindError, PodTemplate, Resource, Verdict
from kinds.registry import (
    ADAPTERS,
    OWNED_RESOURCES,
    STATUS_RESOURCES,
    adapter_for,
    adapter_of,
    known_kinds,
)

__all__ = [
    "ADAPTERS",
    "OWNED_RESOURCES",
    "STATUS_RESOURCES",
    "Adapter",
    "KindError",
    "PodTemplate",
    "Resource",
    "Verdict",
    "adapter_for",
    "adapter_of",
    "known_kinds",
]
