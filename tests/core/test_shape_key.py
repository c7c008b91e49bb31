"""A gang's shape keys every memo a search is answered from: requests that differ in anything
that picks or orders pools, or that shapes the gang, have different shapes."""

from __future__ import annotations

import dataclasses

import pytest

from broker.core.assigner import pool_terms, shape_of
from broker.core.types import GangRequest, TopologyNeed
from tests.core.helpers import gang

BASE = gang("j", (2, 4), capacity="spot-then-on-demand", order=1)

# Each field a search reads besides the snapshot, and a value it does not have in BASE.
VARIANTS: dict[str, object] = {
    "podsets": gang("j", (3, 4), order=1).podsets,
    "gpu_types": frozenset({"a100"}),
    "capacity": "spot",
    "spot_exhausted": True,
    "checkpoint_interval_s": 600.0,
    "spot_ok": False,
    "speeds": (("a100", 2.0),),
    "avoid_pools": frozenset({("c1", "od")}),
    "min_replicas": {"p0": 1},
    "topology": TopologyNeed(required=("rack",)),
}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_requests_that_differ_in_a_search_term_differ_in_shape(field: str) -> None:
    other = dataclasses.replace(BASE, **{field: VARIANTS[field]})
    assert shape_of(other) != shape_of(BASE)


# Fields a search does not read from the shape: who and which attempt, the queue and
# priority (keys of their own beside the shape), the submission order, and which podsets are
# elastic (only the admission note of a search that succeeded reads it; failures are memoised);
# and what is derived from the podsets (`total_gpu`), which are a search term themselves.
NOT_SEARCH_TERMS = {
    "job_id",
    "attempt",
    "queue",
    "priority",
    "order",
    "elastic",
    "shape_memo",
    "total_gpu",
}


def test_every_request_field_is_a_search_term_or_named_as_not_one() -> None:
    fields = {f.name for f in dataclasses.fields(GangRequest)}
    assert fields - NOT_SEARCH_TERMS == set(VARIANTS)


def test_every_pool_term_is_in_the_shape() -> None:
    for field, value in VARIANTS.items():
        other = dataclasses.replace(BASE, **{field: value})
        if pool_terms(other) != pool_terms(BASE):
            assert shape_of(other) != shape_of(BASE), field


def test_a_requests_gpus_follow_its_podsets() -> None:
    """`total_gpu` is summed when a request is made; a request with other podsets is a new one
    (`dataclasses.replace`), and its total is summed again."""
    assert BASE.total_gpu == 2 * 4
    other = dataclasses.replace(BASE, podsets=VARIANTS["podsets"])
    assert other.total_gpu == 3 * 4
    assert dataclasses.replace(other, queue="q2").total_gpu == 3 * 4
