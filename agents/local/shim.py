"""The parent of one replica: records its exit code and enforces its fence.

`python -m agents.local.shim --exit-file F --fence-file G -- command args...`

Why a shim: the agent may die and come back while replicas run. A restarted agent is not the
replicas' parent, so it could not learn their exit codes; the shim writes the code to a file.
And a dead agent cannot stop its replicas when the broker gives up on it and starts the job
elsewhere: the shim kills its process group once the deadline in the fence file (unix seconds,
extended by the agent while it is healthy) has passed. The shim runs in the replica's own
session, so the agent's SIGTERM/SIGKILL to the group reaches the command directly; the shim
ignores SIGTERM itself so it outlives the command and can record how it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

POLL_S = 0.1
EXIT_NOT_FOUND = 127  # what a shell reports for a command it cannot find
EXIT_NOT_RUNNABLE = 126


def write_json(path: Path, value: object) -> None:
    """Atomic (temp file + rename): a reader never sees half a value."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read_deadline(path: Path) -> float:
    """The fence deadline in unix seconds; 0 (no fence) when the file is missing or torn."""
    try:
        return float(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def _ignore(signum: int, frame: FrameType | None) -> None:
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="muster-local-shim")
    parser.add_argument("--exit-file", required=True, type=Path)
    parser.add_argument("--fence-file", required=True, type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    # A Python-level handler (not SIG_IGN) so the command starts with the default action.
    signal.signal(signal.SIGTERM, _ignore)
    try:
        child = subprocess.Popen(command)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"muster: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
        write_json(args.exit_file, {"code": EXIT_NOT_FOUND})
        return EXIT_NOT_FOUND
    except (PermissionError, OSError) as exc:
        print(f"muster: cannot run {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        write_json(args.exit_file, {"code": EXIT_NOT_RUNNABLE})
        return EXIT_NOT_RUNNABLE
    while True:
        try:
            code = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        deadline = read_deadline(args.fence_file)
        if deadline and time.time() > deadline:
            print("muster: fence lapsed (agent gone); killing the replica", file=sys.stderr)
            write_json(args.exit_file, {"code": -signal.SIGKILL, "fenced": True})
            os.killpg(os.getpgid(0), signal.SIGKILL)
    write_json(args.exit_file, {"code": code})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
