"""`muster broker` under tracemalloc, for `load.bench_memory`: the allocations of the broker's
own process as it runs, not of a copy of its structures built elsewhere.

    python -m load.memprobe SNAPSHOT_PATH broker --nats URL ...

SIGUSR1 collects garbage and dumps a tracemalloc snapshot to SNAPSHOT_PATH (written to a
temporary name first, then renamed, so the reader never sees half a file).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tracemalloc
from types import FrameType


def main() -> None:
    path = sys.argv[1]

    def dump(_signum: int, _frame: FrameType | None) -> None:
        gc.collect()
        tracemalloc.take_snapshot().dump(path + ".tmp")
        os.replace(path + ".tmp", path)

    tracemalloc.start(1)
    signal.signal(signal.SIGUSR1, dump)
    from muster.cli import app

    app(args=sys.argv[2:], prog_name="muster")


if __name__ == "__main__":
    main()
