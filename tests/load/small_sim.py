"""A small simulator run (200 Philly jobs inside one pass of the Bamboo spot traces) that the
simulator's tests share."""

from __future__ import annotations

from dataclasses import replace

from load.simconfig import DEFAULT_POOLS, SimConfig

# Every spot pool starts at the beginning of its trace, so the run stays inside one pass.
SMALL = SimConfig(
    jobs=200,
    max_duration_s=2 * 3600.0,
    drain_s=2 * 86_400.0,
    pools=tuple(replace(p, trace_phase_s=0.0) for p in DEFAULT_POOLS),
    # Every GPU at one speed and cheap checkpoints keep the run inside one trace pass.
    gpu_speed=(("V100", 1.0), ("A100", 1.0), ("T4", 1.0)),
    ckpt_cost_s=(2.0, 6.0),
)
