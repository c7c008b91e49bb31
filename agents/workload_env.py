"""The environment contract every replica of a dispatched attempt gets, whatever the backend.

The SDK (`agents/sdk.py`) and the example trainers read these names; a backend adds only what
is particular to it (the kube backend its downward-API directory, the local backend its
per-attempt files and rendezvous port). Kept free of Kubernetes types so any backend can use it.
"""

from __future__ import annotations

from schemas.agent import Dispatch


def checkpoint_prefix(cmd: Dispatch) -> str:
    """Where this attempt writes checkpoints: the broker's choice, else the job's own."""
    return cmd.checkpoint_uri or (cmd.spec.checkpoint.uri if cmd.spec.checkpoint else "")


def muster_env(cmd: Dispatch) -> dict[str, str]:
    """`MUSTER_*`: who the attempt is, where to checkpoint and what to resume from."""
    resume = cmd.resume_from
    env = {
        "MUSTER_JOB_ID": cmd.job_id,
        "MUSTER_ATTEMPT": str(cmd.attempt),
        "MUSTER_CHECKPOINT_URI": checkpoint_prefix(cmd),
        "MUSTER_RESUME_FROM": resume.uri if resume else "",
        "MUSTER_RESUME_STEP": str(resume.step) if resume else "",
        # The attempt that wrote it (its checkpoints lie below `<checkpoint.uri>/attempt-<n>`).
        "MUSTER_RESUME_ATTEMPT": str(resume.attempt) if resume and resume.attempt else "",
    }
    if cmd.checkpoint_token:
        env["MUSTER_CHECKPOINT_TOKEN"] = cmd.checkpoint_token
    if cmd.checkpoint_interval_s > 0:
        # The broker's Young/Daly advice for this attempt's pool (a new attempt, a new value).
        env["MUSTER_CHECKPOINT_INTERVAL_S"] = f"{cmd.checkpoint_interval_s:g}"
    return env


def rendezvous_env(
    *, master_addr: str, master_port: int, world_size: int, rank: int, local_rank: int
) -> dict[str, str]:
    """What `torch.distributed` (env:// init) and most launchers read to form the gang."""
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
    }


def replica_env(
    cmd: Dispatch, *, master_addr: str, master_port: int, rank: int, local_rank: int
) -> dict[str, str]:
    """The job's own `workload.env` first, then Muster's names (which win on a clash, so a
    job cannot point a replica at another attempt's checkpoints or rank)."""
    world = sum(len(a.nodes) for a in cmd.assignment)
    return {
        **cmd.spec.workload.env,
        **muster_env(cmd),
        **rendezvous_env(
            master_addr=master_addr,
            master_port=master_port,
            world_size=world,
            rank=rank,
            local_rank=local_rank,
        ),
    }
