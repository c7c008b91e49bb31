"""Fixture files: YAML from the guides this project started from (see fixtures/README.md)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.cli.live_broker import live  # noqa: F401  (the fixture the end-to-end CLI tests share)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def fixture_docs(name: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(fixture_text(name)) if d is not None]


def fixture(name: str) -> dict[str, Any]:
    (doc,) = fixture_docs(name)
    return copy.deepcopy(doc)
