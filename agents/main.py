"""`python -m agents.main`: the command `muster agent` runs, loaded from the same table
(`agents.cli.app`; the fleet itself is in `agents.fleet`)."""

from __future__ import annotations

import sys

from agents.cli import app
from shell.cli import run_alias


def main(argv: list[str] | None = None) -> int:
    return run_alias(app, "agent", argv, "python -m agents.main")


if __name__ == "__main__":
    sys.exit(main())
