"""CONNECT tunnels: the TLS ClientHello's server name, and the relay.

A tunnel carries the guest's own TLS to the upstream, end to end: the
gateway sees no plaintext, only the handshake's first message, which names
the server the guest wants (SNI). A tunnel to an allowed host whose
ClientHello names another one is domain fronting (a CDN routes by SNI or by
the encrypted Host header, not by the address connected to), so the gateway
reads the ClientHello before anything reaches the upstream.
"""

from __future__ import annotations

import trio

# A ClientHello is one handshake message, in as many records as it needs;
# real ones are a few hundred bytes to a few KiB (post-quantum key shares).
MAX_CLIENT_HELLO = 64 * 1024
_HANDSHAKE = 0x16
_CLIENT_HELLO = 0x01
_SERVER_NAME = 0x0000
_HOST_NAME = 0x00
_READ = 65536


class NotTLS(ValueError):
    """What the guest sent first is not a TLS ClientHello."""


def _handshake_message(data: bytes) -> bytes | None:
    """The first handshake message in TLS records ``data``, once whole
    (None while more records are needed)."""
    message = b""
    position = 0
    while position + 5 <= len(data):
        kind, major, length = data[position], data[position + 1], int.from_bytes(data[position + 3 : position + 5])
        if kind != _HANDSHAKE or major != 3 or length == 0 or length > 2**14:
            raise NotTLS("not a TLS handshake record")
        record = data[position + 5 : position + 5 + length]
        message += record
        if len(message) >= 4:
            needed = 4 + int.from_bytes(message[1:4])
            if message[0] != _CLIENT_HELLO or needed > MAX_CLIENT_HELLO:
                raise NotTLS("not a TLS ClientHello")
            if len(message) >= needed:
                return message[:needed]
        if len(record) < length:
            return None  # this record is not all here yet
        position += 5 + length
    if len(data) >= 1 and data[0] != _HANDSHAKE:
        raise NotTLS("not a TLS handshake record")
    return None


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.position = data, 0

    def take(self, count: int) -> bytes:
        if self.position + count > len(self.data):
            raise NotTLS("a truncated ClientHello")
        chunk = self.data[self.position : self.position + count]
        self.position += count
        return chunk

    def number(self, size: int) -> int:
        return int.from_bytes(self.take(size))

    def vector(self, length_size: int) -> _Reader:
        return _Reader(self.take(self.number(length_size)))


def client_hello_server_name(data: bytes) -> tuple[bool, str | None]:
    """Read a ClientHello from the first bytes a guest sent into a tunnel:
    (False, None) while it is not whole yet; (True, the server name it asks
    for, or None if it names none). Raises NotTLS for anything else."""
    message = _handshake_message(data)
    if message is None:
        if len(data) > MAX_CLIENT_HELLO + 5 * (MAX_CLIENT_HELLO // 2**14 + 1):
            raise NotTLS("a ClientHello over 64 KiB")
        return False, None
    hello = _Reader(message[4:])
    hello.take(2 + 32)  # version, random
    hello.vector(1)  # session id
    hello.vector(2)  # cipher suites
    hello.vector(1)  # compression methods
    if hello.position == len(hello.data):
        return True, None  # no extensions at all
    extensions = hello.vector(2)
    names = []
    while extensions.position < len(extensions.data):
        kind, body = extensions.number(2), extensions.vector(2)
        if kind != _SERVER_NAME:
            continue
        entries = body.vector(2)
        while entries.position < len(entries.data):
            name_type, name = entries.number(1), entries.vector(2).data
            if name_type == _HOST_NAME:
                names.append(name)
        if len(names) != 1:
            raise NotTLS("a ClientHello that names more than one server, or none in its server_name")
    if not names:
        return True, None
    try:
        name = names[0].decode("ascii")
    except UnicodeDecodeError:
        raise NotTLS("a server name that is not ASCII") from None
    return True, name.lower().removesuffix(".")


async def relay(
    guest: trio.abc.HalfCloseableStream, upstream: trio.abc.HalfCloseableStream, idle_timeout: float
) -> tuple[int, int]:
    """Copy both ways until both sides have ended their sending (each end
    passed on to the other as it comes), or until nothing has moved either
    way for ``idle_timeout`` seconds. Returns the bytes sent to the upstream
    and to the guest."""
    moved = [0, 0]
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + idle_timeout

        async def pump(source: trio.abc.HalfCloseableStream, sink: trio.abc.HalfCloseableStream, index: int) -> None:
            try:
                while chunk := await source.receive_some(_READ):
                    await sink.send_all(chunk)
                    moved[index] += len(chunk)
                    scope.deadline = trio.current_time() + idle_timeout
                await sink.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                scope.cancel()  # one side is gone: so is the tunnel

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, guest, upstream, 0)
            nursery.start_soon(pump, upstream, guest, 1)
    return moved[0], moved[1]
