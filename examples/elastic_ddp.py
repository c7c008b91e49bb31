"""Elastic data-parallel training under torchrun: the gang shrinks and grows while it runs.

Launch one torchrun agent per node with an elastic rendezvous, as Muster's `local` backend
does for a podset with `max_replicas` (docs/local.md, "Elastic podsets"):

    torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo examples/elastic_ddp.py --steps 300

Without torchrun (no WORLD_SIZE) it trains alone, the fixed-size reference run.

When a node leaves or joins, torchrun stops every worker and starts a new worker group at the
new size (torchrun elastic semantics: workers are restarted, the agents are not). What is kept
across that re-rendezvous is what each worker saved in its node's local snapshot (`--snapshot`,
one per local rank, written after every optimizer step): the step counter, the model weights
and the optimizer state (SGD momentum). On start every rank loads its snapshot, the ranks agree
on the newest one, and its owner broadcasts it, so a node that joins with no snapshot gets the
gang's state and no step is repeated or lost. Nothing else survives (no data-loader position:
the batch of a step is a function of (seed, step)). Muster's checkpoints
(`MUSTER_CHECKPOINT_URI`) are separate and only used by a new attempt (a whole-gang move):
MUSTER_RESUME_FROM is read only when no rank has a snapshot.

The global batch is fixed (`--global-batch`, divisible by every size the gang may take); each
rank trains on its equal slice, so the averaged gradient, and the trajectory, is that of one
process on the whole batch at any size, up to float32 summation order (docs/local.md says how
close a run must come to the reference to match).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from agents.sdk import Checkpointer


def save(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a worker killed mid-write leaves the previous snapshot whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load(path: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = torch.load(path, weights_only=False)
    except (OSError, RuntimeError, EOFError):
        return None
    return state


def local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None if "://" in uri else Path(uri)


def restore(snapshot: Path, ck: Checkpointer, rank: int, world: int) -> tuple[Any, str]:
    """The newest state any rank holds (its own snapshot, else Muster's resume checkpoint),
    sent from its owner to every rank; None (and "scratch") when nobody has one."""
    mine = load(snapshot)
    origin = "snapshot"
    if mine is None and ck.resume_from is not None:
        path = local_path(ck.resume_from.uri)
        mine = load(path) if path is not None else None
        origin = "checkpoint"
    step = int(mine["step"]) if mine is not None else -1
    if world == 1:
        return mine, (f"{origin} at step {step}" if mine is not None else "scratch")
    steps = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([step]))
    best = max(range(world), key=lambda r: (int(steps[r].item()), -r))
    if int(steps[best].item()) < 0:
        return None, "scratch"
    box = [mine if rank == best else None]
    dist.broadcast_object_list(box, src=best)
    return box[0], f"{origin} of rank {best} at step {int(steps[best].item())}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument(
        "--snapshot",
        type=Path,
        default=Path(f"elastic-snapshot-{os.environ.get('LOCAL_RANK', '0')}.pt"),
        help="this worker's snapshot (one per local rank: workers of a node share its disk)",
    )
    parser.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="WORKERS:STEP",
        help="at STEP, wait until the group has WORKERS workers (a demo of a resize: the gang "
        "pauses there until a node leaves or joins and torchrun restarts it at the new size)",
    )
    args = parser.parse_args()
    holds = dict((int(s), int(w)) for w, s in (h.split(":") for h in args.hold))

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.global_batch % world:
        raise SystemExit(
            f"--global-batch {args.global_batch} does not split evenly over {world} workers; "
            "use a multiple of every size the gang may take (48 covers 1, 2, 3, 4, 6 and 8)"
        )
    parent = os.getppid()  # torchrun; if it dies without stopping us we must not go on
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ck = Checkpointer()
    state, origin = restore(args.snapshot, ck, rank, world)
    start = 0
    loss = torch.tensor(float("nan"))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        loss = torch.tensor(state.get("loss", float("nan")))
    net = DistributedDataParallel(model) if distributed else model
    ck.on_checkpoint_request(sigterm=False)  # SIGTERM stops this worker: the node is leaving
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == 0:
        print(
            f"rank 0/{world}: group starts at step {start} from {origin} (restart {restart})",
            flush=True,
        )

    share = args.global_batch // world
    generator = torch.Generator()
    for step in range(start, args.steps):
        while holds.get(step, world) != world:
            if os.getppid() != parent:
                sys.exit("the torchrun agent is gone; stopping")
            # A collective now and then: a peer that left makes it fail, and torchrun then
            # restarts the group without it; a node that joins makes torchrun stop us.
            if distributed:
                dist.barrier()
            time.sleep(0.1)
        generator.manual_seed(args.seed * 1_000_003 + step)
        batch = torch.randn(args.global_batch, 32, generator=generator)
        x = batch[rank * share : (rank + 1) * share]
        mine = (net(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        mine.backward()  # DDP averages the gradients: the whole batch's mean
        optimizer.step()
        done = step + 1
        loss = mine.detach().clone()
        flag = torch.tensor([1 if ck.requested else 0])
        if distributed:
            dist.all_reduce(loss)
            loss /= world
            dist.all_reduce(flag)
        save(
            args.snapshot,
            {
                "step": done,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loss": loss.item(),
            },
        )
        if rank == 0 and (done % args.checkpoint_every == 0 or flag.item() or done == args.steps):
            uri = ck.checkpoint_uri(done)
            path = local_path(uri) if ck.env.checkpoint_uri else None
            if path is not None:
                save(path, {"step": done, "model": model.state_dict(),
                            "optimizer": optimizer.state_dict()})  # fmt: skip
                ck.report_checkpoint(done, uri)
            print(f"step {done} world {world} loss {loss.item():.6f}", flush=True)
        if flag.item():
            ck.clear_request()
        if os.getppid() != parent:
            sys.exit("the torchrun agent is gone; stopping")
        if args.step_time > 0:
            time.sleep(args.step_time)
    if rank == 0:
        print(f"final loss {loss.item()!r} at step {args.steps}", flush=True)
    ck.close()
    if distributed:
        # As in examples/pytorch_ddp.py: the DDP wrapper left alive keeps the process group
        # past destroy_process_group, and gloo's threads torn down at interpreter exit abort
        # the rank ("terminate called without an active exception", pytorch/pytorch#179291),
        # which torchrun takes for a failed worker and restarts the group without it. So the
        # wrapper goes first, and every rank reaches the same point before the teardown.
        del net
        gc.collect()  # the wrapper's hooks keep it in reference cycles
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
