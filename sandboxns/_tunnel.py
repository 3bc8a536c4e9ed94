"""CONNECT tunnels: the TLS ClientHello's server name, and the relay.

A tunnel carries the guest's own TLS to the upstream, end to end: the
gateway sees no plaintext, only the handshake's first message, which names
the server the guest wants (SNI). A tunnel to an allowed host whose
ClientHello names another one is domain fronting (a CDN routes by SNI or by
the encrypted Host header, not by the address connected to), so the gateway
reads the ClientHello before anything reaches the upstream; and a second
one, when the upstream answers the first with a HelloRetryRequest (TLS
1.3), as servers read the name in that one too.
"""

from __future__ import annotations

import trio

# A ClientHello is one handshake message, in as many records as it needs;
# real ones are a few hundred bytes to a few KiB (post-quantum key shares).
MAX_CLIENT_HELLO = 64 * 1024
_CHANGE_CIPHER_SPEC, _HANDSHAKE, _APPLICATION_DATA = 0x14, 0x16, 0x17
_CLIENT_HELLO, _SERVER_HELLO = 0x01, 0x02
# A ServerHello with this random asks for another ClientHello: a
# HelloRetryRequest (RFC 8446, 4.1.3).
_RETRY_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
_SERVER_NAME = 0x0000
_HOST_NAME = 0x00
_READ = 65536


class NotTLS(ValueError):
    """What came is not the TLS hello expected (a guest's ClientHello)."""


class HandshakeReader:
    """The first handshake message in a stream of TLS records, read as the
    bytes come: each byte is looked at once, however many pieces bring them
    (reading them all again for each piece would let a guest that sends a
    byte at a time make the gateway's work grow with the square of what it
    sends). The message must end where a record ends (RFC 8446, 5.1), and
    with the records before it fit in MAX_CLIENT_HELLO bytes.

    ``after_retry``: the message is a client's second ClientHello, which
    change_cipher_spec and early data records (TLS 1.3) may precede."""

    def __init__(self, message_type: int = _CLIENT_HELLO, after_retry: bool = False) -> None:
        self.data = bytearray()  # every byte fed
        self.message = bytearray()  # what of the message has come
        self.end = 0  # once the message is whole: where its last record ends in data
        self._type = message_type
        self._skipped = (_CHANGE_CIPHER_SPEC, _APPLICATION_DATA) if after_retry else ()
        self._position = 0  # how much of data has been read
        self._record_end = 0  # where the record being read ends
        self._skipping = False  # whether that record is one of those skipped

    def feed(self, chunk: bytes) -> bytes | None:
        """The message, once it is whole, else None. Raises NotTLS as soon
        as the bytes cannot be one."""
        self.data += chunk
        data = self.data
        while self._position < len(data):
            if self._position == self._record_end:
                header = data[self._position : self._position + 5]
                self._skipping = header[0] in self._skipped and not self.message
                if header[0] != _HANDSHAKE and not self._skipping:
                    raise NotTLS("not a TLS handshake record")
                if len(header) < 5:
                    break
                length = int.from_bytes(header[3:5])
                # An encrypted record may be 256 bytes over a plain one's limit.
                if header[1] != 3 or length == 0 or length > 2**14 + (256 if self._skipping else 0):
                    raise NotTLS("not a TLS handshake record")
                self._position += 5
                self._record_end = self._position + length
            taken = min(self._record_end, len(data))
            if not self._skipping:
                self.message += data[self._position : taken]
            self._position = taken
            if self._position > MAX_CLIENT_HELLO:
                raise NotTLS(f"more than {MAX_CLIENT_HELLO // 1024} KiB of records before a whole TLS hello")
            if len(self.message) >= 4:
                if self.message[0] != self._type:
                    raise NotTLS("not the TLS hello expected")
                needed = 4 + int.from_bytes(self.message[1:4])
                if len(self.message) > needed or (len(self.message) == needed and taken < self._record_end):
                    raise NotTLS("a TLS record that goes on past the hello")
                if len(self.message) == needed:
                    self.end = self._position
                    return bytes(self.message)
        return None


class RetryRequestReader:
    """Whether an upstream's first handshake message is a HelloRetryRequest,
    read as its bytes come."""

    def __init__(self) -> None:
        self._records = HandshakeReader(_SERVER_HELLO)

    def feed(self, chunk: bytes) -> bool | None:
        """True or False once known; None until enough bytes have come."""
        try:
            ended = self._records.feed(chunk) is not None
        except NotTLS:
            # No more of a ServerHello comes (the upstream sent an alert, or
            # more in its record): what came decides. The rest of its TLS is
            # for the guest to judge.
            ended = True
        start = self._records.message[:38]  # type, length, version, random
        if len(start) < 38 and not ended:
            return None
        return start[:1] == bytes([_SERVER_HELLO]) and start[6:] == _RETRY_RANDOM


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


def server_name(message: bytes) -> str | None:
    """The server name a whole ClientHello message asks for (lower case,
    without a trailing dot), or None if it names none. Raises NotTLS for
    one that names more than one, or a name that is not ASCII."""
    hello = _Reader(message[4:])
    hello.take(2 + 32)  # version, random
    hello.vector(1)  # session id
    hello.vector(2)  # cipher suites
    hello.vector(1)  # compression methods
    if hello.position == len(hello.data):
        return None  # no extensions at all
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
        return None
    try:
        name = names[0].decode("ascii")
    except UnicodeDecodeError:
        raise NotTLS("a server name that is not ASCII") from None
    return name.lower().removesuffix(".")


def client_hello_server_name(data: bytes) -> tuple[bool, str | None]:
    """Read a ClientHello from the first bytes a guest sent into a tunnel:
    (False, None) while it is not whole yet; (True, the server name it asks
    for, or None if it names none). Raises NotTLS for anything else. The
    same as feeding the bytes to a HandshakeReader in any pieces."""
    message = HandshakeReader().feed(data)
    return (False, None) if message is None else (True, server_name(message))


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
