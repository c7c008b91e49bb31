"""`NatsOptions`: the keyword arguments for `nats.connect`."""

from __future__ import annotations

from schemas.natsopts import NatsOptions


def test_connect_kwargs_split_servers() -> None:
    kwargs = NatsOptions(url="nats://127.0.0.1:1, nats://127.0.0.1:2", user="u").connect_kwargs()
    assert kwargs["servers"] == ["nats://127.0.0.1:1", "nats://127.0.0.1:2"]
    assert kwargs["user"] == "u" and "tls" not in kwargs
