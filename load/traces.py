"""Loaders for the real traces in data/traces (Philly GPU jobs, Bamboo spot node events).

The traces ship in the source tree, not in the wheel: only the load tools and tests read them,
and those run from a checkout. `require_trace` names the missing file and the fix instead of a
bare FileNotFoundError when the folder is absent (an installed package, a partial copy).

Gang mapping for Philly (which records only a GPU count per job): a job of n GPUs becomes one
podset. n <= 8 fits one node: 1 replica x n GPUs. n > 8 spans whole 8-GPU nodes, as Philly's
multi-node jobs did: ceil(n / 8) replicas x 8 GPUs (so 12 GPUs become 2 x 8; the round-up is
what a node-exclusive multi-node job really holds).
"""

from __future__ import annotations

import calendar
import csv
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# One trace parser (Bamboo CSV, SkyPilot JSON) for the clusters, the simulator and these scripts.
from agents.fake.trace import SpotTrace as SpotTrace
from agents.fake.trace import load_bamboo as load_bamboo
from agents.fake.trace import load_trace as load_trace
from broker.core.types import PodSetDemand

GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class PhillyJob:
    arrival: float  # unix seconds (the trace's wall-clock stamps read as UTC)
    duration: float  # seconds
    num_gpus: int
    cluster: str  # Philly virtual cluster


class MissingTraceError(RuntimeError):
    """A trace file the caller asked for is not on disk; the text says where it was expected."""


def default_traces_dir() -> Path:
    """repo_root/data/traces, found relative to this file (a checkout or an editable install)."""
    return Path(__file__).resolve().parent.parent / "data" / "traces"


def require_trace(name: str, traces_dir: Path | None = None) -> Path:
    """The path of a shipped trace, or MissingTraceError saying where it should be."""
    p = (traces_dir or default_traces_dir()) / name
    if not p.is_file():
        raise MissingTraceError(
            f"trace {name} not found at {p}: the traces ship with the source tree under "
            "data/traces/ (see data/traces/README.md); run from a checkout of the repository"
        )
    return p


def _unix(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp.strip(), "%Y-%m-%d %H:%M:%S")))


def load_philly(path: str | Path | None = None) -> list[PhillyJob]:
    """All Philly jobs sorted by arrival (the file is not sorted)."""
    p = Path(path) if path is not None else require_trace("philly.csv")
    jobs: list[PhillyJob] = []
    with p.open(newline="") as fh:
        for row in csv.DictReader(fh):
            jobs.append(
                PhillyJob(
                    arrival=_unix(row["timestamp"]),
                    duration=float(row["duration"]),
                    num_gpus=int(row["num_gpus"]),
                    cluster=row["cluster"],
                )
            )
    jobs.sort(key=lambda j: j.arrival)
    return jobs


def philly_gang_sizes(path: str | Path | None = None) -> list[int]:
    """GPU count of every Philly job with at least one GPU, in arrival order."""
    return [j.num_gpus for j in load_philly(path) if j.num_gpus > 0]


def trace_period_s(times_s: Sequence[float], declared_s: float | None = None) -> float:
    """How long one pass of a spot trace lasts, so that looping it keeps its own rhythm.

    The trace's declared length when it has one (a zone that is up once in two days is a
    two-day trace, however early its last event); else the last event's time plus the median
    gap between its event instants, the trace's own spacing (no fixed pad)."""
    if not times_s:
        raise ValueError("an empty spot trace has no length")
    last = max(times_s)
    if declared_s is not None:
        if declared_s < last:
            raise ValueError(
                f"the trace's declared length {declared_s:g}s is shorter than its last event "
                f"at {last:g}s; declare at least that"
            )
        return declared_s
    instants = sorted(set(times_s))
    gaps = [b - a for a, b in itertools.pairwise(instants)]
    return last + (statistics.median(gaps) if gaps else 3600.0)


def gang_shape(num_gpus: int) -> tuple[int, int]:
    """(replicas, GPUs per replica) for a gang of `num_gpus` (see the module docstring)."""
    if num_gpus <= GPUS_PER_NODE:
        return 1, num_gpus
    return -(-num_gpus // GPUS_PER_NODE), GPUS_PER_NODE


def gang_demands(
    num_gpus: int,
    cpu_milli_per_gpu: int = 8000,
    memory_per_gpu: int = 64 * 2**30,
    podset: str = "worker",
) -> tuple[PodSetDemand, ...]:
    """The podsets of a Philly-style gang, with cpu and memory in proportion to GPUs."""
    replicas, gpu = gang_shape(num_gpus)
    per = max(1, gpu)
    return (
        PodSetDemand(
            podset=podset,
            replicas=replicas,
            gpu=gpu,
            cpu_milli=cpu_milli_per_gpu * per,
            memory=memory_per_gpu * per,
        ),
    )
