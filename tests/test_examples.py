"""The PyTorch DDP example: runs under torchrun only where torch is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch_ddp.py"


def _torchrun(tmp: Path, attempt: int, steps: int, resume: str | None = None) -> str:
    env = {
        **os.environ,
        "MUSTER_JOB_ID": "ddp-test",
        "MUSTER_ATTEMPT": str(attempt),
        "MUSTER_CHECKPOINT_URI": str(tmp / "ckpt"),
        "MUSTER_ANNOTATION_FILE": str(tmp / "annotation.json"),
        "PYTHONPATH": str(EXAMPLE.parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    if resume:
        env["MUSTER_RESUME_FROM"] = resume
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(EXAMPLE), "--steps", str(steps), "--checkpoint-every", "10"],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_ddp_example_checkpoints_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    first = _torchrun(tmp_path, 1, steps=20)
    assert "starting at step 0" in first and "checkpoint at step 20 (file)" in first
    report = json.loads((tmp_path / "annotation.json").read_text())
    assert report["step"] == 20 and report["uri"].endswith("step-20")
    second = _torchrun(tmp_path, 2, steps=30, resume=report["uri"])
    assert "starting at step 20" in second and "checkpoint at step 30" in second
    assert "checkpoint at step 10" not in second  # no work was repeated
