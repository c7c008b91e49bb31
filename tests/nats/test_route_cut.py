"""Routes between NATS servers cut under a leader and its standby (the case broker/lease.py
argues): three real nats-servers whose cluster routes run through a TCP proxy in this process,
the leader connected to n0, the standby to n1, the lease bucket R3. What the code guarantees,
and these tests hold it to: at no moment do two brokers act as leader (lead with their lease
proven, which is what lets a broker write records and send commands).

- n0<->n1 cut: the standby's server no longer sees the leader's subscription, so its probes get
  "no responders", but the leader's renewals still reach the bucket (led from n2 here) and the
  standby's watch through n2. The standby does not take the key; the leader keeps it at the
  same epoch. Renewals do not all reach the watch while routes change (with the bucket led
  wherever JetStream put it, one run's standby saw none for a whole cut). A standby that sees
  none for half a TTL takes the key by compare-and-set, and the leader learns it at its next
  renewal and steps down (the case broker/lease.py allows for a leader wrongly taken for
  dead); the test accepts that outcome only with the old leader not acting once the new one
  leads.
- n0 cut from both peers: the leader's first renewal after the cut finds no stream and it
  suspends (stops writing and sending) at once, a quarter of a TTL at most after its last
  renewal; the standby, having seen no renewal for half a TTL, takes the key at a higher epoch.
  When the routes come back, one of them leads, at an epoch above the old leader's: the old
  leader's renewal finds the key not its own and it steps down, or, when the new leader was
  suspended past its TTL while Raft leaders moved, recreates the expired key after the gap,
  steps down and wins it back as a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
from nats.aio.client import Client

from broker.embedded import free_port
from broker.liveness import DeathWatch
from broker.service import Broker
from load.natscluster import ClusterServer, NatsCluster
from schemas.config import Replication
from schemas.subjects import Subjects
from tests.handover import in_process
from tests.nats.world import cluster_config
from tests.support import wait_for

TTL_S = 8.0  # a probe decides after half of it; the lease expires only after all of it
CUT_S = 2 * TTL_S  # past half a TTL (a takeover) and past a whole one (the key expiring)
SAMPLE_S = 0.02


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


class Link:
    """One direction of a route: a local port that forwards to a server's route port, and
    can be cut (every connection through it reset, new ones refused) and restored."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.cut = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._open |= pair
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            self._open -= pair

    def sever(self) -> None:
        self.cut = True
        for writer in list(self._open):
            writer.transport.abort()

    async def stop(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class ProxiedServer(ClusterServer):
    """A member whose routes to its peers go through `links` (peer name -> link), and that
    advertises a port nobody listens on, so that no server dials a peer around the proxy."""

    def __init__(self, name: str, root: Path, tags: list[str]) -> None:
        super().__init__(name, root, tags)
        self.links: dict[str, Link] = {}
        self.nowhere = free_port()

    def config(self, peers: list[ClusterServer]) -> str:
        text = super().config(peers)
        for peer in peers:
            if peer.name in self.links:
                text = text.replace(
                    f'127.0.0.1:{peer.route_port}"', f'127.0.0.1:{self.links[peer.name].port}"'
                )
        listen = f"listen: 127.0.0.1:{self.route_port}, "
        return text.replace(listen, f'{listen}advertise: "127.0.0.1:{self.nowhere}", ')


@contextlib.asynccontextmanager
async def proxied_cluster() -> AsyncIterator[tuple[NatsCluster, dict[tuple[str, str], Link]]]:
    """Three members, every route through a `Link` of this process: (from, to) -> link."""
    cluster = NatsCluster()
    cluster.servers = [ProxiedServer(f"n{i}", cluster.root, [f"node:n{i}"]) for i in range(3)]
    links: dict[tuple[str, str], Link] = {}
    try:
        for a in cluster.servers:
            for b in cluster.servers:
                if a is not b:
                    link = links[a.name, b.name] = Link(b.route_port)
                    await link.start()
                    assert isinstance(a, ProxiedServer)
                    a.links[b.name] = link
        cluster.start_all()
        await cluster.ready(timeout=60)  # three servers and six proxied routes on a busy machine
        yield cluster, links
    finally:
        cluster.cleanup()
        for link in links.values():
            await link.stop()


def routed(server: ClusterServer, peer: str) -> bool:
    """Whether `server` has a route to `peer` now (its monitoring endpoint's word)."""
    routez = server.monitor("/routez") or {}
    return any(r.get("remote_name") == peer for r in routez.get("routes") or [])


def acting(broker: Broker) -> bool:
    """Leading with its lease proven: what lets a broker write records and send commands."""
    return broker.leading.is_set() and broker.lease.proven.is_set()


def answered(death: DeathWatch) -> int:
    """Probes the leader answered (neither "no responders" nor late)."""
    return death.probes - death.no_responders - death.timeouts


async def never_two_leaders(leader: Broker, standby: Broker, seconds: float) -> None:
    """Watch both brokers for `seconds`: never both acting as leader."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        assert not (acting(leader) and acting(standby)), (
            f"two leaders: epochs {leader.lease.epoch} and {standby.lease.epoch}"
        )
        await asyncio.sleep(SAMPLE_S)


def cut(links: dict[tuple[str, str], Link], a: str, b: str, *, restore: bool = False) -> None:
    for link in (links[a, b], links[b, a]):
        if restore:
            link.cut = False
        else:
            link.sever()


async def lead_stream_on(nc: Client, stream: str, server: str) -> None:
    """Move the stream's Raft leader to `server` (JetStream's step-down, preferring it): where
    it sits decides which side of a cut route can still write the lease."""
    js = nc.jetstream()
    request = json.dumps({"placement": {"preferred": server}}).encode()

    async def there() -> bool:
        with contextlib.suppress(Exception):
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader == server:
                return True
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=2)
        return False

    await wait_for(there, 60, what=f"{stream} led from {server}", interval=0.5)


@contextlib.asynccontextmanager
async def leader_and_standby() -> AsyncIterator[
    tuple[NatsCluster, dict[tuple[str, str], Link], Broker, Broker]
]:
    """The cluster, its links, a leader on n0 and a standby on n1 whose probes it answers."""
    async with proxied_cluster() as (cluster, links):
        n0, n1, n2 = cluster.servers
        prefix = f"r{uuid.uuid4().hex[:10]}"
        config = cluster_config(prefix, Replication(replicas=3), lease_ttl_s=TTL_S)
        async with in_process(config, n0.url, "leader") as leader:
            await asyncio.wait_for(leader.leading.wait(), 60)
            nc = await nats.connect(n2.url)
            try:  # the lease bucket led from n2, which no cut here touches
                await lead_stream_on(nc, f"KV_{Subjects(prefix=prefix).leader_bucket}", n2.name)
            finally:
                await nc.close()
            async with in_process(config, n1.url, "standby") as standby:
                await wait_for(lambda: standby.lease.renewals_seen >= 1, 30, what="the watch")
                # Answered across the route. The first probes may find nobody: the leader's
                # subscription reaches n1's interest graph a moment after the standby starts.
                death = standby.lease.death
                assert death is not None
                await wait_for(lambda: answered(death) >= 10, 30, what="probes answered")
                yield cluster, links, leader, standby


def state(leader: Broker, standby: Broker) -> str:
    """Both brokers' leadership, for a failing assertion's message."""
    return ", ".join(
        f"{b.lease.holder}: leading={b.leading.is_set()} proven={b.lease.proven.is_set()} "
        f"epoch={b.lease.epoch} taken={b.lease.taken_from_dead} "
        f"suspensions={b.lease.suspensions} renewals_seen={b.lease.renewals_seen}"
        for b in (leader, standby)
    )


async def cut_off(
    cluster: NatsCluster,
    links: dict[tuple[str, str], Link],
    leader: Broker,
    standby: Broker,
    peers: tuple[str, ...],
) -> bool:
    """Cut n0 (the leader's server) from `peers` for `CUT_S`, then restore the routes. Never
    two brokers act as leader. Either the leader keeps acting at its epoch throughout, or the
    standby took the key at a higher epoch while the leader, suspended, did not act, and the
    old leader steps down once the routes return. True when the standby took over."""
    n0 = cluster.servers[0]
    epoch = leader.lease.epoch
    for peer in peers:
        cut(links, "n0", peer)
    await wait_for(lambda: not any(routed(n0, p) for p in peers), 30, what="the cut")
    await never_two_leaders(leader, standby, CUT_S)
    taken = standby.lease.epoch > epoch
    if taken:
        assert standby.leading.is_set() and not acting(leader), state(leader, standby)
    else:
        assert acting(leader) and leader.lease.epoch == epoch, state(leader, standby)
        assert not standby.leading.is_set(), state(leader, standby)
    for peer in peers:
        cut(links, "n0", peer, restore=True)
    # One of them acts again, maybe after a suspension while the returning routes move Raft
    # leaders about. It may be the old leader: a new one suspended past its TTL lets the key
    # expire, the old one's renewal recreates it after the gap, steps down and wins it back
    # as a standby, at a newer epoch.
    await wait_for(lambda: acting(leader) != acting(standby), 60, what="one leader acting")
    await never_two_leaders(leader, standby, TTL_S / 2)
    now = leader if acting(leader) else standby
    assert now.lease.epoch > epoch if taken else now.lease.epoch >= epoch, state(leader, standby)
    return taken


async def test_a_cut_route_between_leader_and_standby_keeps_the_leader() -> None:
    """The standby's probes get "no responders" across the cut; it does not take the key
    while the leader's renewals reach it through n2. (If a renewal does not reach its watch,
    it may take the key by compare-and-set: then the leader, whose renewals were refused,
    must not act, which `cut_off` holds it to.)"""
    async with leader_and_standby() as (cluster, links, leader, standby):
        death = standby.lease.death
        assert death is not None
        unanswered, seen = death.no_responders, standby.lease.renewals_seen
        taken = await cut_off(cluster, links, leader, standby, ("n1",))
        assert death.no_responders >= unanswered + 10  # nobody held the subscription for n1
        if not taken:
            # Renewals reached its watch through n2 (not each one: the watch's consumer may
            # be reset while its routes change).
            assert standby.lease.renewals_seen > seen, state(leader, standby)
            before = answered(death)
            await wait_for(lambda: answered(death) >= before + 3, 30, what="answers again")


async def test_a_leader_cut_off_from_every_peer_suspends_before_the_standby_takes_over() -> None:
    async with leader_and_standby() as (cluster, links, leader, standby):
        assert await cut_off(cluster, links, leader, standby, ("n1", "n2"))
        assert leader.lease.suspensions >= 1 and standby.lease.taken_from_dead == 1
