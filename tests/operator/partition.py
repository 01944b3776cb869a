"""A TCP relay that can cut one client off from the API server, as a network partition would.

    client (an operator) ──► Relay ──► CountingProxy ──► kube-apiserver

`cut()` closes every open connection and makes new ones hang: they are accepted, and what the
client sends is read and dropped, never forwarded (so nothing the client sent during the cut can
reach the API server later). `heal()` forwards again. Each operator of a failover test has its own
relay, so one replica can be partitioned while the other is not.
"""

from __future__ import annotations

import asyncio
import threading

import yaml


class Relay:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = 0
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="partition-relay", daemon=True)

    def __enter__(self) -> "Relay":
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def write_kubeconfig(self, path) -> object:
        config = {"apiVersion": "v1", "kind": "Config",
                  "clusters": [{"name": "relayed", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
                  "users": [{"name": "relayed", "user": {}}],
                  "contexts": [{"name": "relayed", "context": {"cluster": "relayed", "user": "relayed"}}],
                  "current-context": "relayed"}
        path.write_text(yaml.safe_dump(config))
        return path

    def cut(self) -> None:
        """Returns once every open connection is closed."""
        async def drop_all():
            self._cut = True
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
        asyncio.run_coroutine_threadsafe(drop_all(), self._loop).result(10)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_cut", False)

    # ---- the relay ----

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        server.close()
        self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            await self._swallow(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not self._cut:
                data = await reader.read(65536)
                if not data or self._cut:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection made during the cut: read and drop until the client gives up."""
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()
