"""How the local backend runs an elastic podset: one torchrun agent per replica (a "node").

A gang whose only podset has `max_replicas` runs each replica as
`torchrun --nnodes=MIN:MAX --nproc-per-node=1 --rdzv-backend=c10d` with one rendezvous per
attempt, so torchrun's own elastic machinery forms, shrinks and grows the worker group: when
a replica's torchrun is stopped (a shrink) the workers of the others fail their next
collective, torchrun restarts them and they re-rendezvous at the smaller size; a torchrun
started later (a grow) waits in the rendezvous and the running agents restart their workers
to let it in. The rendezvous store runs apart from every agent (`rdzv_store.py`), so any
replica can be the one that leaves.

Environment choices, each for a reason:
- `--rdzv-conf is_host=false`: no agent hosts the store (it would die with its node).
- `last_call_timeout=1`: a round completes 1 s after it reaches the minimum (default 30 s).
- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: the workers form their process group through
  their rank 0's own store, not one the first round's rank-0 agent keeps serving; with the
  shared store a grow after the first round never completed its rendezvous (torch 2.13).
- `--local-addr 127.0.0.1`: every address stays on the loopback interface.
"""

from __future__ import annotations

import sys

from schemas.agent import Dispatch
from schemas.job import PodSet

RDZV_HOST = "127.0.0.1"
LAST_CALL_S = 1
MONITOR_S = 0.2


def elastic_podset(cmd: Dispatch) -> PodSet | None:
    """The podset run under torchrun elastic: the gang's only podset, when it is elastic.
    A gang with several podsets keeps fixed ranks (torchrun has one role per rendezvous)."""
    gang = cmd.spec.gang
    return gang[0] if len(gang) == 1 and gang[0].elastic else None


def store_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "agents.local.rdzv_store", str(port)]


def torchrun_argv(cmd: Dispatch, podset: PodSet, port: int, max_restarts: int) -> list[str]:
    """One replica: a torchrun agent running the workload as its single worker."""
    workload = cmd.spec.workload
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={podset.least}:{podset.most}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={RDZV_HOST}:{port}",
        f"--rdzv-id={cmd.job_id}-{cmd.attempt}",
        f"--rdzv-conf=is_host=false,last_call_timeout={LAST_CALL_S}",
        f"--local-addr={RDZV_HOST}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_S}",
        "--no-python",
        *workload.command,
        *workload.args,
    ]


def torchrun_env() -> dict[str, str]:
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
