"""`make demo-local` runs its story end to end and says what it proved."""

from __future__ import annotations

from pathlib import Path

from load.demo_local import run_demo


async def test_demo_moves_the_job_and_ends_with_the_uninterrupted_model(tmp_path: Path) -> None:
    lines: list[str] = []
    result = await run_demo(tmp_path, steps=150, say=lines.append)
    text = "\n".join(lines)
    assert result.exit_code == 0, text
    assert result.clusters == ["lab-east", "lab-west"], text
    assert result.resumed_from is not None and result.resumed_from >= 50
    assert f"lab-west attempt 2 | resumed from step {result.resumed_from}" in text
    assert "identical, bit for bit" in text
