"""Modules a process may never use, loaded on first use instead of at import.

nats-py imports aiohttp (0.1-0.2 s of a broker's start) only for WebSocket URLs (`ws://`,
`wss://`): deferred, a broker on `nats://` never loads it and one on `ws://` loads it when its
transport is made, exactly as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

DEFERRED = ("aiohttp",)


class _Deferred(ModuleType):
    """Stands in sys.modules for a module not yet run; the first attribute it lacks runs the
    real one (an `import` of it again only reads `__spec__`, which is already here)."""

    def __getattr__(self, attr: str) -> Any:
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        real = importlib.import_module(name)
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


def defer_import(name: str) -> None:
    """Put a stand-in for `name` in sys.modules. A module already imported, or not installed,
    is left as it is (an `import` of a missing one still fails where it is written)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    stand_in = _Deferred(name)
    stand_in.__spec__ = spec
    sys.modules[name] = stand_in


def defer_unused() -> None:
    for name in DEFERRED:
        defer_import(name)
