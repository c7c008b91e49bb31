"""Readable msgspec validation errors: `path: what`, with "did you mean" for unknown fields.

Shared by every loader of user-written YAML (broker config, job files) so a typo gets the same
answer everywhere.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec


def explain(message: str, root: Any) -> str:
    """msgspec's "... - at `$.a[0].b`" as "a[0].b: ...", hinting the closest field name when the
    error is an unknown field of a Struct inside `root` (a Struct type)."""
    match = re.match(r"^(.*) - at `\$\.?(.*)`$", message, re.DOTALL)
    if match is None:
        what, where = message, ""
    else:
        what, where = match.groups()
    unknown = re.match(r"Object contains unknown field `(.*)`$", what)
    if unknown:
        known = fields_at(root, where)
        close = difflib.get_close_matches(unknown.group(1), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        what = f"unknown field {unknown.group(1)!r}; {hint}known fields: {', '.join(known)}"
        where = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
    elif what.startswith("Invalid enum value"):
        values = enum_values(root, where)
        if values:
            what = f"{what}; valid values: {', '.join(values)}"
    where = where.replace("[...]", "")
    return f"{where}: {what}" if where else what


def fields_at(root: Any, path: str) -> list[str]:
    """Field names of the Struct at a msgspec error path inside `root`."""
    info = _unwrap(_walk(root, path))
    if isinstance(info, msgspec.inspect.StructType):
        return [f.encode_name for f in info.fields]
    return []


def enum_values(root: Any, path: str) -> list[str]:
    """The values a Literal or Enum field at `path` inside `root` accepts ([] if neither)."""
    info = _walk(root, path)
    while isinstance(info, msgspec.inspect.Metadata | msgspec.inspect.UnionType):
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        else:
            kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(kinds) != 1:
                break
            info = kinds[0]
    if isinstance(info, msgspec.inspect.LiteralType):
        return [str(v) for v in info.values]
    if isinstance(info, msgspec.inspect.EnumType):
        return [str(m.value) for m in info.cls]
    return []


def _walk(root: Any, path: str) -> Any:
    """The type info at a msgspec error path (`a[0].b`) inside `root`; None if lost."""
    info: Any = msgspec.inspect.type_info(root)
    for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*|\[[^\]]*\]", path):
        info = _unwrap(info)
        if token.startswith("["):
            if isinstance(info, msgspec.inspect.ListType):
                info = info.item_type
            elif isinstance(info, msgspec.inspect.DictType):
                info = info.value_type
            continue
        if isinstance(info, msgspec.inspect.StructType):
            match = [f for f in info.fields if f.encode_name == token]
            if not match:
                return None
            info = match[0].type
    return info


def _unwrap(info: Any) -> Any:
    while True:
        if isinstance(info, msgspec.inspect.UnionType):
            inner = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(inner) != 1:
                return info
            info = inner[0]
        elif isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        else:
            return info
