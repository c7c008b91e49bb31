"""A TCP link that can be cut and healed: the WAN between a GPU cluster's leaf node and the
control cluster. It forwards bytes untouched (TLS passes through end to end); cut, it drops
every connection and refuses new ones; healed, it listens on the same port again."""

from __future__ import annotations

import asyncio
import contextlib

from broker.embedded import free_port


class Link:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted so far

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    async def heal(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as a broken WAN path looks to both ends
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()
