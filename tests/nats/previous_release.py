"""The wire messages and agent schema the previous release (0.1.0) wrote, kept as fixtures so
tests can show this release still reads them."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

PREVIOUS = Path(__file__).parent / "fixtures" / "release-0.1.0"


def previous_messages() -> dict[str, bytes]:
    raw = json.loads((PREVIOUS / "messages.json").read_text())
    return {name: base64.b64decode(value) for name, value in raw.items()}


def previous_schema(name: str) -> dict[str, Any]:
    return json.loads((PREVIOUS / "agent-schema.json").read_text())[name]  # type: ignore[no-any-return]
