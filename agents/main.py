"""`python -m agents.main`: the same command as `muster agent` (the fleet itself is in
`agents.fleet`)."""

from __future__ import annotations

import sys

from agents.cli import agent
from shell.cli import CONNECTION, common, invoke


def main(argv: list[str] | None = None) -> int:
    return invoke(agent, argv, "python -m agents.main", cls=common(*CONNECTION))


if __name__ == "__main__":
    sys.exit(main())
