"""A simulated cluster backend for tests, the demo and load tests."""

from agents.config import BambooTrace, FakeClusterConfig, FakeFlavor
from agents.fake.cluster import AttemptRecord, FakeCluster
from agents.fake.model import ClusterModel, ManualClock
from agents.fake.trace import TraceEvent, load_bamboo, parse_bamboo

__all__ = [
    "AttemptRecord",
    "BambooTrace",
    "ClusterModel",
    "FakeCluster",
    "FakeClusterConfig",
    "FakeFlavor",
    "ManualClock",
    "TraceEvent",
    "load_bamboo",
    "parse_bamboo",
]
