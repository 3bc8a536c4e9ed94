"""Loopback HTTP(S) servers standing in for the upstreams of the egress
gateway tests. Each records what reached it, so a test can check both what
an allowed upstream received and that a refused one saw nothing at all."""

from __future__ import annotations

import contextlib
import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import h11
import trio

Reply = tuple[int, list[tuple[str, str]], bytes]


@dataclass
class Received:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    # Every header line as it came, in order, repeats included.
    fields: list[tuple[str, str]]


def default_reply(request: Received) -> Reply:
    return 200, [("content-type", "text/plain")], f"hello from upstream: {request.method} {request.target}".encode()


@dataclass
class Upstream:
    """One server. ``reply`` decides the answer; while ``hold`` is set,
    answers wait for it (for tests of slow upstreams)."""

    scheme: str
    port: int = 0
    connections: int = 0
    requests: list[Received] = field(default_factory=list)
    reply: Callable[[Received], Reply] = default_reply
    hold: trio.Event | None = None
    waiting: int = 0
    waiting_changed: trio.Event = field(default_factory=trio.Event)

    @property
    def origin(self) -> str:
        return f"{self.scheme}://localhost:{self.port}"

    @property
    def host(self) -> str:
        return f"localhost:{self.port}"

    async def wait_for_waiting(self, count: int) -> None:
        while self.waiting < count:
            await self.waiting_changed.wait()

    async def serve(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        connection = h11.Connection(h11.SERVER)
        body = b""
        request = None
        async with stream:
            try:
                while True:
                    event = connection.next_event()
                    if event is h11.NEED_DATA:
                        connection.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
            except (h11.RemoteProtocolError, trio.BrokenResourceError):
                return
            # Latin-1: a header value may carry any byte a guest sent.
            fields = [(name.decode(), value.decode("latin-1")) for name, value in request.headers]
            received = Received(request.method.decode(), request.target.decode(), dict(fields), body, fields)
            self.requests.append(received)
            if self.hold is not None:
                self.waiting += 1
                self.waiting_changed.set()
                self.waiting_changed = trio.Event()
                await self.hold.wait()
            status, headers, content = self.reply(received)
            headers = [*headers, ("content-length", str(len(content))), ("connection", "close")]
            # The gateway may hang up mid-answer (an oversized body).
            with trio.move_on_after(5), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)))
                if received.method != "HEAD":  # an answer to HEAD has the length of a body but none
                    await stream.send_all(connection.send(h11.Data(data=content)))
                await stream.send_all(connection.send(h11.EndOfMessage()))


async def start_upstream(nursery: trio.Nursery, scheme: str, server_context: ssl.SSLContext | None = None) -> Upstream:
    upstream = Upstream(scheme)
    if scheme == "https":
        serve = functools.partial(trio.serve_ssl_over_tcp, upstream.serve, 0, server_context, host="127.0.0.1")
    else:
        serve = functools.partial(trio.serve_tcp, upstream.serve, 0, host="127.0.0.1")
    [listener] = await nursery.start(serve)
    socket = listener.transport_listener.socket if scheme == "https" else listener.socket
    upstream.port = socket.getsockname()[1]
    return upstream
