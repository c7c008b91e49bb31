"""Hypothesis strategies for valid Muster messages, and for hostile input.

Valid messages are built field by field from the Structs' constraints (hypothesis'
`from_type` cannot read msgspec `Meta` constraints, so it makes invalid names and out-of-range
numbers; it is used only for the unconstrained reply types).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from schemas.agent import (
    Cancel,
    CheckpointNow,
    CheckpointRef,
    CheckpointReport,
    ClusterSnapshot,
    CommandAck,
    Dispatch,
    DispatchAcks,
    DispatchBatch,
    EventBatch,
    FlavorInfo,
    GpuHealth,
    Heartbeat,
    NodeGone,
    NodeInfo,
    NodeTaint,
    NodeUpsert,
    PodSetAssignment,
    Provision,
    ProvisionPool,
    Resync,
    SpotNotice,
    WireRefused,
    WorkloadStatus,
)
from schemas.api import JobEvent, SubmitReply
from schemas.config import (
    BrokerConfig,
    CohortConfig,
    FlavorClass,
    FlavorQuota,
    PreemptionPolicy,
    QueueConfig,
    ResourceQuota,
    SchedulingConfig,
    Timeouts,
)
from schemas.job import (
    CheckpointSpec,
    GangTopology,
    JobSpec,
    PodSet,
    RestartPolicy,
    Simulation,
    SpotPolicy,
    Workload,
)

INT64 = 2**63 - 1

dns_labels = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?\Z")
tokens = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,20}\Z")
names = st.text(min_size=1, max_size=24)
short_text = st.text(max_size=40)
non_neg = st.integers(0, 2**40)


def floats(lo: float | None = None, hi: float | None = None) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


def opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


cpu_quantities = st.one_of(
    st.integers(0, 512),
    st.sampled_from(["500m", "1", "2.5", "64", "0.1", "250m", "1e3", "96"]),
)
memory_quantities = st.one_of(
    st.integers(0, 2**40),
    st.sampled_from(["1Gi", "512Mi", "16Gi", "1.5G", "256Gi", "2e9", "1Ti"]),
)

# JSON-safe values (ints in int64 so msgpack can carry them too).
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-INT64, INT64),
    floats(),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
msgpack_values = st.recursive(
    json_leaves | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=20,
)

# -- client-facing -----------------------------------------------------------------------

topology_levels = st.sampled_from(
    ["rack", "zone", "topology.kubernetes.io/zone", "cloud.google.com/gce-topology-block"]
)

podsets = st.builds(
    PodSet,
    name=dns_labels,
    replicas=st.integers(1, 4096),
    gpu=st.integers(0, 64),
    cpu=cpu_quantities,
    memory=memory_quantities,
)
workloads = st.builds(
    Workload,
    kind=st.sampled_from(["indexed-job", "pytorchjob", "manifest"]),
    image=st.text(max_size=30),
    command=st.lists(short_text, max_size=4),
    args=st.lists(short_text, max_size=4),
    env=st.dictionaries(st.text(max_size=10), short_text, max_size=4),
    port=st.integers(1, 65535),
    manifest=opt(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
    simulate=opt(
        st.builds(
            Simulation,
            total_steps=st.integers(1, 10**9),
            steps_per_second=floats(1e-3, 1e6),
            checkpoint_every=st.integers(1, 10**9),
            fail_at_step=opt(st.integers(0, 10**9)),
            exit_code=st.integers(0, 255),
        )
    ),
)
jobspecs = st.builds(
    JobSpec,
    name=dns_labels,
    gang=st.lists(podsets, min_size=1, max_size=4, unique_by=lambda p: p.name),
    queue=opt(dns_labels),
    job_id=opt(tokens),
    priority=st.integers(-1_000_000, 1_000_000),
    gpu_types=st.lists(st.text(max_size=10), max_size=3),
    capacity=st.sampled_from(["spot", "on-demand", "spot-then-on-demand", "any"]),
    spot=st.builds(
        SpotPolicy,
        fallback_after_preemptions=st.integers(0, 1000),
        fallback_after_wait_s=floats(0, 86_400 * 7),
    ),
    checkpoint=opt(st.builds(CheckpointSpec, uri=st.text(min_size=1, max_size=40))),
    restart=st.builds(
        RestartPolicy,
        max_restarts_on_error=st.integers(0, 1000),
        max_preemptions=opt(st.integers(0, 100_000)),
        retriable_exit_codes=st.lists(st.integers(0, 255), max_size=5),
        backoff_s=floats(0, 3600),
        max_backoff_s=floats(0, 86_400),
    ),
    start_timeout_s=opt(floats(1e-3, 86_400)),
    workload=workloads,
    labels=st.dictionaries(st.text(max_size=10), short_text, max_size=4),
    topology=opt(
        st.builds(
            GangTopology,
            required=opt(topology_levels),
            preferred=opt(topology_levels),
            spread=st.booleans(),
        )
    ),
)
job_states = st.sampled_from(
    ["queued", "admitted", "running", "preempting", "succeeded", "failed", "cancelled"]
)
job_events = st.builds(
    JobEvent,
    job_id=tokens,
    kind=st.sampled_from(
        [
            "queued",
            "admitted",
            "running",
            "checkpointed",
            "preempting",
            "requeued",
            "succeeded",
            "failed",
            "cancelled",
        ]
    ),
    at=floats(0, 4e9),
    state=job_states,
    attempt=st.integers(0, 10_000),
    cluster=opt(tokens),
    flavor=opt(names),
    reason=opt(short_text),
    step=opt(non_neg),
    resume_from_step=opt(non_neg),
)
# SubmitReply has no constraints, so hypothesis can infer it from the type.
submit_replies = st.from_type(SubmitReply)

# -- agent protocol ----------------------------------------------------------------------

provision_pools = st.builds(
    ProvisionPool,
    max_nodes=st.integers(1, 1_000_000),
    max_gpus=st.integers(0, 2**31),
    node_gpu=st.integers(1, 1024),
    node_cpu_milli=non_neg,
    node_memory=non_neg,
    labels=st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=20), max_size=3),
    taints=st.lists(
        st.builds(
            NodeTaint,
            key=st.text(min_size=1, max_size=20),
            value=st.text(max_size=20),
            effect=st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        ),
        max_size=2,
    ),
    ready_s=floats(0, 86_400),
    window_s=floats(0.001, 86_400),
)
flavor_infos = st.builds(
    FlavorInfo,
    name=names,
    capacity_type=st.sampled_from(["spot", "on-demand"]),
    gpu_type=st.text(max_size=10),
    price_per_gpu_hour=floats(0, 100),
    gpu_memory_mib=st.integers(0, 2**31),
    provision=opt(provision_pools),
)
node_infos = st.builds(
    NodeInfo,
    name=names,
    flavor=names,
    gpu=st.integers(0, 64),
    cpu_milli=non_neg,
    memory=non_neg,
    gpu_healthy=opt(st.integers(0, 64)),
    ready=st.booleans(),
    spot_deadline=opt(floats(0, 4e9)),
    other_gpu=st.integers(0, 64),
    other_cpu_milli=non_neg,
    other_memory=non_neg,
)
workload_statuses = st.builds(
    WorkloadStatus,
    job_id=names,
    attempt=st.integers(1, 10_000),
    phase=st.sampled_from(["created", "running", "succeeded", "failed", "evicted"]),
    running_replicas=st.integers(0, 4096),
    total_replicas=st.integers(0, 4096),
    exit_codes=st.lists(st.integers(-(2**31), 2**31), max_size=4),
    reason=short_text,
    step=opt(non_neg),
    nodes=st.lists(names, max_size=4),
)
agent_events = st.one_of(
    st.builds(
        ClusterSnapshot,
        flavors=st.lists(flavor_infos, max_size=3),
        nodes=st.lists(node_infos, max_size=4),
        workloads=st.lists(workload_statuses, max_size=3),
    ),
    st.builds(NodeUpsert, node=node_infos),
    st.builds(NodeGone, node=names, reason=short_text),
    st.builds(
        GpuHealth,
        node=names,
        healthy=st.integers(0, 64),
        xid=opt(st.integers(0, 200)),
        reason=short_text,
    ),
    st.builds(SpotNotice, node=names, deadline=floats(0, 4e9), reason=short_text),
    workload_statuses,
    st.builds(
        CheckpointReport,
        job_id=names,
        attempt=st.integers(1, 10_000),
        step=non_neg,
        uri=st.text(max_size=40),
        at=floats(0, 4e9),
    ),
    st.builds(Heartbeat, at=floats(0, 4e9)),
)
event_batches = st.builds(
    EventBatch,
    cluster=tokens,
    instance=st.text(min_size=1, max_size=16),
    seq=st.integers(1, 2**40),
    events=st.lists(agent_events, max_size=5),
    sent_at=floats(0, 4e9),
    wire=st.text(max_size=16),
)
dispatches = st.builds(
    Dispatch,
    job_id=names,
    attempt=st.integers(1, 10_000),
    epoch=st.integers(0, 2**40),
    flavor=names,
    assignment=st.lists(
        st.builds(PodSetAssignment, podset=names, nodes=st.lists(names, max_size=4)), max_size=3
    ),
    spec=jobspecs,
    resume_from=opt(st.builds(CheckpointRef, step=non_neg, uri=st.text(max_size=30))),
    checkpoint_uri=st.text(max_size=30),
)
commands = st.one_of(
    dispatches,
    st.builds(
        DispatchBatch,
        epoch=st.integers(0, 2**40),
        dispatches=st.lists(dispatches, min_size=1, max_size=3),
    ),
    st.builds(
        Cancel,
        job_id=names,
        epoch=st.integers(0, 2**40),
        attempt=opt(st.integers(1, 10_000)),
        reason=short_text,
    ),
    st.builds(
        CheckpointNow,
        job_id=names,
        attempt=st.integers(1, 10_000),
        epoch=st.integers(0, 2**40),
        deadline=floats(0, 4e9),
    ),
    st.builds(Resync, epoch=st.integers(0, 2**40), reason=short_text),
    st.builds(
        Provision,
        job_id=names,
        epoch=st.integers(0, 2**40),
        flavor=names,
        nodes=st.integers(1, 100_000),
        deadline=floats(0, 4e9),
    ),
    st.builds(
        WireRefused,
        epoch=st.integers(0, 2**40),
        broker_wire=st.text(max_size=16),
        agent_wire=st.text(max_size=16),
        reason=short_text,
    ),
)
command_acks = st.builds(CommandAck, ok=st.booleans(), error=short_text, stale_epoch=st.booleans())
dispatch_acks = st.builds(DispatchAcks, acks=st.lists(command_acks, min_size=1, max_size=5))

# -- config ------------------------------------------------------------------------------

resource_quotas = st.builds(
    ResourceQuota,
    nominal=st.integers(0, 2**50),
    borrowing_limit=opt(st.integers(0, 2**50)),
    lending_limit=opt(st.integers(0, 2**50)),
)


@st.composite
def broker_configs(draw: st.DrawFn) -> BrokerConfig:
    """A valid config whose quotas name declared flavor classes only."""
    flavors = draw(
        st.lists(
            st.builds(
                FlavorClass,
                name=dns_labels,
                capacity_type=opt(st.sampled_from(["spot", "on-demand"])),
                gpu_type=opt(st.text(max_size=10)),
            ),
            max_size=3,
            unique_by=lambda f: f.name,
        )
    )
    flavor_names = [f.name for f in flavors]
    quota_lists = (
        st.none()
        if not flavor_names
        else opt(
            st.lists(
                st.builds(
                    FlavorQuota,
                    flavor=st.sampled_from(flavor_names),
                    resources=st.dictionaries(
                        st.sampled_from(["gpu", "cpu", "memory"]), resource_quotas, max_size=3
                    ),
                ),
                max_size=2,
            )
        )
    )
    queues = draw(
        st.lists(
            st.builds(
                QueueConfig,
                name=dns_labels,
                cohort=opt(dns_labels),
                weight=floats(1e-3, 1e6).filter(lambda w: w > 0),
                strategy=st.sampled_from(["StrictFIFO", "BestEffortFIFO"]),
                quotas=quota_lists,
                preemption=st.builds(
                    PreemptionPolicy,
                    within_queue=st.sampled_from(["Never", "LowerPriority"]),
                    reclaim_within_cohort=st.sampled_from(["Never", "LowerPriority", "Any"]),
                ),
                reclaimable=st.booleans(),
                unlisted_resources=st.sampled_from(["unlimited", "zero"]),
            ),
            min_size=1,
            max_size=3,
            unique_by=lambda q: q.name,
        )
    )
    cohort_names = draw(st.lists(dns_labels, max_size=3, unique=True))
    cohorts = [
        CohortConfig(
            name=name,
            parent=draw(opt(st.sampled_from(cohort_names[:i]))) if i else None,
            quotas=draw(quota_lists) or [],
        )
        for i, name in enumerate(cohort_names)
    ]
    return BrokerConfig(
        subject_prefix=draw(st.from_regex(r"\A[a-z]{1,8}(\.[a-z]{1,8})?\Z")),
        queues=queues,
        cohorts=cohorts,
        flavors=flavors,
        timeouts=draw(st.builds(Timeouts, heartbeat_s=floats(1e-3, 60), lease_ttl_s=floats(1, 60))),
        scheduling=draw(st.builds(SchedulingConfig, risk_weight=floats(0, 100))),
        max_payload_bytes=draw(st.integers(1024, 64 * 2**20)),
    )
