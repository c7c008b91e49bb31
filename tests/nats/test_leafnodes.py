"""GPU clusters behind leaf nodes, as deploy/ ships them: a three-server control cluster with
the generated accounts (`muster nats-config --leaf`) and an mTLS leafnode port, and two leaf
nodes (`render_leafnode`) that each hold one TLS connection out, authenticated by their
cluster's certificate alone. An agent on each leaf runs jobs the broker dispatches through the
links; one link is cut while its jobs finish and healed: no job and no outcome is lost, and
nothing runs twice."""

from __future__ import annotations

import re
import secrets
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest_asyncio
import trustme
from nats.aio.client import Client

from agents.fleet import Fleet, start_fake_fleet
from broker.embedded import free_ports, nats_server_binary
from broker.natsconfig import leaf_user, render, render_leafnode, render_leafnode_listener
from load.natscluster import NatsCluster
from schemas.config import Replication
from tests.nats.proxy import Link
from tests.nats.world import ClusterWorld, cluster_config, cluster_world, fake_agent
from tests.support import listening, wait_for

CLUSTERS = ("east", "west")


class Leaf:
    """One GPU cluster's leaf node: its own nats-server, reaching the control cluster only
    through `links` (one per control server)."""

    def __init__(self, cluster: str, root: Path, ca: trustme.CA, links: list[Link]) -> None:
        self.cluster = cluster
        self.port, http = free_ports(2)
        self.links = links
        tls = root / f"leaf-{cluster}"
        tls.mkdir()
        cert = ca.issue_cert(leaf_user(cluster))
        cert.cert_chain_pems[0].write_to_path(str(tls / "tls.crt"))
        cert.private_key_pem.write_to_path(str(tls / "tls.key"))
        ca.cert_pem.write_to_path(str(tls / "ca.crt"))
        self.conf = tls / "nats.conf"
        self.conf.write_text(
            render_leafnode(
                cluster,
                [link.url for link in links],
                tls_dir=str(tls),
                listen=f"127.0.0.1:{self.port}",
                http=f"127.0.0.1:{http}",
            )
        )
        self.log = tls / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self.conf)],
                env={"POD_NAME": f"leaf-{self.cluster}"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def start(self) -> None:
        self._spawn()
        await listening(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    async def cut(self) -> None:
        for link in self.links:
            await link.cut()

    async def heal(self) -> None:
        for link in self.links:
            await link.heal()


class Topology:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        certs = root / "control-tls"
        certs.mkdir()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        server.cert_chain_pems[0].write_to_path(str(certs / "tls.crt"))
        server.private_key_pem.write_to_path(str(certs / "tls.key"))
        self.ca.cert_pem.write_to_path(str(certs / "ca.crt"))
        self.listener = render_leafnode_listener(str(certs)).replace(
            "0.0.0.0:7422", "127.0.0.1:$LEAF_PORT"
        )
        # nats-server resolves an include against the including file's directory
        self.cluster = NatsCluster(extra=self.listener + 'include "accounts.conf"\n')
        self.leaves: dict[str, Leaf] = {}
        self.fleets: list[Fleet] = []
        self.conns: list[Client] = []

    def write_accounts(self, text: str, passwords: dict[str, str]) -> None:
        """The generated accounts, and their passwords in every member's environment."""
        for server in self.cluster.servers:
            server.dir.mkdir(parents=True, exist_ok=True)
            (server.dir / "accounts.conf").write_text(text)
            server.env = passwords

    async def start_leaves(self) -> None:
        for cluster in CLUSTERS:
            links = [Link(s.leaf_port) for s in self.cluster.servers]
            for link in links:
                await link.heal()
            leaf = self.leaves[cluster] = Leaf(cluster, self.root, self.ca, links)
            await leaf.start()

    async def start_agent(self, world: ClusterWorld, cluster: str, seed: int) -> Fleet:
        """The cluster's agent, connected to its local leaf node only (plain NATS inside the
        cluster), with the inbox prefix its leaf user may receive."""
        nc = await nats.connect(
            f"nats://127.0.0.1:{self.leaves[cluster].port}",
            inbox_prefix=f"_INBOX_agent-{cluster}",
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,
        )
        self.conns.append(nc)
        config = fake_agent(cluster, world.subjects, nodes=2, seed=seed)
        fleet = await start_fake_fleet(nc, [config], world.subjects)
        self.fleets.append(fleet)
        return fleet

    async def close(self) -> None:
        for fleet in self.fleets:
            await fleet.stop()
        for nc in self.conns:
            await nc.close()
        for leaf in self.leaves.values():
            leaf.stop()
            await leaf.cut()
        self.cluster.cleanup()


@pytest_asyncio.fixture
async def topology(tmp_path: Path) -> AsyncIterator[Topology]:
    topo = Topology(tmp_path)
    try:
        yield topo
    finally:
        await topo.close()


async def test_jobs_run_through_leaf_nodes_and_survive_a_cut_link(topology: Topology) -> None:
    topo = topology
    prefix = f"l{secrets.token_hex(5)}"
    config = cluster_config(prefix, Replication(replicas=1))
    accounts = render(config, CLUSTERS, leaves=CLUSTERS)
    passwords = {v: secrets.token_hex(8) for v in re.findall(r"\$(MUSTER_\w+_PASSWORD)", accounts)}
    topo.write_accounts(accounts, passwords)
    topo.cluster.users = {
        "broker": ("broker", passwords["MUSTER_BROKER_PASSWORD"]),
        "admin": ("admin", passwords["MUSTER_ADMIN_PASSWORD"]),
    }
    topo.cluster.start_all()
    await topo.cluster.ready()
    async with cluster_world(topo.cluster, config) as w:
        broker = await w.start_broker()
        await topo.start_leaves()
        east = await topo.start_agent(w, "east", seed=1)
        west = await topo.start_agent(w, "west", seed=2)

        def synced() -> bool:
            machine = broker.machine
            return machine is not None and all(
                c in machine.agents and machine.agents[c].synced for c in CLUSTERS
            )

        await wait_for(synced, 30, what="both agents synced through their leaf nodes")
        # Four jobs, two per cluster (each takes a whole 8-GPU node of the two per cluster),
        # long enough to be running when the link is cut.
        jobs = [f"leaf{i}" for i in range(4)]
        for job_id in jobs:
            await w.submit_until_accepted(job_id, steps=400)

        def placed() -> dict[str, str] | None:
            live = {
                job: name
                for fleet in (east, west)
                for name, c in fleet.clusters.items()
                for job, _ in c.live_workloads()
            }
            return live if len(live) == 4 else None

        where = await wait_for(placed, 30, what="all four jobs running")
        assert set(where.values()) == set(CLUSTERS)

        # Cut east's link; its jobs finish while the broker cannot hear them.
        await topo.leaves["east"].cut()
        cluster = east.clusters["east"]
        await wait_for(lambda: not cluster.live_workloads(), 30, what="east's jobs to finish")
        states = await w.states()
        assert all(states[j]["state"] != "succeeded" for j, c in where.items() if c == "east"), (
            "the broker heard of east's outcomes through a cut link"
        )
        await topo.leaves["east"].heal()

        finished = await w.all_accepted_succeeded(timeout=60)
        assert all(finished[j]["attempt"] == 1 for j in jobs), finished
        runs = {
            job: len(history)
            for fleet in (east, west)
            for c in fleet.clusters.values()
            for job, history in c.history.items()
        }
        assert runs == dict.fromkeys(jobs, 1)
