"""NATS over TLS and mTLS, as `deploy/nats/nats.conf` documents it (its commented `tls {}`
block, uncommented here) and as every Muster process connects (`NatsOptions`): a real
nats-server on 127.0.0.1 with certificates made by trustme for this test."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import trustme
from nats.aio.msg import Msg

from broker.client import MusterClient, MusterError
from broker.embedded import free_port, nats_server_binary
from schemas.natsopts import NatsOptions
from shell.natsio import flush
from tests.support import DEPLOY, listening

DEPLOY_CONF = DEPLOY / "nats" / "nats.conf"


def deploy_tls_block(certs: Path) -> str:
    """The commented `tls { ... }` block of deploy/nats/nats.conf, uncommented, with the
    Secret's mount path pointed at this test's files."""
    text = DEPLOY_CONF.read_text()
    match = re.search(r"^# tls \{\n(?:^#.*\n)*?^# \}\n", text, re.MULTILINE)
    assert match, "deploy/nats/nats.conf lost its commented tls block"
    block = "".join(line[2:] + "\n" for line in match.group(0).splitlines())
    return block.replace("/etc/nats/tls", str(certs))


class TlsWorld:
    def __init__(self, tmp: Path) -> None:
        self.ca = trustme.CA()
        self.certs = tmp / "tls"
        self.certs.mkdir()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        server.cert_chain_pems[0].write_to_path(str(self.certs / "tls.crt"))
        server.private_key_pem.write_to_path(str(self.certs / "tls.key"))
        self.ca.cert_pem.write_to_path(str(self.certs / "ca.crt"))
        client = self.ca.issue_cert("muster-agent-east")
        self.client_cert = tmp / "client.crt"
        self.client_key = tmp / "client.key"
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))
        self.port = free_port()
        self.url = f"tls://127.0.0.1:{self.port}"
        self.conf = tmp / "nats.conf"
        self.conf.write_text(f"listen: 127.0.0.1:{self.port}\n" + deploy_tls_block(self.certs))

    def options(self, *, client_cert: bool = True, ca: bool = True) -> NatsOptions:
        return NatsOptions(
            url=self.url,
            tls_ca=str(self.certs / "ca.crt") if ca else None,
            tls_cert=str(self.client_cert) if client_cert else None,
            tls_key=str(self.client_key) if client_cert else None,
        )


@pytest_asyncio.fixture
async def tls_world(tmp_path: Path) -> AsyncIterator[TlsWorld]:
    world = TlsWorld(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        nats_server_binary(),
        "-c",
        str(world.conf),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await listening(world.port)
        yield world
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def connect_once(opts: NatsOptions) -> nats.NATS:
    kwargs = opts.connect_kwargs()
    kwargs.update(allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    return await nats.connect(**kwargs)


async def test_mtls_round_trip_with_deploy_block(tls_world: TlsWorld) -> None:
    sub_nc = await connect_once(tls_world.options())
    pub_nc = await connect_once(tls_world.options())
    try:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def on_msg(msg: Msg) -> None:
            if not got.done():
                got.set_result(msg.data)

        await sub_nc.subscribe("muster.agent.east.events", cb=on_msg)
        await flush(sub_nc)
        await pub_nc.publish("muster.agent.east.events", b"over tls")
        assert await asyncio.wait_for(got, 5) == b"over tls"
        assert sub_nc.connected_url is not None and sub_nc.connected_url.scheme == "tls"
    finally:
        await sub_nc.close()
        await pub_nc.close()


async def test_without_client_certificate_the_server_refuses(tls_world: TlsWorld) -> None:
    """`verify: true` in the deploy block means mTLS: a client without a certificate fails."""
    with pytest.raises(Exception):  # noqa: B017 - nats-py raises per transport and version
        nc = await connect_once(tls_world.options(client_cert=False))
        await nc.close()


async def test_untrusted_server_is_refused_by_the_client(tls_world: TlsWorld) -> None:
    """Without `tls_ca` the client verifies against the system roots, which do not know this
    test CA: the connection fails instead of trusting an unknown server."""
    with pytest.raises(Exception):  # noqa: B017
        nc = await connect_once(tls_world.options(ca=False))
        await nc.close()


async def test_muster_client_error_names_the_url(tls_world: TlsWorld) -> None:
    """What `muster status --nats tls://...` prints without a client certificate."""
    with pytest.raises(MusterError, match=re.escape(tls_world.url)):
        async with MusterClient(tls_world.options(client_cert=False)):
            pass
