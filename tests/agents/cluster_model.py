"""The fake cluster's model on a manual clock, with the events it emitted collected: a small
two-flavor config, stepping the clock, and picking statuses out of what was emitted."""

from __future__ import annotations

from agents.config import FakeClusterConfig, FakeFlavor
from agents.fake.model import ClusterModel, ManualClock
from schemas.agent import AgentEvent, WorkloadStatus

CONFIG = FakeClusterConfig(
    flavors=[
        FakeFlavor(name="spot-a100", capacity_type="spot", nodes=2),
        FakeFlavor(name="od-a100", nodes=2),
    ],
    start_delay_s=1.0,
    spot_notice_s=30.0,
    seed=7,
)


def model(
    config: FakeClusterConfig = CONFIG, scale: float = 1.0
) -> tuple[ClusterModel, ManualClock, list[AgentEvent]]:
    clock = ManualClock(scale=scale)
    m = ClusterModel("m", config, clock)
    got: list[AgentEvent] = []
    m.emit = got.append
    return m, clock, got


def run_until(m: ClusterModel, clock: ManualClock, t: float, step: float = 0.25) -> None:
    """Move the clock to `t` in steps, running what falls due at each."""
    while clock.now() < t:
        clock.advance(min(step, t - clock.now()))
        m.advance()


def statuses(got: list[AgentEvent], phase: str) -> list[WorkloadStatus]:
    return [e for e in got if isinstance(e, WorkloadStatus) and e.phase == phase]
