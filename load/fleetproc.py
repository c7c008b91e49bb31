"""A benchmark's fake fleet in a process of its own, reporting each Dispatch it carries out.

    python -m load.fleetproc --nats URL --config fleet.json --acks SUBJECT

Run by `load.fleetbench.FleetProcess` (`python -m load.bench_e2e --fleet process`): the fake
agents of `fleet.json` (a `FleetConfig` as JSON) on one NATS connection, as in the benchmark
process, but off the load generator's event loop, so their own lateness (50 agents' commands,
heartbeats, fences and cycle collections) no longer delays the generator's publishes or its
clock. Each Dispatch the fleet carries out is stamped with `time.time()` (the generator stamps
its publishes with the same clock: one machine, CLOCK_REALTIME) and published, a batch per
`FLUSH_S`, on `SUBJECT` as JSON `[[job_id, attempt, cluster, at, resume_step], ...]`.

The cycle collector is frozen and off once the fleet is up, as `fleetbench.GcWatch` does in
the benchmark process: a run is bounded in time, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from pathlib import Path
from typing import Annotated

import msgspec
import nats
import typer

from agents.config import FleetConfig
from agents.fleet import start_fake_fleet, until_signal
from load.command import program, summary
from load.fleetbench import Acked, DispatchLog, encode_reports
from shell.logs import configure_logging
from shell.natsio import flush

FLUSH_S = 0.02  # how long a carried-out Dispatch may wait before it is reported


async def serve(url: str, config: FleetConfig, acks: str) -> None:
    """Run the fleet and report its dispatches until cancelled."""
    configure_logging("warning")  # the fleet's per-command logs are debug; keep them cheap
    nc = await nats.connect(
        url, pending_size=512 * 1024 * 1024, max_reconnect_attempts=3, connect_timeout=5
    )
    log = DispatchLog(clock=time.time)
    pending: list[Acked] = []
    log.listeners.append(pending.append)
    fleet = await start_fake_fleet(nc, config.clusters)
    log.hook(fleet)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        while True:
            await asyncio.sleep(FLUSH_S)
            if pending:
                batch, pending[:] = pending[:], []
                await nc.publish(acks, encode_reports(batch))
    finally:
        if pending:
            with contextlib.suppress(Exception):
                await nc.publish(acks, encode_reports(pending))
                await flush(nc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(fleet.stop(), 15)
        with contextlib.suppress(Exception):
            await nc.close()


app = program()


@app.command(help=summary(__doc__))
def fleetproc(
    nats_url: Annotated[str, typer.Option("--nats", help="the benchmark's nats-server")],
    config: Annotated[Path, typer.Option(help="the fleet: a FleetConfig as JSON")],
    acks: Annotated[str, typer.Option(help="subject the carried-out Dispatches go to")],
) -> None:
    fleet = msgspec.json.decode(config.read_bytes(), type=FleetConfig)
    asyncio.run(until_signal(serve(nats_url, fleet, acks)))


if __name__ == "__main__":
    app(prog_name="python -m load.fleetproc")
