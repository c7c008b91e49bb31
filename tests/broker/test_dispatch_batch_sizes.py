"""How one pass's Dispatches to a cluster are cut into DispatchBatches: in order, none lost,
within the count and byte bounds, one epoch a batch, and each batch decodes as the agent
reads it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.dispatchbatches import MAX_BATCH_BYTES, dispatch_batches
from schemas.agent import MAX_BATCH_DISPATCHES, Dispatch, DispatchBatch
from schemas.codec import decode_command, encode_msgpack
from schemas.wire import takes_dispatch_batches
from tests.agents.helpers import dispatch


def dispatches(epochs: list[int], nodes: list[int]) -> list[Dispatch]:
    return [
        dispatch(f"j{i}", [f"node-{i}-{k}" for k in range(n)], epoch=e)
        for i, (e, n) in enumerate(zip(epochs, nodes, strict=False))
    ]


@settings(max_examples=60, deadline=None)
@given(
    epochs=st.lists(st.integers(1, 3), min_size=1, max_size=40).map(sorted),
    nodes=st.lists(st.integers(1, 300), min_size=40, max_size=40),
    limit=st.sampled_from([2_000, 20_000, MAX_BATCH_BYTES]),
)
def test_batches_keep_every_dispatch_in_order_within_their_bounds(
    epochs: list[int], nodes: list[int], limit: int
) -> None:
    cmds = dispatches(epochs, nodes)
    out = list(dispatch_batches(cmds, limit=limit))
    assert [cmd for group, _ in out for cmd in group] == cmds
    for group, data in out:
        sent = decode_command(data)
        if len(group) == 1:  # alone, as an agent of any version reads it
            assert sent == group[0]
            continue
        assert isinstance(sent, DispatchBatch)
        assert sent.dispatches == group
        assert {cmd.epoch for cmd in group} == {sent.epoch}
        assert len(group) <= MAX_BATCH_DISPATCHES
        # A Dispatch larger than the bound alone still goes, in a batch of its own.
        assert len(group) == 1 or sum(len(encode_msgpack(c)) for c in group) <= limit


def test_many_small_dispatches_fill_batches_to_the_count() -> None:
    cmds = dispatches([1] * 600, [1] * 600)
    sizes = [len(group) for group, _ in dispatch_batches(cmds)]
    assert sizes == [MAX_BATCH_DISPATCHES, MAX_BATCH_DISPATCHES, 600 - 2 * MAX_BATCH_DISPATCHES]


def test_to_an_agent_without_batches_every_dispatch_goes_alone() -> None:
    cmds = dispatches([1] * 5, [2] * 5)
    out = list(dispatch_batches(cmds, most=1))
    assert [group for group, _ in out] == [[cmd] for cmd in cmds]
    assert [decode_command(data) for _, data in out] == cmds


def test_only_agents_of_wire_1_3_and_later_in_major_1_take_batches() -> None:
    assert [takes_dispatch_batches(v) for v in ("1.3", "1.4", "1.12")] == [True] * 3
    assert [takes_dispatch_batches(v) for v in ("", "1.0", "1.2", "2.3", "x")] == [False] * 5
