"""CPU a NATS message costs a Python client, received and published.

    python -m load.bench_nats_client [--messages 50000] [--size 250] [--runs 3]

What the broker's floor is made of: a job is about six messages in and nine out (docs/
benchmarks.md, "What bounds admissions now"), each through nats-py. Received: a child process
publishes `--messages` messages of `--size` bytes (paced, so no subscriber is cut off as a slow
consumer) and this process's subscription takes them; the figure is this process's CPU from
the first message to the last, a message. Published: this process publishes as many and
flushes; its CPU a message. Both for nats-py, the client the broker and the agents use, and
for natsrpy (a Rust client, through pyo3) when it is installed (`pip install natsrpy`), a
compiled client on PyPI; it is not a dependency. Raw NATS pub->sub throughput on the same
server is the baseline, measured in the same run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, NamedTuple

import nats
import typer

from broker.embedded import EmbeddedNats
from load.command import Count, JsonOut, Options, program, summary
from load.common import emit, median, raw_nats_baseline
from shell.natsio import flush

SUBJECT = "bench.client"
# The child that publishes what a client under test receives: nats-py, paced in slices so the
# subscriber's pending messages stay far below nats-server's slow-consumer limit.
PUBLISHER = """
import asyncio, sys, nats
async def main(url, subject, count, size, per_s):
    nc = await nats.connect(url)
    payload, loop = b"x" * size, asyncio.get_running_loop()
    start, step = loop.time(), 500
    for i in range(0, count, step):
        for _ in range(min(step, count - i)):
            await nc.publish(subject, payload)
        await nc.flush()
        await asyncio.sleep(max(0.0, start + (i + step) / per_s - loop.time()))
    await nc.flush()
    await nc.close()
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
"""
# Messages a second the child offers: well within what nats-py takes (it reads about 150,000
# a second), so the figure is the client's cost a message rather than its backlog's.
OFFERED_PER_S = 50_000.0


def cpu_s() -> tuple[float, float]:
    """(this process's CPU, the event loop thread's): a compiled client may spend its own
    threads' CPU besides what the loop's thread, the one the broker is bound by, spends."""
    return time.process_time(), time.thread_time()


class Cost(NamedTuple):
    process_s: float
    loop_thread_s: float


def per_message(start: tuple[float, float], end: tuple[float, float], count: int) -> Cost:
    return Cost(*((b - a) / count for a, b in zip(start, end, strict=True)))


async def _publisher(url: str, count: int, size: int, per_s: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", PUBLISHER, url, SUBJECT, str(count), str(size), str(per_s)
    )


async def _receive(
    subscribe: Callable[[Callable[[], None]], Awaitable[Callable[[], Awaitable[None]]]],
    url: str,
    count: int,
    size: int,
    per_s: float,
) -> Cost:
    """This process's CPU a received message, from the first to the last; `subscribe(on_msg)`
    subscribes and returns how to unsubscribe."""
    got = 0
    first_cpu = (0.0, 0.0)
    done: asyncio.Future[tuple[float, float]] = asyncio.get_running_loop().create_future()

    def on_msg() -> None:
        nonlocal got, first_cpu
        if got == 0:
            first_cpu = cpu_s()
        got += 1
        if got == count and not done.done():
            done.set_result(cpu_s())

    close = await subscribe(on_msg)
    child = await _publisher(url, count, size, per_s)
    try:
        # Bounded: a client that loses messages (a slow consumer cut off) fails, never hangs.
        last_cpu = await asyncio.wait_for(done, 60 + count / 200)
    except TimeoutError:
        raise SystemExit(
            f"received {got} of {count} messages: the subscription lost some"
        ) from None
    finally:
        await child.wait()
        await close()
    return per_message(first_cpu, last_cpu, max(count - 1, 1))


async def natspy_received(url: str, count: int, size: int, per_s: float) -> Cost:
    nc = await nats.connect(url)

    async def subscribe(on_msg: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        async def cb(_: Any) -> None:
            on_msg()

        await nc.subscribe(SUBJECT, cb=cb, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await flush(nc)
        return nc.close

    return await _receive(subscribe, url, count, size, per_s)


async def natsrpy_received(url: str, count: int, size: int, per_s: float) -> Cost:
    from natsrpy import Nats  # type: ignore[import-not-found, unused-ignore]

    nc = Nats([url])
    await nc.startup()

    async def subscribe(on_msg: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        sub = await nc.subscribe(SUBJECT).detatch()  # its iterator: the documented form
        await nc.flush()

        async def read() -> None:
            async for _ in sub:
                on_msg()

        reader = asyncio.create_task(read())

        async def close() -> None:
            reader.cancel()
            await nc.shutdown()

        return close

    return await _receive(subscribe, url, count, size, per_s)


async def _published(
    publish: Callable[[str, bytes], Awaitable[Any]],
    flushed: Callable[[], Awaitable[Any]],
    count: int,
    size: int,
) -> Cost:
    """This process's CPU a message published with `publish`, the last one flushed."""
    payload = b"x" * size
    started = cpu_s()
    for _ in range(count):
        await publish(SUBJECT + ".out", payload)
    await flushed()
    return per_message(started, cpu_s(), count)


async def natspy_published(url: str, count: int, size: int) -> Cost:
    nc = await nats.connect(url)
    try:
        return await _published(nc.publish, lambda: flush(nc), count, size)
    finally:
        await nc.close()


async def natsrpy_published(url: str, count: int, size: int) -> Cost:
    from natsrpy import Nats  # type: ignore[import-not-found, unused-ignore]

    nc = Nats([url])
    await nc.startup()
    try:
        return await _published(nc.publish, nc.flush, count, size)
    finally:
        await nc.shutdown()


CLIENTS = {
    "nats-py": (natspy_received, natspy_published),
    "natsrpy": (natsrpy_received, natsrpy_published),
}


def installed(client: str) -> bool:
    return client == "nats-py" or importlib.util.find_spec(client) is not None


def _key(client: str, what: str) -> str:
    return f"{client.replace('-', '_')}_{what}_us"


async def main_async(args: Options) -> dict[str, Any]:
    asked = [args.client] if args.client else list(CLIENTS)
    clients = [c for c in asked if installed(c)]
    skipped = [c for c in asked if not installed(c)]
    figures: dict[str, list[float]] = {}
    async with EmbeddedNats() as server:
        baseline = await raw_nats_baseline(server.url)
        for i in range(args.runs):
            for client in clients:  # alternately, run by run
                received, published = CLIENTS[client]
                got = await received(server.url, args.messages, args.size, OFFERED_PER_S)
                sent = await published(server.url, args.messages, args.size)
                for what, cost in (("received", got), ("published", sent)):
                    figures.setdefault(_key(client, what), []).append(cost.process_s * 1e6)
                    figures.setdefault(_key(client, what + "_loop"), []).append(
                        cost.loop_thread_s * 1e6
                    )
                print(
                    f"  run {i + 1} {client}: CPU a message received {got.process_s * 1e6:.2f} us "
                    f"(the loop's thread {got.loop_thread_s * 1e6:.2f}), published "
                    f"{sent.process_s * 1e6:.2f} us ({sent.loop_thread_s * 1e6:.2f})"
                )
    result: dict[str, Any] = {
        "bench": "nats-client",
        "messages": args.messages,
        "size": args.size,
        "runs": args.runs,
        "raw_nats_msgs_per_s": round(baseline),
        "skipped_not_installed": skipped,
    }
    for key, values in figures.items():
        result[key] = round(median(values), 2)
        result[key + "_runs"] = [round(v, 2) for v in values]
    for client in clients:
        print(
            f"{client}: median {result[_key(client, 'received')]} us of CPU a received message "
            f"({result[_key(client, 'received_loop')]} on the loop's thread), "
            f"{result[_key(client, 'published')]} us a published one "
            f"({result[_key(client, 'published_loop')]}); raw NATS {baseline:,.0f} msgs/s"
        )
    for client in skipped:
        print(f"{client}: not installed, not measured")
    return result


app = program()

Client = Annotated[
    str | None,
    typer.Option("--client", help="measure only this client (nats-py or natsrpy)"),
]


@app.command(help=summary(__doc__))
def bench_nats_client(
    messages: Count = 50_000,
    size: Count = 250,
    runs: Count = 3,
    client: Client = None,
    json_out: JsonOut = None,
) -> None:
    if client is not None and client not in CLIENTS:
        raise typer.BadParameter(f"{client!r} is not one of {', '.join(CLIENTS)}")
    if client is not None and not installed(client):
        raise typer.BadParameter(f"{client} is not installed here: pip install {client}")
    options = Options(messages=messages, size=size, runs=runs, client=client)
    emit(asyncio.run(main_async(options)), json_out)


if __name__ == "__main__":
    app(prog_name="python -m load.bench_nats_client")
