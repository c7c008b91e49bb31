"""The decoders of the job bucket's non-job keys never raise: a damaged attempt marker or epoch
record must neither stop the intake nor keep every broker from leading."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from broker.attempts import AttemptMarker, attempts_of
from broker.lease import EpochRecord, epoch_of

stamps = st.integers(min_value=0, max_value=2**63 - 1)


@given(st.binary(max_size=200) | st.none(), stamps)
def test_any_marker_bytes_count_zero_or_more(data: bytes | None, stored_ns: int) -> None:
    assert attempts_of(data, stored_ns) >= 0


@given(st.integers(min_value=1, max_value=1_000_000), stamps, stamps)
def test_a_marker_counts_only_for_its_own_message(attempts: int, mine: int, other: int) -> None:
    data = msgspec.json.encode(AttemptMarker(attempts=attempts, stored_ns=mine))
    assert attempts_of(data, mine) == attempts
    assert attempts_of(data, other) == (attempts if other == mine else 0)


@given(st.binary(max_size=200) | st.none())
def test_any_epoch_record_bytes_read_as_an_epoch(data: bytes | None) -> None:
    assert epoch_of(data) >= 0


@given(st.integers(min_value=0, max_value=2**53))
def test_an_epoch_record_round_trips(epoch: int) -> None:
    assert epoch_of(msgspec.json.encode(EpochRecord(epoch=epoch, holder="b"))) == epoch
