"""The egress gateway: HTTP from a session's guests to exactly the allowed
origins, with the policy's credentials added on the way.

A session with an allow-list policy keeps its own network namespace (only
``lo``); the one way out is a Unix socket, bound into the guest at
``/run/sandboxns-network.sock``, whose other end is this host-side trio
server. A guest speaks plain HTTP/1.1 to it with the upstream named in
``Host`` (``curl --unix-socket /run/sandboxns-network.sock
http://api.example.com/x``), and for every request, on its own:

* the request is parsed strictly (h11, plus a check of the raw head that h11
  is lenient about: bare CR or LF, obs-fold, NUL, duplicate Content-Length,
  Content-Length with Transfer-Encoding), CONNECT, TRACE and Upgrade are
  refused, and anything ambiguous closes the connection;
* it must match exactly one allowed origin (scheme, host, effective port);
  an absolute-form target must name the same origin as ``Host``;
* a new upstream request is built from the parsed fields, never relayed as
  bytes: hop-by-hop headers go, the policy's headers replace the guest's of
  the same names, and a guest's own Cookie/Authorization never reach an
  origin that gets injected credentials;
* for https origins the host does TLS, verifying the upstream;
* a redirect is answered with 502 and never followed, so credentials are
  never re-sent elsewhere.

Header values exist only in host memory: never in the guest, on disk, in a
log record or in an error message. Each request leaves an audit record (see
:class:`AuditRecord`) on the ``sandboxns.gateway`` logger and on
:meth:`GatewayHub.audit_records` streams.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import h11
import trio

from ._intercept import SessionAuthority
from ._network import (
    CREDENTIAL_HEADERS,
    DEFAULT_PORTS,
    GATEWAY_SOCKET_NAME,
    AllowedOrigin,
    NetworkPolicy,
    Origin,
    canonical_host,
)
from ._routing import (
    Refusal,
    is_address,
    names_itself,
    refusal_to_connect,
    route_request,
    route_tunnel,
    route_within,
    split_authority,
)
from ._tunnel import HandshakeReader, NotTLS, RetryRequestReader, relay, server_name

MAX_CONCURRENT_REQUESTS = 16
MAX_BODY_BYTES = 1024 * 1024
REQUEST_DEADLINE = 30.0
# A guest gets this long to send a whole request, and a kept-alive
# connection may sit idle this long.
CLIENT_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADERS = 100
# How much of what a guest asked for an audit record keeps.
MAX_REQUESTED_CHARS = 256
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_READ = 65536
# Connections one session's gateway serves at once; more are closed at once.
# Each may hold a request and a response body, so this bounds its memory.
MAX_CONNECTIONS = 32
ACCEPT_BACKOFF = 0.1
_ACCEPT_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
# Closing after a refusal, how long and how much of the guest's unread input
# to drain first.
LINGER_TIMEOUT = 2.0
LINGER_BYTES = 4 * MAX_BODY_BYTES
# How long an upstream's resolved address is reused, and for how many
# upstreams at most (a guest may name any number of them).
ADDRESS_TTL = 30.0
MAX_ADDRESSES = 4096
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
# A CONNECT tunnel ends when nothing has moved either way for this long.
TUNNEL_IDLE_TIMEOUT = 60.0

logger = logging.getLogger("sandboxns.gateway")


@dataclass(frozen=True)
class AuditRecord:
    """One request through a gateway. Never holds a header value.

    ``origin`` is the allowed origin the request went to, None when it was
    refused before one matched; ``requested`` is what the guest asked to
    reach, as far as the gateway could read it (see :func:`_requested`)."""

    session_id: str
    origin: str | None
    method: str
    path: str
    status: int
    bytes_in: int
    bytes_out: int
    duration: float
    reason: str = ""
    requested: str = ""


async def _open_tcp(address: str, port: int) -> trio.SocketStream:
    """A TCP connection to one address: no resolver and no happy eyeballs
    (trio.open_tcp_stream's nursery of attempts), which are for names."""
    sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in address else trio.socket.AF_INET)
    try:
        await sock.connect((address, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


class GatewayHub:
    """What the gateways of one backend share: the concurrent-request
    limit, the TLS context for upstreams, the error callback, and the audit
    streams."""

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        on_error: Callable[[BaseException], object] | None = None,
        max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS,
    ) -> None:
        self.ssl_context = ssl_context or ssl.create_default_context()
        self.on_error = on_error
        self.limiter = trio.CapacityLimiter(max_concurrent_requests)
        # What one session's gateway may hold of it, so a second session is
        # still served while the first saturates its share.
        self.session_share = max(1, max_concurrent_requests // 2)
        self._subscribers: set[trio.MemorySendChannel] = set()
        self.dropped_records = 0
        # (host, port) -> (address that answered, until when to trust it)
        self._addresses: dict[tuple[str, int], tuple[str, float]] = {}

    async def connect(self, origin: Origin, named: bool) -> trio.SocketStream:
        """A TCP connection to an origin, at an address it may reach (see
        _routing.refusal_to_connect; ``named``: the policy names the host
        itself). The address that answered last time is tried first, so
        most requests skip the resolver (a worker-thread round trip); every
        address is judged as it is connected to, cached or not."""
        key = (origin.host, origin.port)
        known = self.known_address(origin, named)
        if known is not None:
            try:
                return await _open_tcp(known, origin.port)
            except OSError:
                pass
        self._addresses.pop(key, None)
        try:
            found = await trio.socket.getaddrinfo(origin.host, origin.port, type=trio.socket.SOCK_STREAM)
        except OSError as exc:
            raise Refusal(502, f"cannot resolve {origin.host}: {exc.strerror or exc}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in found))
        refusals = [refusal_to_connect(origin, ipaddress.ip_address(address), named) for address in addresses]
        reachable = [address for address, refusal in zip(addresses, refusals, strict=True) if refusal is None]
        if not reachable:
            raise Refusal(403, next(refusal for refusal in refusals if refusal))
        failure: OSError | None = None
        for address in reachable:
            try:
                stream = await _open_tcp(address, origin.port)
            except OSError as exc:
                failure = exc
                continue
            self._addresses.pop(key, None)
            if len(self._addresses) >= MAX_ADDRESSES:
                del self._addresses[next(iter(self._addresses))]  # the oldest
            self._addresses[key] = (address, time.monotonic() + ADDRESS_TTL)
            return stream
        raise Refusal(502, f"cannot connect to {origin}: {failure.strerror or failure}") from None

    def known_address(self, origin: Origin, named: bool) -> str | None:
        """The address an origin answered from lately, if it may still be
        connected to under this policy (see :meth:`connect`)."""
        known = self._addresses.get((origin.host, origin.port))
        if known is None or known[1] <= time.monotonic():
            return None
        return known[0] if refusal_to_connect(origin, ipaddress.ip_address(known[0]), named) is None else None

    def report_error(self, exc: BaseException) -> None:
        if self.on_error is None:
            logger.error("internal gateway error", exc_info=exc)
            return
        try:
            self.on_error(exc)
        except Exception:
            logger.exception("on_broker_error raised")

    def publish(self, record: AuditRecord) -> None:
        if logger.isEnabledFor(logging.INFO):
            self._log(record)
        for channel in list(self._subscribers):
            try:
                channel.send_nowait(record)
            except trio.WouldBlock:
                self.dropped_records += 1
            except trio.BrokenResourceError:
                self._subscribers.discard(channel)

    @staticmethod
    def _log(record: AuditRecord) -> None:
        logger.info(
            "%s %s %s%s -> %d (%d bytes in, %d out, %.1f ms)%s",
            record.session_id,
            record.method,
            record.origin or record.requested or "-",
            record.path,
            record.status,
            record.bytes_in,
            record.bytes_out,
            record.duration * 1000,
            f": {record.reason}" if record.reason else "",
            extra={"sandboxns_audit": asdict(record)},
        )

    @contextlib.asynccontextmanager
    async def audit_records(self, buffer: int = 1000) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """A stream of audit records from now on. A reader that falls more
        than ``buffer`` records behind loses the excess (counted in
        ``dropped_records``); the gateway never waits for it."""
        send, receive = trio.open_memory_channel(buffer)
        self._subscribers.add(send)
        try:
            async with receive:
                yield receive
        finally:
            self._subscribers.discard(send)
            send.close()


def check_raw_head(head: bytes) -> None:
    """What h11 tolerates but a gateway must not: a request head is CRLF
    lines of visible text, with no continuation lines and one unambiguous
    framing."""
    if b"\0" in head:
        raise Refusal(400, "NUL in the request head", close=True)
    lines = head[:-4].split(b"\r\n")
    if any(b"\r" in line or b"\n" in line for line in lines):
        raise Refusal(400, "bare CR or LF in the request head", close=True)
    if len(lines) - 1 > MAX_HEADERS:
        raise Refusal(431, f"more than {MAX_HEADERS} header fields", close=True)
    names = []
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise Refusal(400, "obsolete line folding in a header", close=True)
        names.append(line.split(b":", 1)[0].strip().lower())
    if names.count(b"content-length") > 1:
        raise Refusal(400, "more than one Content-Length", close=True)
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refusal(400, "both Content-Length and Transfer-Encoding", close=True)


def upstream_headers(allowed: AllowedOrigin, request: h11.Request) -> list[tuple[bytes, bytes]]:
    """The headers the upstream gets: the guest's, minus hop-by-hop and
    framing ones (the gateway frames the body itself), minus credentials
    where the policy injects its own, with the policy's headers set."""
    named_in_connection = set()
    for name, value in request.headers:
        if name == b"connection":
            named_in_connection |= {token.strip().lower() for token in value.split(b",")}
    injected = {name.encode() for name, _ in allowed.headers}
    drop = HOP_BY_HOP | {"host", "content-length", "expect"}
    headers = [(b"host", allowed.origin.host_header.encode())]
    for name, value in request.headers:
        text = name.decode("ascii")
        if text in drop or name in named_in_connection or name in injected:
            continue
        if allowed.injects_credentials and text in CREDENTIAL_HEADERS:
            continue
        headers.append((name, value))
    headers += [(name.encode(), value.encode("latin-1")) for name, value in allowed.headers]
    return headers


def _response_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]], close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, reason or b"")]
    lines += [name + b": " + value for name, value in headers]
    if close:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _plain_response(status: int, text: str, close: bool, head: bool = False) -> bytes:
    """The gateway's own answer. To a HEAD request (``head``) it has the
    length of its text but not the text: a client reads no body after the
    head of an answer to HEAD, so one would pass for the next answer."""
    body = f"sandboxns gateway: {text}\n".encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    phrase = {403: b"Forbidden", 405: b"Method Not Allowed", 413: b"Content Too Large", 503: b"Service Unavailable"}
    return _response_head(status, phrase.get(status, b"Error"), headers, close) + (b"" if head else body)


@dataclass
class UpstreamResponse:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Gateway:
    """One session's gateway: a Unix socket in a private host directory and
    the requests that arrive on it. :meth:`update` swaps the policy; every
    later request is judged by the new one."""

    def __init__(
        self, hub: GatewayHub, session_id: str, policy: NetworkPolicy, on_request: Callable[[], None] = lambda: None
    ) -> None:
        self._hub = hub
        self.session_id = session_id
        self.policy = policy
        self._on_request = on_request
        self.directory = Path(tempfile.mkdtemp(prefix="sandboxns-net-"))
        self.socket_path = self.directory / GATEWAY_SOCKET_NAME
        self._cancel = trio.CancelScope()
        self._done = trio.Event()
        self._connections = 0
        self._limiter = trio.CapacityLimiter(hub.session_share)
        # The cancel scopes of the CONNECT tunnels under way.
        self._tunnels: set[trio.CancelScope] = set()
        self._authority: SessionAuthority | None = None
        self.update(policy)

    def update(self, policy: NetworkPolicy) -> None:
        """Judge every later request by ``policy``, and end every tunnel
        opened under an earlier one: a tunnel is one grant, for as long as
        its connection lives."""
        if policy.intercepts and self._authority is None:
            # Made when first needed, and kept: the guest may already trust it.
            self._authority = SessionAuthority(self.session_id)
            self._authority.write_bundle(self.directory)
        self.policy = policy
        for tunnel in self._tunnels:
            tunnel.cancel()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._cancel:
                listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
                with listener:
                    await listener.bind(str(self.socket_path))
                    os.chmod(self.socket_path, 0o600)
                    listener.listen(64)
                    async with trio.open_nursery() as nursery:
                        self._nursery = nursery
                        task_status.started()
                        await self._accept(listener)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._done.set()

    async def _accept(self, listener: trio.socket.SocketType) -> None:
        """Serve every connection the listener gets, up to MAX_CONNECTIONS
        of this session's at once (the socket's and the proxy's together)."""
        while True:
            try:
                connection, _ = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_TRANSIENT:
                    raise
                # Out of fds or memory: wait rather than die.
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            if self._connections >= MAX_CONNECTIONS:
                connection.close()  # the guest sees the connection end at once
                continue
            self._connections += 1
            self._nursery.start_soon(self._serve, trio.SocketStream(connection))

    def serve_proxy(self, listeners: list[socket.socket]) -> trio.CancelScope:
        """Serve the session's proxy port: listening TCP sockets a sandbox
        process made in the session's network namespace and handed over
        (see csrc/net.c). They take the same requests as the Unix socket.
        Returns the scope that stops serving them; they are closed then."""
        scope = trio.CancelScope()
        sockets = [trio.socket.from_stdlib_socket(listener) for listener in listeners]

        async def accept() -> None:
            with contextlib.ExitStack() as stack, scope:
                for listener in sockets:
                    stack.enter_context(listener)
                async with trio.open_nursery() as nursery:
                    for listener in sockets:
                        nursery.start_soon(self._accept, listener)

        self._nursery.start_soon(accept)
        return scope

    async def aclose(self) -> None:
        self._cancel.cancel()
        await self._done.wait()

    async def _serve(self, stream: trio.SocketStream) -> None:
        """One guest connection: requests one after another, until either
        side closes it or a request says to. Nothing a guest does here may
        escape this task: that would stop every session's gateway."""
        try:
            async with stream:
                await self._requests(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass  # the guest hung up, or stopped reading its answers
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._report(exc)
        finally:
            self._connections -= 1

    async def _requests(self, stream: trio.abc.Stream, within: AllowedOrigin | None = None) -> None:
        """Requests on one connection, until it ends; ``within``: the route
        of the intercepted tunnel the connection is."""
        buffer = b""
        while True:
            if not buffer:
                # Between requests a connection may idle; a request, from
                # its first byte, has CLIENT_TIMEOUT to arrive whole.
                with trio.move_on_after(IDLE_TIMEOUT):
                    buffer = await stream.receive_some(_READ)
                if not buffer:
                    return  # idle, or gone
            with trio.move_on_after(CLIENT_TIMEOUT) as waiting:
                head, buffer = await self._read_head(stream, buffer)
            if waiting.cancelled_caught:
                await self._send(stream, _plain_response(408, "the request head took too long to arrive", close=True))
                return
            if head is None:
                return  # too large, or gone
            keep_alive, buffer = await self._handle(stream, head, buffer, within)
            if not keep_alive:
                await _linger(stream)
                return

    def _report(self, exc: BaseException) -> None:
        """Hand an internal error to the host, unless its text would carry
        one of the policy's header values: then only say that it did."""
        text = f"{exc!r} {exc}"
        if any(value and value in text for allowed in self.policy.allowed for _, value in allowed.headers):
            exc = RuntimeError(
                f"internal gateway error ({type(exc).__name__}; details withheld: they held a credential)"
            )
        self._hub.report_error(exc)

    async def _read_head(self, stream: trio.SocketStream, buffer: bytes) -> tuple[bytes | None, bytes]:
        while b"\r\n\r\n" not in buffer:
            if len(buffer) > MAX_HEAD_BYTES:
                await self._send(stream, _plain_response(431, "request head too large", close=True))
                return None, b""
            chunk = await stream.receive_some(_READ)
            if not chunk:
                return None, b""
            buffer += chunk
        end = buffer.index(b"\r\n\r\n") + 4
        if end > MAX_HEAD_BYTES:
            await self._send(stream, _plain_response(431, "request head too large", close=True))
            return None, b""
        return buffer[:end], buffer[end:]

    @staticmethod
    async def _send(stream: trio.SocketStream, data: bytes) -> None:
        """Write to the guest, which gets CLIENT_TIMEOUT to take it; a guest
        that does not read is not allowed to hold its buffers forever."""
        with trio.fail_after(CLIENT_TIMEOUT):
            await stream.send_all(data)

    async def _handle(
        self, stream: trio.abc.Stream, head: bytes, rest: bytes, within: AllowedOrigin | None = None
    ) -> tuple[bool, bytes]:
        """Answer one request; returns whether the connection stays open and
        the bytes already read past this request."""
        started = time.monotonic()
        method, path, origin_text, bytes_in, bytes_out = "-", "-", None, 0, 0
        # Until the request parses, what its request line names.
        words = head.split(b"\n", 1)[0].split()
        requested = _printable(words[1] if len(words) > 1 else b"")
        close = False
        self._on_request()
        try:
            check_raw_head(head)
            connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
            connection.receive_data(head)
            try:
                request = connection.next_event()
            except h11.RemoteProtocolError as exc:
                raise Refusal(_client_error(exc), f"malformed request: {exc}", close=True) from None
            if not isinstance(request, h11.Request):
                raise Refusal(400, "malformed request", close=True)
            method = request.method.decode("ascii", "replace")
            target = request.target.decode("ascii", "replace")
            path = _path_of(target)
            close = _wants_close(request)
            host = [value for name, value in request.headers if name == b"host"]
            requested = _requested(target, host)
            if request.method.upper() == b"CONNECT" and within is None:
                # After it, the connection is the tunnel's, refused or not.
                close, path = True, ""
                route = route_tunnel(self.policy, target)
                origin_text = str(route.origin)
                await self._tunnel(stream, route, rest, started, requested)
                return False, b""
            if request.method.upper() in (b"TRACE", b"CONNECT"):
                raise Refusal(405, f"{method} is not allowed through the gateway", close=True)
            if any(name == b"upgrade" for name, _ in request.headers):
                raise Refusal(400, "protocol upgrades are not allowed through the gateway", close=True)
            if len(host) != 1:
                raise Refusal(400, "the request needs exactly one Host header", close=True)
            try:
                asked = host[0].decode("ascii", "replace")
                if within is None:
                    allowed, upstream_target = route_request(self.policy, asked, target)
                else:
                    allowed, upstream_target = route_within(within, asked, target)
            except Refusal as refusal:
                # Refused before its body is read, so a refused request
                # never buffers one; with a body to skip, the connection ends.
                if _has_body(request):
                    refusal.close = True
                else:
                    _, rest = await self._read_body(stream, connection, rest)
                raise
            origin_text = str(allowed.origin)
            path = _path_of(upstream_target)
            body, rest = await self._read_body(stream, connection, rest)
            bytes_in = len(body)
            with self._request_slot():
                try:
                    with trio.fail_after(REQUEST_DEADLINE):
                        response = await self._exchange(allowed, request, upstream_target, body)
                except trio.TooSlowError:
                    raise Refusal(504, f"{origin_text} did not answer within {REQUEST_DEADLINE:g}s") from None
            if 300 <= response.status < 400 and response.status != 304:
                raise Refusal(502, f"{origin_text} answered {response.status}: redirects are not followed")
            headers = _end_to_end(response.headers)
            if request.method == b"HEAD" or response.status in (204, 304):
                data = b""
            else:
                headers = [(n, v) for n, v in headers if n != b"content-length"]
                headers.append((b"content-length", str(len(response.body)).encode()))
                data = response.body
            bytes_out = len(data)
            await self._send(stream, _response_head(response.status, response.reason, headers, close) + data)
            self._audit(method, origin_text, requested, path, response.status, bytes_in, bytes_out, started, "")
            return not close, rest
        except Refusal as refusal:
            # A refusal ends the connection if the guest asked for that too.
            close = refusal.close or close
            await self._send(stream, _plain_response(refusal.status, refusal.reason, close, head=method == "HEAD"))
            self._audit(method, origin_text, requested, path, refusal.status, bytes_in, 0, started, refusal.reason)
            return not close, rest
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            return False, b""  # the guest hung up or does not read its answers
        except Exception as exc:  # noqa: BLE001 - a bug must not reach the guest, only the host
            self._report(exc)
            await self._send(stream, _plain_response(502, "internal gateway error", close=True, head=method == "HEAD"))
            self._audit(method, origin_text, requested, path, 502, bytes_in, 0, started, "internal gateway error")
            return False, b""

    async def _tunnel(
        self, stream: trio.SocketStream, route: AllowedOrigin, early: bytes, started: float, requested: str
    ) -> None:
        """A CONNECT the policy allows (to an https origin): connect, say so,
        and relay TLS whose ClientHello names the host the CONNECT named."""
        origin = route.origin
        if route.injects_credentials:
            # Credentials go only into requests the gateway itself reads.
            # An https origin's requests are read inside the tunnel: the
            # gateway answers it with the session's CA (see _intercept.py).
            await self._intercept(stream, route, early, started, requested)
            return
        reason, moved, opened = "", [0, 0], False  # moved: bytes passed to the upstream, and to the guest
        failed = 403  # the status a reason ends the tunnel with
        with trio.CancelScope() as tunnel:
            self._tunnels.add(tunnel)
            try:
                # An origin that answered lately is answered for at once, and
                # the guest makes its ClientHello while the connection to the
                # upstream is made. Any other is connected to first, so that a
                # failure is an answer the guest reads (502, 504), not a tunnel
                # that closes.
                if self._hub.known_address(origin, names_itself(self.policy, origin)) is not None:
                    await self._send(stream, ESTABLISHED)
                    opened = True
                try:
                    upstream = await self._connect(origin)
                except Refusal as refusal:
                    if not opened:
                        raise
                    reason, failed = refusal.reason, refusal.status
                else:
                    async with upstream:
                        if not opened:
                            await self._send(stream, ESTABLISHED)
                            opened = True
                        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                            reason, early = await self._start_tls(stream, upstream, origin, early, moved)
                            if not reason:
                                await upstream.send_all(early)
                                moved[0] += len(early)
                                sent, received = await relay(stream, upstream, TUNNEL_IDLE_TIMEOUT)
                                moved[0], moved[1] = moved[0] + sent, moved[1] + received
            finally:
                self._tunnels.discard(tunnel)
        if tunnel.cancelled_caught:
            if not opened:
                raise Refusal(403, "the session's network policy changed while the tunnel was being opened")
            reason, failed = "the session's network policy changed", 403
        status = failed if reason else 200
        self._audit("CONNECT", str(origin), requested, "", status, *moved, started, reason)

    async def _intercept(
        self, stream: trio.SocketStream, route: AllowedOrigin, early: bytes, started: float, requested: str
    ) -> None:
        """A tunnel to an https origin that gets credentials: the gateway is
        its far end, with a certificate from the session's CA, and serves the
        requests in it as it serves plain ones (each sent on over its own
        verified TLS, with the policy's headers)."""
        origin = route.origin
        await self._send(stream, ESTABLISHED)
        hello = HandshakeReader()
        reason = await self._client_hello(stream, origin, hello, early, "TLS ClientHello")
        self._audit(
            "CONNECT", str(origin), requested, "", 403 if reason else 200, 0, 0, started, reason or "intercepted"
        )
        if reason:
            return
        context = self._authority.server_context(origin.host)
        guest = trio.SSLStream(_Replayed(stream, bytes(hello.data)), context, server_side=True, https_compatible=True)
        # Its requests are judged by the route of the policy it was opened
        # under: a new policy ends it, as it ends a blind tunnel.
        with trio.CancelScope() as tunnel:
            self._tunnels.add(tunnel)
            try:
                with trio.fail_after(CLIENT_TIMEOUT):
                    await guest.do_handshake()
                await self._requests(guest, within=route)
            except (trio.BrokenResourceError, trio.TooSlowError):
                pass  # the guest gave up on the handshake (it may not trust the CA), or went away
            finally:
                self._tunnels.discard(tunnel)
                await trio.aclose_forcefully(guest)

    async def _connect(self, origin: Origin) -> trio.SocketStream:
        """A connection to a tunnel's upstream, made within the request
        deadline (as a plain request's is)."""
        try:
            with trio.fail_after(REQUEST_DEADLINE):
                return await self._hub.connect(origin, names_itself(self.policy, origin))
        except trio.TooSlowError:
            raise Refusal(504, f"{origin} did not answer within {REQUEST_DEADLINE:g}s") from None

    async def _start_tls(
        self, stream: trio.SocketStream, upstream: trio.SocketStream, origin: Origin, data: bytes, moved: list[int]
    ) -> tuple[str, bytes]:
        """Pass the guest's ClientHello to the upstream once it names the
        CONNECT's host, and, if the upstream asks for another one (a TLS 1.3
        HelloRetryRequest), that one once it does too: a server reads the
        second one's name as well (OpenSSL picks its certificate by it).
        Until the upstream's answer to the first has come, the guest's next
        bytes wait. Returns why the tunnel must end ("" if it may go on) and
        what the guest sent after its hello; counts the bytes passed in
        ``moved``."""
        hello = HandshakeReader()
        reason = await self._client_hello(stream, origin, hello, data, "TLS ClientHello")
        if reason:
            return reason, b""
        await upstream.send_all(hello.data[: hello.end])
        moved[0] += hello.end
        retry, asked = RetryRequestReader(), None
        with trio.move_on_after(TUNNEL_IDLE_TIMEOUT):
            while asked is None:
                chunk = await upstream.receive_some(_READ)
                if not chunk:
                    break  # the upstream ended; the relay passes that on
                await stream.send_all(chunk)
                moved[1] += len(chunk)
                asked = retry.feed(chunk)
            if not asked:
                return "", bytes(hello.data[hello.end :])
            second = HandshakeReader(after_retry=True)
            what = "second TLS ClientHello (after the upstream's HelloRetryRequest)"
            reason = await self._client_hello(stream, origin, second, hello.data[hello.end :], what)
            if reason:
                return reason, b""
            await upstream.send_all(second.data[: second.end])
            moved[0] += second.end
            return "", bytes(second.data[second.end :])
        return f"{origin} did not answer the TLS ClientHello within {TUNNEL_IDLE_TIMEOUT:g}s", b""

    async def _client_hello(
        self, stream: trio.SocketStream, origin: Origin, reader: HandshakeReader, data: bytes, what: str
    ) -> str:
        """Feed ``reader`` the guest's ``data`` and what it sends next until
        its ClientHello is whole; returns why the tunnel must end ("" if the
        hello names the CONNECT's host)."""
        with trio.move_on_after(CLIENT_TIMEOUT):
            try:
                chunk = data
                while (message := reader.feed(chunk)) is None:
                    chunk = await stream.receive_some(_READ)
                    if not chunk:
                        return f"the guest closed the tunnel before its {what}"
                name = server_name(message)
            except trio.BrokenResourceError:
                return f"the guest closed the tunnel before its {what}"  # a reset: our answer went unread
            except NotTLS as exc:
                return f"the tunnel to {origin} does not carry a {what}: {exc}"
            if name == origin.host or (name is None and is_address(origin.host)):
                return ""
            return f"the {what} names {name!r}, not {origin.host} (the CONNECT's host)"
        return f"no {what} within {CLIENT_TIMEOUT:g}s"

    @contextlib.contextmanager
    def _request_slot(self) -> Iterator[None]:
        """One of this session's share of the backend's concurrent requests,
        and one of the backend's, for the block; 503 at once without."""
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            raise Refusal(
                503, f"this session has {self._limiter.total_tokens} requests through the gateway at once; retry later"
            ) from None
        try:
            try:
                self._hub.limiter.acquire_nowait()
            except trio.WouldBlock:
                raise Refusal(503, "too many requests through the gateway at once; retry later") from None
            try:
                yield
            finally:
                self._hub.limiter.release()
        finally:
            self._limiter.release()

    async def _read_body(
        self, stream: trio.SocketStream, connection: h11.Connection, rest: bytes
    ) -> tuple[bytes, bytes]:
        body = bytearray()
        if rest:  # an empty read is the end of the stream to h11, and the body may not be here yet
            connection.receive_data(rest)
        continued = False
        with trio.move_on_after(CLIENT_TIMEOUT) as timeout:
            while True:
                try:
                    event = connection.next_event()
                except h11.RemoteProtocolError as exc:
                    raise Refusal(_client_error(exc), f"malformed request body: {exc}", close=True) from None
                if event is h11.NEED_DATA:
                    if connection.they_are_waiting_for_100_continue and not continued:
                        continued = True
                        await self._send(stream, b"HTTP/1.1 100 Continue\r\n\r\n")
                    chunk = await stream.receive_some(_READ)
                    connection.receive_data(chunk)
                    if not chunk:
                        raise Refusal(400, "the request body was cut short", close=True)
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_BODY_BYTES:
                        raise Refusal(413, f"the request body is over {MAX_BODY_BYTES} bytes", close=True)
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body), connection.trailing_data[0]
        if timeout.cancelled_caught:
            raise Refusal(408, "the request took too long to arrive", close=True)
        raise AssertionError("unreachable")

    async def _exchange(
        self, allowed: AllowedOrigin, request: h11.Request, target: str, body: bytes
    ) -> UpstreamResponse:
        origin = allowed.origin
        stream: trio.abc.Stream = await self._hub.connect(origin, names_itself(self.policy, origin))
        try:
            if origin.scheme == "https":
                stream = trio.SSLStream(
                    stream, self._hub.ssl_context, server_hostname=origin.host, https_compatible=True
                )
                try:
                    await stream.do_handshake()
                except (trio.BrokenResourceError, ssl.SSLError) as exc:
                    raise Refusal(502, f"TLS with {origin} failed: {_tls_reason(exc)}") from None
            client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES * 4)
            headers = upstream_headers(allowed, request)
            if body or request.method in (b"POST", b"PUT", b"PATCH"):
                headers.append((b"content-length", str(len(body)).encode()))
            try:
                outgoing = client.send(h11.Request(method=request.method, target=target.encode(), headers=headers))
                if body:
                    outgoing += client.send(h11.Data(data=body))
                outgoing += client.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                # Its text may quote a header value: say nothing of it.
                raise Refusal(502, f"the request to {origin} could not be built") from None
            try:
                await stream.send_all(outgoing)
                return await _read_response(stream, client)
            except (trio.BrokenResourceError, OSError) as exc:
                raise Refusal(502, f"{origin} closed the connection: {exc}") from None
        finally:
            await trio.aclose_forcefully(stream)

    def _audit(
        self, method: str, origin: str | None, requested: str, path: str, status: int, bytes_in: int,
        bytes_out: int, started: float, reason: str,
    ) -> None:  # fmt: skip
        duration = time.monotonic() - started
        self._hub.publish(
            AuditRecord(self.session_id, origin, method, path, status, bytes_in, bytes_out, duration, reason, requested)
        )


async def _read_response(stream: trio.abc.Stream, client: h11.Connection) -> UpstreamResponse:
    response: h11.Response | None = None
    body = bytearray()
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as exc:
            raise Refusal(502, f"the upstream's response is malformed: {exc}") from None
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(_READ))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:
                raise Refusal(502, f"the upstream's response body is over {MAX_BODY_BYTES} bytes")
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return UpstreamResponse(response.status_code, response.reason, list(response.headers), bytes(body))
        elif isinstance(event, h11.ConnectionClosed):
            raise Refusal(502, "the upstream closed the connection before answering")
        # h11.InformationalResponse (100 Continue and such): nothing to do.


async def _linger(stream: trio.abc.Stream) -> None:
    """Close gently: say we are done, then read and drop what the guest is
    still sending (the rest of a refused body) for a moment, so it reads our
    answer instead of a connection reset. (TLS has no half-close: an
    intercepted tunnel only drains.)"""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        if isinstance(stream, trio.abc.HalfCloseableStream):
            await stream.send_eof()
        drained = 0
        with trio.move_on_after(LINGER_TIMEOUT):
            while drained < LINGER_BYTES and (chunk := await stream.receive_some(_READ)):
                drained += len(chunk)


def _requested(target: str, host_headers: list[bytes]) -> str:
    """What a request asked to reach, for its audit record: the origin of
    an absolute URL (``scheme://host:port``), else the Host header's host
    and port (the guest speaks plain HTTP to the socket, so the scheme is
    not its to say), else what it sent, as printable text."""
    if not target.startswith("/"):
        try:
            parts = urlsplit(target)
            port = parts.port
        except ValueError:
            return _printable(target.encode("ascii", "replace"))
        if parts.scheme in DEFAULT_PORTS and parts.hostname:
            return f"{parts.scheme}://{canonical_host(parts.hostname)}:{port or DEFAULT_PORTS[parts.scheme]}"
        return _printable(target.encode("ascii", "replace"))  # CONNECT's host:port, say
    if len(host_headers) != 1:
        return _printable(b",".join(host_headers))
    try:
        host, port = split_authority(host_headers[0].decode("ascii", "replace"))
    except Refusal:
        return _printable(host_headers[0])
    return host if port is None else f"{host}:{port}"


def _printable(raw: bytes) -> str:
    """Guest bytes as an audit record may hold them: printable ASCII, at
    most MAX_REQUESTED_CHARS (log lines must not be forged or flooded)."""
    text = raw[:MAX_REQUESTED_CHARS].decode("ascii", "replace")
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text)


def _path_of(target: str) -> str:
    """A request target's path, for its audit record. The target is whatever
    a guest sent: an origin-form one may look like a URL with a host
    (``//x/y``), and one urlsplit cannot read is recorded whole."""
    if target.startswith("/"):
        return target.partition("?")[0].partition("#")[0]
    try:
        return urlsplit(target).path or target
    except ValueError:
        return target


def _has_body(request: h11.Request) -> bool:
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A response's headers without the hop-by-hop ones, including any its
    Connection header names."""
    named = {token.strip().lower() for name, value in headers if name == b"connection" for token in value.split(b",")}
    return [(n, v) for n, v in headers if n.decode("ascii") not in HOP_BY_HOP and n not in named]


def _client_error(exc: h11.RemoteProtocolError) -> int:
    """The guest's mistake is always a 4xx, whatever h11 suggests."""
    return exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400


def _wants_close(request: h11.Request) -> bool:
    tokens = {
        token.strip().lower() for name, value in request.headers if name == b"connection" for token in value.split(b",")
    }
    # "close" wins, even over an HTTP/1.0 client's "keep-alive" (RFC 9112, 9.6).
    return b"close" in tokens or (request.http_version == b"1.0" and b"keep-alive" not in tokens)


def _tls_reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    return getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or type(cause).__name__


class SessionNetwork:
    """Keeps a session's gateway in step with its network policy: running
    while the policy is an allow-list, gone otherwise. Gateways run in the
    nursery of whoever owns the session (a backend, or open_sandbox)."""

    def __init__(
        self, hub: GatewayHub, nursery: trio.Nursery, session_id: str, on_request: Callable[[], None] = lambda: None
    ) -> None:
        self._hub = hub
        self._nursery = nursery
        self._session_id = session_id
        self._on_request = on_request
        self.gateway: Gateway | None = None

    async def prepare(self, policy: NetworkPolicy) -> Gateway | None:
        """Make the gateway ready for ``policy``; returns it, for the driver
        to bind into the guest, or None when the policy needs no gateway."""
        if not policy.needs_gateway:
            return None
        if self.gateway is None:
            gateway = Gateway(self._hub, self._session_id, policy, self._on_request)
            await self._nursery.start(gateway.run)
            self.gateway = gateway
        else:
            self.gateway.update(policy)
        return self.gateway

    async def apply(self, driver, policy: NetworkPolicy) -> None:
        """Change a session's policy: gateway first (so the driver can bind
        its socket), then the driver, then drop a gateway no longer needed."""
        gateway = await self.prepare(policy)
        await driver.set_network(policy, gateway)
        if gateway is None:
            await self.aclose()

    async def aclose(self) -> None:
        gateway, self.gateway = self.gateway, None
        if gateway is not None:
            with trio.CancelScope(shield=True):
                await gateway.aclose()


@contextlib.asynccontextmanager
async def service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for gateways that runs around a caller's block. Whatever the
    block raises comes out as itself, not wrapped in an ExceptionGroup, as
    callers of open_sandbox() and open_backend() expect."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class _Replayed(trio.abc.Stream):
    """A stream whose first bytes were already read (a ClientHello read to
    judge it): they come again, then the rest."""

    def __init__(self, stream: trio.abc.Stream, first: bytes) -> None:
        self._stream, self._first = stream, first

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._first:
            chunk, self._first = self._first, b""
            return chunk
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()
