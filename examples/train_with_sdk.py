"""A plain training loop instrumented with the Muster checkpoint SDK (no torch needed).

Muster sets MUSTER_JOB_ID, MUSTER_ATTEMPT, MUSTER_CHECKPOINT_URI, MUSTER_RESUME_FROM and, when
the workload can reach NATS, MUSTER_NATS_URL. Try it locally:

    MUSTER_JOB_ID=demo MUSTER_ATTEMPT=1 MUSTER_CHECKPOINT_URI=/tmp/demo-ckpt \
    MUSTER_ANNOTATION_FILE=/tmp/demo-ckpt/annotation.json python examples/train_with_sdk.py

then `kill -TERM <pid>`: the loop saves a checkpoint and exits cleanly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from agents.sdk import Checkpointer

TOTAL_STEPS = 1_000
CHECKPOINT_EVERY = 100


def save(uri: str, step: int) -> None:
    """Stand-in for torch.save: write the step to a local path (or your object store)."""
    if "://" not in uri:
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        Path(uri).write_text(json.dumps({"step": step}))


def main() -> None:
    with Checkpointer() as ck:
        ck.on_checkpoint_request()  # the agent's requests (podinfo file) and SIGTERM
        print(f"starting at step {ck.resume_step}")
        for step in range(ck.resume_step, TOTAL_STEPS):
            time.sleep(0.01)  # one training step
            if (step and step % CHECKPOINT_EVERY == 0) or ck.requested:
                uri = ck.checkpoint_uri(step)
                save(uri, step)
                print(f"checkpoint at step {step} -> {ck.report_checkpoint(step, uri)}")
                if ck.sigterm_received:
                    return  # stopping: the checkpoint is saved
                ck.clear_request()


if __name__ == "__main__":
    main()
