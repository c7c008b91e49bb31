"""API views with every field filled, for the CLI's formatting tests."""

from __future__ import annotations

from schemas.api import (
    Accounting,
    AttemptView,
    CheckpointView,
    ClusterView,
    FlavorUsage,
    FlavorView,
    JobView,
    QueueView,
    ResourceUsage,
)

NOW = 1_700_000_000.0


def sample_job(job_id: str = "train-1", state: str = "running") -> JobView:
    """A job with two attempts (one preempted), accounting and a checkpoint."""
    return JobView(
        job_id=job_id,
        name="train",
        queue="ml",
        state=state,  # type: ignore[arg-type]
        priority=5,
        submitted_at=NOW - 7200,
        gpus=16,
        attempt=2,
        cluster="gcp-west",
        flavor="a100-od",
        latest_checkpoint=CheckpointView(
            step=1200, uri="s3://ckpt/train/1200", at=NOW - 60, attempt=2
        ),
        attempts=[
            AttemptView(
                attempt=1,
                cluster="aws-east",
                flavor="a100-spot",
                capacity_type="spot",
                gpu_type="a100",
                dispatched_at=NOW - 7000,
                running_at=NOW - 6900,
                ended_at=NOW - 3600,
                end_cause="preempted",
                gpu_seconds=16 * 3300.0,
                gpu_seconds_lost=16 * 300.0,
                cost=40.0,
            ),
            AttemptView(
                attempt=2,
                cluster="gcp-west",
                flavor="a100-od",
                capacity_type="on-demand",
                gpu_type="a100",
                dispatched_at=NOW - 3590,
                running_at=NOW - 3500,
                resume_from_step=1000,
                gpu_seconds=16 * 3500.0,
                cost=150.0,
            ),
        ],
        accounting=Accounting(
            attempts=2,
            preemptions=1,
            gpu_seconds_used=16 * 6800.0,
            gpu_seconds_lost=16 * 300.0,
            goodput=0.956,
            cost=190.0,
        ),
    )


def sample_queue() -> QueueView:
    return QueueView(
        name="ml",
        cohort="research",
        strategy="BestEffortFIFO",
        weight=2.0,
        pending=3,
        admitted=1,
        dominant_share=0.5,
        flavors=[
            FlavorUsage(
                flavor="a100-od",
                resources=[
                    ResourceUsage(
                        resource="gpu", nominal=8, borrowing_limit=4, used=12, borrowed=4
                    ),
                    ResourceUsage(resource="cpu", nominal=64000, used=32000),
                    ResourceUsage(resource="memory", nominal=256 * 2**30, used=64 * 2**30),
                ],
            )
        ],
    )


def sample_cluster() -> ClusterView:
    return ClusterView(
        name="aws-east",
        health="healthy",
        last_heartbeat=NOW - 1,
        running_jobs=4,
        flavors=[
            FlavorView(
                name="a100-spot",
                capacity_type="spot",
                gpu_type="a100",
                price_per_gpu_hour=1.1,
                flavor_class="spot-a100",
                nodes=20,
                gpu_total=160,
                gpu_free=24,
                draining_nodes=1,
                interruptions=7,
                interruption_rate_per_node_hour=0.61,
            ),
            FlavorView(
                name="a100-od",
                capacity_type="on-demand",
                gpu_type="a100",
                price_per_gpu_hour=3.2,
                flavor_class="od-a100",
                nodes=4,
                gpu_total=32,
                gpu_free=8,
            ),
        ],
    )
