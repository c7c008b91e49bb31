"""A submission over NATS gets the same readable answer as a job file: the field's path, a
"did you mean" for a misspelt field, and the valid values of an enum."""

from __future__ import annotations

import pytest

from schemas.codec import DecodeError, decode_jobspec


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"name": "a", "gang": [{"name": "w", "gpus": 2}]}',
            "invalid JobSpec: gang[0].gpus: unknown field 'gpus'; did you mean 'gpu'? "
            "known fields: name, replicas, gpu, cpu, memory",
        ),
        (
            b'{"name": "a", "gang": [{"name": "w"}], "gpu_type": ["a100"]}',
            "invalid JobSpec: gpu_type: unknown field 'gpu_type'; did you mean 'gpu_types'?",
        ),
        (
            b'{"name": "a", "gang": [{"name": "w"}], "capacity": "cheap"}',
            "invalid JobSpec: capacity: Invalid enum value 'cheap'; valid values: any, "
            "on-demand, spot, spot-then-on-demand",
        ),
        (b'{"name": "a", "gang": [{"name": "w", "gpu": "x"}]}', "gang[0].gpu: Expected `int`"),
    ],
)
def test_jobspec_errors_name_the_field_and_the_fix(body: bytes, message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_jobspec(body)
    assert str(info.value).startswith(message) or message in str(info.value)
