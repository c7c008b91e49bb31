"""What a simulated workload prints, for `muster logs` against fake clusters.

Output is a pure function of the attempt's record (where it started, the step it reached, its
checkpoints and how it ended), so nothing is stored per line and a tail of any length is cheap.
Each replica prints its start, one line every `every` steps, and its exit; rank 0 also prints
each checkpoint it saved.
"""

from __future__ import annotations

from collections.abc import Sequence


def simulated_output(
    pods: Sequence[tuple[str, str]],
    *,
    attempt: int,
    from_step: int,
    step: int,
    every: int,
    last_checkpoint: int | None,
    ended: str | None,
    reason: str,
    tail: int,
) -> list[str]:
    """The last `tail` lines of each selected pod, as `[pod] text`; `pods` is (pod, node)."""
    out: list[str] = []
    every = max(1, every)
    for rank, (pod, node) in enumerate(pods):
        lines = [f"[{pod}] attempt {attempt} on {node}: starting from step {from_step}"]
        first = (from_step // every + 1) * every
        steps = range(first, step + 1, every)
        for s in steps[-tail:]:
            lines.append(f"[{pod}] step {s} loss {4.0 / (1.0 + s / 100.0):.4f}")
            if rank == 0 and last_checkpoint is not None and s <= last_checkpoint:
                lines.append(f"[{pod}] checkpoint saved at step {s}")
        if ended is not None:
            lines.append(f"[{pod}] exiting: {ended}" + (f" ({reason})" if reason else ""))
        out.extend(lines[-tail:])
    return out
