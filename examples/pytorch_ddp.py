"""PyTorch DDP training that checkpoints to and resumes from where Muster says.

Launch one replica per node as the Training Operator would, e.g. on a laptop:

    MUSTER_JOB_ID=demo MUSTER_ATTEMPT=1 MUSTER_CHECKPOINT_URI=/tmp/demo-ckpt \\
    MUSTER_ANNOTATION_FILE=/tmp/demo-ckpt/annotation.json \\
    torchrun --standalone --nproc_per_node=2 examples/pytorch_ddp.py --steps 200

or under Muster's `local` backend, which starts one process per replica with MASTER_ADDR,
MASTER_PORT, WORLD_SIZE and RANK set (see docs/local.md).

Muster sets MUSTER_CHECKPOINT_URI (where to write) and, on a later attempt, MUSTER_RESUME_FROM
(the checkpoint to start from). Rank 0 writes checkpoints and reports them through the SDK; a
checkpoint request (Muster's CheckpointNow, or SIGTERM before a spot node goes away) may reach
any rank, and is agreed on by every rank with an all-reduce, so the whole gang saves at the
same step and stops. The batch of each step is drawn from a generator seeded by (seed, step,
rank), so a resumed run sees the same data as one never stopped and ends with the same loss.
Local paths are written with torch.save; object-store URIs are left to your storage library.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from agents.sdk import Checkpointer


def local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None if "://" in uri else Path(uri)


def save(uri: str, state: dict[str, object]) -> None:
    path = local_path(uri)
    if path is None:
        raise SystemExit(f"this example writes local paths only, not {uri!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a half-written checkpoint is never visible


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp = DistributedDataParallel(model)

    ck = Checkpointer()
    start = 0
    if ck.resume_from is not None:
        path = local_path(ck.resume_from.uri)
        if path is not None and path.exists():
            state = torch.load(path, weights_only=False)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = int(state["step"])
    ck.on_checkpoint_request()  # every rank: SIGTERM reaches each replica's process
    if rank == 0:
        print(f"rank 0/{world}: starting at step {start}", flush=True)

    generator = torch.Generator()
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        generator.manual_seed((args.seed * 1_000_003 + step) * world + rank)
        x = torch.randn(16, 32, generator=generator)
        loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done = step + 1
        # Every rank learns whether any rank was asked for a checkpoint.
        flag = torch.tensor([1 if ck.requested else 0])
        dist.all_reduce(flag)
        asked = bool(flag.item())
        if done % args.checkpoint_every == 0 or asked or done == args.steps:
            if rank == 0:
                uri = ck.checkpoint_uri(done)
                save(
                    uri,
                    {
                        "step": done,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "loss": loss.item(),
                    },
                )
                channel = ck.report_checkpoint(done, uri)
                print(f"checkpoint at step {done} ({channel}), loss {loss.item():.4f}", flush=True)
            dist.barrier()
            if asked:
                stop = torch.tensor([1 if ck.sigterm_received else 0])
                dist.all_reduce(stop)
                if stop.item():
                    break  # the node is going away; the checkpoint is saved
                ck.clear_request()
        if args.step_time > 0:
            time.sleep(args.step_time)
    else:
        if rank == 0:
            print(f"final loss {loss.item()!r} at step {args.steps}", flush=True)
    ck.close()
    # The DDP wrapper holds the process group and its reducer's last work: left alive, the group
    # outlives destroy_process_group, and gloo's worker threads are torn down during interpreter
    # finalization, which aborts the rank ("terminate called without an active exception";
    # pytorch/pytorch#179291). So it goes first; then every rank reaches the same point before
    # gloo's pairs are torn down (mosaicml/streaming#186 synchronizes the same way).
    del ddp
    gc.collect()  # the wrapper's hooks keep it in reference cycles
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
