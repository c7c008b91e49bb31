"""Where a benchmark's processes run: shared cores, or a core of the broker's own.

By default the kernel runs the broker, nats-server and the benchmark (its load generator and,
by default, the fake fleet) on every core, so on a 2-core machine the broker waits behind the
other two for part of every latency it is measured by. A real deployment does not put them on
one node's two cores: the broker's pod requests a CPU of its own (deploy/broker), which the
kubelet makes its cgroup's CPU weight, and under the kubelet's `static` CPU manager policy a
Guaranteed pod with a whole number of CPUs is given cores no other container runs on
(https://kubernetes.io/docs/tasks/administer-cluster/cpu-management-policies/).
`Placement.broker_own_core` stands for that: the broker on the first core, everything else on
the others, by CPU affinity (Linux `sched_setaffinity`, every thread of each process).
`burners` loads the machine instead: busy processes beside all of them.
"""

from __future__ import annotations

import contextlib
import enum
import os
import subprocess
import sys
from collections.abc import Iterator


class Placement(enum.Enum):
    shared = "shared"
    broker_own_core = "broker-own-core"


def cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def pin(pid: int, cpus: set[int]) -> int:
    """Run every thread of `pid` on `cpus` (threads started later inherit it from theirs);
    the threads pinned. A thread that exits meanwhile is skipped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as exc:
        raise RuntimeError(f"process {pid} is gone: {exc}") from None
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            continue
    return pinned


def split() -> tuple[set[int], set[int]]:
    """(the broker's core, every other core) for `broker_own_core`."""
    have = cores()
    if len(have) < 2:
        raise RuntimeError(
            f"--cpus {Placement.broker_own_core.value} needs two cores or more, this process "
            f"may use {len(have)}"
        )
    return {have[0]}, set(have[1:])


# A busy loop that also ends on its own: a benchmark killed before it could stop its burners
# leaves nothing spinning for longer than this.
_BURN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def burners(n: int, max_s: float = 3600.0) -> Iterator[list[int]]:
    """`n` processes that each keep a core busy at the same priority as everything else,
    while the block runs: a loaded node, where every process of the benchmark waits its turn
    for a core (the figures "beside two CPU burners"). Yields their pids; each is killed when
    the block ends, and ends by itself after `max_s` seconds however the block ends."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BURN.format(s=max_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # holding no pipe of the benchmark's open
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
