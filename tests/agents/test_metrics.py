"""The agent's Prometheus endpoint, scraped over HTTP from a running agent."""

from __future__ import annotations

import aiohttp

from agents.metrics import AgentMetrics
from tests.agents.conftest import MakeAgent
from tests.agents.helpers import dispatch


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_runtime_counters_and_queues_are_served_on_loopback(make_agent: MakeAgent) -> None:
    a = await make_agent()
    await a.wire.wait_for(lambda: a.wire.batches)
    nodes = a.cluster.nodes_of("spot-a100")[:1]
    ack = await a.wire.send(dispatch("job-m", nodes))
    assert ack.ok, ack.error
    metrics = AgentMetrics(lambda: {a.name: a.runtime})
    port = metrics.serve(0)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
            samples = _samples(await resp.text())
    finally:
        metrics.close()
    c = f'cluster="{a.name}"'
    assert samples[f'muster_agent_runtime_total{{{c},counter="commands"}}'] == 1
    assert samples[f'muster_agent_runtime_total{{{c},counter="snapshots"}}'] >= 1
    assert samples[f'muster_agent_runtime_total{{{c},counter="fenced"}}'] == 0
    assert f"muster_agent_queued_events{{{c}}}" in samples
    assert f"muster_agent_outbox_events{{{c}}}" in samples
    assert samples[f"muster_agent_stale_seconds{{{c}}}"] == 0  # the fake backend can go stale
    assert not [k for k in samples if k.startswith("muster_agent_bad_input")]
