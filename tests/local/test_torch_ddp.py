"""examples/pytorch_ddp.py under the `local` backend: two replicas form a gloo process group
from the environment Muster gives them; a spot notice moves the gang to the other agent, which
resumes from the saved step and ends with the same loss and weights as a run never stopped."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.local.conftest import PY, REPO, Lab

torch = pytest.importorskip(
    "torch", reason="torch is not installed; `pip install -e '.[torch]'` runs this test"
)

DDP = REPO / "examples" / "pytorch_ddp.py"
STEPS = 40
ARGS = ["--steps", str(STEPS), "--checkpoint-every", "10"]
THREADS = {"OMP_NUM_THREADS": "1"}  # one thread per replica: small machines, same sums


def reference(tmp: Path) -> tuple[str, dict[str, Any]]:
    """The uninterrupted run under torchrun: its final loss line and last checkpoint."""
    env = {**os.environ, **THREADS, "MUSTER_CHECKPOINT_URI": str(tmp / "reference")}
    out = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DDP), *ARGS],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    final = re.search(r"final loss \S+ at step \d+", out.stdout)
    assert final is not None, out.stdout
    return final.group(0), torch.load(tmp / "reference" / f"step-{STEPS}", weights_only=False)


async def test_ddp_gang_moves_on_a_spot_notice_and_ends_with_the_same_loss(lab: Lab) -> None:
    final_line, ref_state = reference(lab.tmp)
    await lab.start(gpu=2)
    h = lab.harness
    ckpt = lab.tmp / "ckpt"
    spec = {
        "name": "ddp",
        "gang": [{"name": "worker", "replicas": 2, "gpu": 1}],
        "capacity": "spot",
        "checkpoint": {"uri": str(ckpt)},
        "workload": {
            "command": [PY, str(DDP)],
            "args": [*ARGS, "--step-time", "0.1"],
            "env": THREADS,
        },
    }
    job_id = (await h.submit(spec)).job_id
    first = await h.wait_event(job_id, "admitted", timeout=15)
    assert first.cluster == "a"
    await lab.broker_has_checkpoint(job_id, 10, timeout=90)
    a = lab.backend("a")
    a.spot_notice(a.nodes_of("spot")[0], lead_s=60)
    second = await h.wait_event(job_id, "admitted", count=2, timeout=60)
    assert second.cluster == "b"
    saved = second.resume_from_step
    assert saved is not None and 10 <= saved < STEPS
    await h.wait_event(job_id, "succeeded", timeout=120)
    resumed = lab.log("b", job_id, 2)
    assert f"rank 0/2: starting at step {saved}" in resumed
    assert final_line in resumed  # the same loss, to the last bit of its repr
    state = torch.load(ckpt / "attempt-2" / f"step-{STEPS}", weights_only=False)
    for name, tensor in ref_state["model"].items():
        assert torch.equal(state["model"][name], tensor), name
