"""Dependency-free training with the Muster checkpoint SDK: linear regression by SGD with
momentum, in pure Python, on a synthetic problem.

Deterministic by construction: the batch of step `s` is drawn from a generator seeded by
(seed, s), and the whole state (step, weights, momentum) goes into the checkpoint as JSON,
whose float text round-trips exactly. So a run stopped at any checkpoint and resumed from it
ends with the same model, bit for bit, as a run never stopped.

    MUSTER_CHECKPOINT_URI=/tmp/sgd MUSTER_ANNOTATION_FILE=/tmp/sgd/annotation.json \\
    python examples/sgd_train.py --steps 300

Checkpoints go to `<MUSTER_CHECKPOINT_URI>/step-<n>` every `--checkpoint-every` steps, when
Muster asks for one, on SIGTERM (then the process exits 0), and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from agents.sdk import Checkpointer

DIM = 16
BATCH = 32


def true_weights(seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(-1.0, 1.0) for _ in range(DIM)]


def batch(seed: int, step: int, w_true: list[float]) -> list[tuple[list[float], float]]:
    rng = random.Random(seed * 1_000_003 + step)
    out = []
    for _ in range(BATCH):
        x = [rng.gauss(0.0, 1.0) for _ in range(DIM)]
        y = sum(a * b for a, b in zip(w_true, x, strict=True)) + rng.gauss(0.0, 0.1)
        out.append((x, y))
    return out


def sgd_step(state: dict[str, Any], data: list[tuple[list[float], float]], lr: float) -> float:
    """One step of SGD with momentum 0.9 on mean squared error; returns the batch loss."""
    w: list[float] = state["model"]["w"]
    b: float = state["model"]["b"]
    vel: list[float] = state["optimizer"]["velocity"]
    grad_w = [0.0] * DIM
    grad_b = 0.0
    loss = 0.0
    for x, y in data:
        err = sum(a * c for a, c in zip(w, x, strict=True)) + b - y
        loss += err * err
        for i in range(DIM):
            grad_w[i] += 2.0 * err * x[i] / len(data)
        grad_b += 2.0 * err / len(data)
    for i in range(DIM):
        vel[i] = 0.9 * vel[i] + grad_w[i]
        w[i] -= lr * vel[i]
    vel[DIM] = 0.9 * vel[DIM] + grad_b
    state["model"]["b"] = b - lr * vel[DIM]
    return loss / len(data)


def local_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if "://" in uri:
        raise SystemExit(f"this example writes local paths only, not {uri!r}")
    return Path(uri)


def save(uri: str, state: dict[str, Any]) -> None:
    path = local_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)  # a half-written checkpoint is never visible


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    w_true = true_weights(args.seed)
    state: dict[str, Any] = {
        "step": 0,
        "seed": args.seed,
        "model": {"w": [0.0] * DIM, "b": 0.0},
        "optimizer": {"velocity": [0.0] * (DIM + 1), "lr": args.lr, "momentum": 0.9},
    }
    with Checkpointer() as ck:
        if ck.resume_from is not None:
            state = json.loads(local_path(ck.resume_from.uri).read_text())
            print(f"resumed from step {state['step']} ({ck.resume_from.uri})", flush=True)
        ck.on_checkpoint_request()  # Muster's requests and SIGTERM set ck.requested
        loss = float("nan")
        while state["step"] < args.steps:
            step = state["step"]
            loss = sgd_step(state, batch(args.seed, step, w_true), args.lr)
            state["step"] = done = step + 1
            state["loss"] = loss
            if done % args.log_every == 0:
                print(f"step {done} loss {loss:.6f}", flush=True)
            if done % args.checkpoint_every == 0 or ck.requested or done == args.steps:
                uri = ck.checkpoint_uri(done)
                save(uri, state)
                ck.report_checkpoint(done, uri)
                print(f"checkpoint step {done} loss {loss:.6f} -> {uri}", flush=True)
                if ck.sigterm_received:
                    print(f"stopping at step {done} (SIGTERM)", flush=True)
                    return 0
                ck.clear_request()
            if args.step_time > 0:
                time.sleep(args.step_time)
        print(f"done: step {state['step']} loss {loss:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
