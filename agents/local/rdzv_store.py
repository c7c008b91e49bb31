"""The rendezvous store of one elastic attempt: `python -m agents.local.rdzv_store PORT`.

torchrun's c10d rendezvous keeps its state in a TCPStore that one agent hosts unless told
otherwise; when that agent's node is the one reclaimed, the store goes with it and the other
nodes cannot re-rendezvous. So the local backend runs the store on its own, beside the
attempt's torchrun agents (each started with `--rdzv-conf is_host=false`), and stops it with
the attempt. Imports torch, so only elastic attempts (which need torch anyway) start it.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta
from types import FrameType


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m agents.local.rdzv_store PORT", file=sys.stderr)
        return 2
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # elastic needs torch

    store = TCPStore(
        "127.0.0.1",
        int(args[0]),
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"rendezvous store listening on 127.0.0.1:{store.port}", flush=True)
    signal.pause()  # serves from its own threads until SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
