"""Fuzzing the egress gateway's request handling (hypothesis).

Hostile guests write whatever bytes they like to the gateway's Unix socket:
malformed request lines, odd methods, every form of request target, CONNECT,
huge, repeated or folded headers, conflicting framing, bad chunk sizes,
pipelines, bodies cut short, attempts to set the injected credentials, and
origins that are nearly the allowed ones. Whatever they send, on the wire:

1. nothing reaches an origin that is not exactly allowed: canary upstream B,
   which no policy allows, never sees a connection, and every request an
   allowed upstream receives is one the guest addressed to it, as sent;
2. the policy's credentials never come back to the guest, and an upstream
   gets each injected header once, with the policy's value;
3. the gateway keeps serving: a well-formed request after each example
   succeeds;
4. every answer is well-formed HTTP, or the connection ends; nothing hangs;
5. sent in pieces, each a read of its own (cut after a line or a head,
   where clients pause, or anywhere), the same bytes get the same answers.

The oracle reads each request with h11 and RFC 9110/9112 rules, not with the
gateway's own code. The default run (500 examples, a few seconds) is for CI;
for a long one:

    SANDBOXNS_FUZZ_EXAMPLES=20000 .venv/bin/pytest tests/test_gateway_fuzz.py
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import h11
import pytest
import trio
import trio.testing
from conftest import http, policy_for
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream import Received, Reply, Upstream, default_reply

from sandboxns._gateway import MAX_BODY_BYTES, MAX_HEAD_BYTES, Gateway, GatewayHub
from sandboxns._network import check_network_policy

EXAMPLES = int(os.environ.get("SANDBOXNS_FUZZ_EXAMPLES", "500"))
# Only a hang detector: whatever it is sent, the gateway answers at once
# (it gives a guest 10 s to send a request; ours are sent whole).
HANG_LIMIT = 20.0
DEFAULT_PORTS = {"http": 80, "https": 443}
# Headers that frame or route a message, or carry a guest's own credentials:
# an upstream must never get the guest's.
NEVER_FORWARDED = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "expect", "cookie",
}  # fmt: skip

TOKEN = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
VISIBLE = "".join(chr(c) for c in range(0x21, 0x7F))


def mostly(usual: st.SearchStrategy, hostile: st.SearchStrategy, odds: int = 3) -> st.SearchStrategy:
    """usual, odds times out of odds + 1; else hostile. Examples shrink
    toward the usual, so a failure shows only the twists it needs."""
    return st.sampled_from([True] * odds + [False]).flatmap(lambda usually: usual if usually else hostile)


# "{A}", "{T}" and "{B}" stand for the ports of the allowed upstream A, its
# TLS twin T and the canary B, known only at run time; a falsifying example
# shown with them says more than one with numbers.
ALLOWED = st.sampled_from(["localhost:{A}", "localhost:{T}"])
HOST_NAMES = st.sampled_from(
    [
        "localhost", "LOCALHOST", "LocalHost", "localhost.", "localhost..", ".localhost", "127.0.0.1", "[::1]",
        "0", "localhost.evil.example", "evil.example", "xn--localhost-", "l\u043ecalhost", "\uff4cocalhost",
        "localhost%2e", "localhos", "local host", "localhost\x00", "",
    ]
)  # fmt: skip
PORT_SPELLINGS = st.sampled_from(
    [
        ":{A}", ":{T}", ":{B}", "", ":", ":80", ":443", ":0{A}", ":{A}0", ":+{A}", ": {A}", ":{A}.", ":65536",
        ":-1", ":{A}:{B}", ":{A}#", ":{A}?", ":{A}/", ":{A}#@evil.example", ":{A}?@evil.example",
        ":{B}@localhost:{A}", ":{A}@localhost:{B}", ":{A}\\@localhost:{B}",
    ]
)  # fmt: skip
USERINFO = st.sampled_from(["", "", "", "user@", "localhost:{A}@", "evil.example@", ":@", "a:b@"])
AUTHORITIES = mostly(
    ALLOWED, st.one_of(st.tuples(USERINFO, HOST_NAMES, PORT_SPELLINGS).map("".join), st.text(max_size=20)), odds=2
)
SCHEMES = mostly(
    st.sampled_from(["http://", "https://"]),
    st.sampled_from(["HTTP://", "hTtPs://", "http:/", "http:", "//", "ftp://", "ws://", "http:\\\\", "https:///"]),
)
PATHS = mostly(
    st.sampled_from(["/", "/x", "/a/b?c=d"]),
    st.one_of(
        st.sampled_from(["//localhost:{B}/", "/..%2f", "/#", "/?", "/x?", "/[", "//[x/", "/\\evil"]),
        st.text(alphabet=VISIBLE, max_size=20).map("/".__add__),
    ),
)
URL_TAILS = st.one_of(st.just(""), PATHS, st.sampled_from(["?q", "?", "#f", "@evil.example/", ":{B}/"]))
METHODS = mostly(
    st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
    st.one_of(
        st.sampled_from(["CONNECT", "connect", "TRACE", "trace", "get", "PRI", "M-SEARCH"]),
        st.text(alphabet=TOKEN, min_size=1, max_size=8),
        st.text(max_size=8),
    ),
    odds=6,
)
VERSIONS = mostly(
    st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
    st.sampled_from(["HTTP/2.0", "HTTP/1.2", "http/1.1", "HTTP/0.9", "HTTP/1.1 ", ""]),
    odds=6,
)
REQUEST_LINES = mostly(
    st.just("{m} {t} {v}"), st.sampled_from(["{m}  {t} {v}", "{m} {t}", "{m}\t{t} {v}", " {m} {t} {v}"]), odds=8
)
# Headers a gateway passes on, or must drop or replace without refusing.
QUIET_HEADERS = st.sampled_from(
    [
        ("Accept", "*/*"), ("X-Kept", "yes"), ("Authorization", "Bearer guest-override"),
        ("X-Api-Key", "guest-override"), ("x-api-key", "guest-override"), ("Cookie", "c=guest"),
        ("Proxy-Authorization", "Basic Z3Vlc3Q="), ("Connection", "close"), ("Connection", "keep-alive"),
        ("Connection", "x-api-key, authorization"), ("Connection", "x-kept"), ("Expect", "100-continue"),
        ("Keep-Alive", "timeout=5"), ("TE", "trailers"), ("Trailer", "Authorization"),
        ("X-Forwarded-Host", "localhost:{B}"), ("X-Latin", "caf\xe9"), ("X-Utf8", "snow\u2603"),
    ]
)  # fmt: skip
HOSTILE_HEADERS = st.one_of(
    st.sampled_from(
        [
            ("Connection", "Upgrade"), ("Upgrade", "websocket"), ("Transfer-Encoding", "chunked"),
            ("Transfer-Encoding", "gzip, chunked"), ("Transfer-Encoding", "Chunked"),
            ("Transfer-Encoding", "chunked, identity"), ("Content-Length", "0"), ("Content-Length", "5"),
            ("Content-Length", "-1"), ("Content-Length", "5, 5"), ("Content-Length", "0x5"),
            ("Content-Length", "99999999999999999999"), ("Host", "localhost:{A}"), ("Host", "localhost:{B}"),
            ("Authorization ", "x"), (" Authorization", "x"), ("X-Api-Key\x00", "x"), ("X-Folded", "a\r\n b"),
            ("X-Bare-Lf", "a\nInjected: b"), ("X-Bare-Cr", "a\rb"), ("X-Nul", "a\x00b"), ("", "empty name"),
        ]
    ),
    st.tuples(st.text(alphabet=TOKEN, min_size=1, max_size=10), st.text(alphabet=VISIBLE + " \t", max_size=20)),
    st.tuples(st.text(max_size=10), st.text(max_size=20)),
    st.tuples(st.just("X-Huge"), st.sampled_from([4000, MAX_HEAD_BYTES]).map("v".__mul__)),
)  # fmt: skip
HEADERS = mostly(QUIET_HEADERS, HOSTILE_HEADERS, odds=6)
# Mostly none; now and then around the gateway's limit of 100 header fields.
MANY_HEADERS = mostly(st.just(0), st.sampled_from([99, 101]), odds=20)
BODIES = mostly(
    st.one_of(st.just(b""), st.binary(max_size=40)),
    st.sampled_from([MAX_BODY_BYTES, MAX_BODY_BYTES + 1]).map(b"b".__mul__),
    odds=10,
)
FRAMINGS = mostly(st.sampled_from(["length", "chunked"]), st.sampled_from(["none", "short", "long"]))
# n is a chunk's true size; m and k are one more and one less.
CHUNK_SIZES = mostly(
    st.just("{n:x}"),
    st.sampled_from(
        ["{n:X}", "0{n:x}", "{n:x} ", " {n:x}", "{n:x};ext=1", "-{n:x}", "0x{n:x}", "{m:x}", "{k:x}", "", "f" * 20]
    ),
)
TRAILERS = mostly(st.just(""), st.sampled_from(["Authorization: trailer-override\r\n", "X-Api-Key: guest\r\n"]))
SPACES = mostly(st.just(" "), st.sampled_from(["", "  ", "\t"]))
LINE_ENDS = mostly(st.just("\r\n"), st.sampled_from(["\n", "\r", "\r\r\n"]), odds=10)
SPLICES = st.sampled_from(
    ["\r", "\n", "\r\n", "\x00", " ", "\t", ":", "\x80", "\xff", "\r\n\r\n", "\r\n ", "0\r\n\r\n", ",", "\\"]
    + ["GET / HTTP/1.1\r\nHost: localhost:{B}\r\n\r\n", "GET / HTTP/1.1\r\nHost: localhost:{A}\r\n\r\n"]
)  # fmt: skip


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@st.composite
def chunked(draw, body: bytes) -> bytes:
    """body in chunked coding, with chunk sizes as a guest might spell them."""
    encoded = b""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=2)))
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        if start < end:
            n = end - start
            size = draw(CHUNK_SIZES).format(n=n, m=n + 1, k=n - 1)
            encoded += _encode(size) + b"\r\n" + body[start:end] + b"\r\n"
    return encoded + b"0\r\n" + _encode(draw(TRAILERS)) + b"\r\n"


@st.composite
def targets(draw, authority: str) -> str:
    """Mostly a path; else as often a URL for the Host header's authority
    (which gets furthest) as a URL for another, an authority alone (as for
    CONNECT), or anything."""
    own_url = st.tuples(SCHEMES, st.just(authority), URL_TAILS).map("".join)
    others = st.one_of(
        st.tuples(SCHEMES, AUTHORITIES, URL_TAILS).map("".join),
        AUTHORITIES,
        st.sampled_from(["*", ""]),
        st.text(max_size=20),
    )
    return draw(mostly(PATHS, mostly(own_url, others, odds=1), odds=2))


@st.composite
def requests(draw) -> bytes:
    """One request: mostly well-formed, with a few hostile twists."""
    authority = draw(AUTHORITIES)
    line = draw(REQUEST_LINES).format(m=draw(METHODS), t=draw(targets(authority)), v=draw(VERSIONS))
    hosts = mostly(st.just([authority]), st.one_of(st.just([]), st.lists(AUTHORITIES, min_size=1, max_size=2)))
    headers = [("Host", host) for host in draw(hosts)] + draw(st.lists(HEADERS, max_size=4))
    headers += [(f"X-{i}", str(i)) for i in range(draw(MANY_HEADERS))]
    body, framing = draw(BODIES), draw(FRAMINGS)
    if framing == "chunked" and body:
        headers.append(("Transfer-Encoding", "chunked"))
        body = draw(chunked(body))
    elif framing != "none" and body:
        length = len(body) + {"length": 0, "short": -1, "long": 1}[framing]
        headers.append(("Content-Length", str(length)))
    if len(headers) > 1:
        headers = draw(st.permutations(headers))
    end = draw(LINE_ENDS)
    head = end.join([line, *(f"{name}:{draw(SPACES)}{value}" for name, value in headers)])
    return _encode(head + end + end) + body


PIPELINES = st.lists(requests(), min_size=1, max_size=3).map(b"".join)


@st.composite
def cut_short(draw) -> bytes:
    data = draw(PIPELINES)
    return data[: draw(st.integers(0, len(data)))]


@st.composite
def spliced(draw) -> bytes:
    """A pipeline with a few bytes deleted or put in somewhere."""
    data = draw(PIPELINES)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + _encode(draw(SPLICES)) + data[at + draw(st.integers(0, 4)) :]
    return data


# Mostly whole pipelines; else one cut short, spliced, or followed by junk,
# or junk alone.
GUEST_BYTES = mostly(
    PIPELINES,
    st.one_of(cut_short(), spliced(), st.tuples(PIPELINES, st.binary(max_size=64)).map(b"".join), st.binary()),
    odds=2,
)


@dataclass
class Sent:
    """One request as h11 reads it from a guest's bytes."""

    method: bytes
    target: bytes
    http_version: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes | None  # None: cut short or malformed, so the request must never be forwarded

    def header(self, name: bytes) -> list[bytes]:
        return [value for field, value in self.headers if field == name]

    @property
    def connection_options(self) -> set[bytes]:
        return {token.strip().lower() for value in self.header(b"connection") for token in value.split(b",")}

    @property
    def closes(self) -> bool:
        """Whether the guest asked for the connection to end after it (RFC 9112, 9.3)."""
        options = self.connection_options
        return b"close" in options or (self.http_version == b"1.0" and b"keep-alive" not in options)


def read_requests(data: bytes) -> tuple[list[Sent], bool]:
    """The requests in a guest's bytes, read one after another as a server
    must, up to one after which the connection ends; the last may have a
    head but no whole body. And whether bytes that make no request head are
    left after them: a server may answer those with an error."""
    sent: list[Sent] = []
    while data:
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > MAX_HEAD_BYTES:  # the gateway's documented limit
            return sent, True
        reader = h11.Connection(h11.SERVER)
        reader.receive_data(data)
        reader.receive_data(b"")
        try:
            request = reader.next_event()
        except h11.RemoteProtocolError:
            return sent, True
        body = b""
        try:
            while not isinstance(event := reader.next_event(), h11.EndOfMessage):
                body += event.data
        except h11.RemoteProtocolError:
            body = None
        sent.append(Sent(request.method, request.target, request.http_version, list(request.headers), body))
        if body is None or sent[-1].closes:
            return sent, False
        data = reader.trailing_data[0]
    return sent, False


@dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        values = [value for field, value in self.headers if field == name]
        return values[0] if values else None


def read_answers(data: bytes, sent: list[Sent], leftover: bool) -> list[Answer]:
    """The gateway's answers, each read with h11 as the answer to its
    request; fails on anything that is not well-formed HTTP."""
    answers: list[Answer] = []
    while data:
        index = len(answers)
        assert index < len(sent) or (index == len(sent) and leftover), f"answer {index} answers no request"
        request = sent[index] if index < len(sent) else None
        method = request.method if request else b"GET"
        if method.upper() == b"CONNECT":
            # The gateway takes a CONNECT in any case as one (a tunnel, or
            # refused), where h11 would read "connect" as an ordinary method.
            method = b"CONNECT"
        reader = h11.Connection(h11.CLIENT)
        close = [(b"connection", b"close")] if request and request.closes else []
        reader.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"gateway"), *close]))
        reader.send(h11.EndOfMessage())
        reader.receive_data(data)
        reader.receive_data(b"")
        response = None
        while True:
            try:
                event = reader.next_event()
            except h11.RemoteProtocolError as exc:
                raise AssertionError(f"answer {index} is not well-formed HTTP: {exc}") from None
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.EndOfMessage):
                break
            elif event is h11.PAUSED and method == b"CONNECT" and 200 <= response.status_code < 300:
                # A tunnel: what follows is not HTTP, and ends the answers.
                answers.append(Answer(response.status_code, list(response.headers)))
                return answers
            else:
                assert isinstance(event, (h11.InformationalResponse, h11.Data)), f"answer {index} ends in {event!r}"
        answer = Answer(response.status_code, list(response.headers))
        answers.append(answer)
        framed = answer.header(b"content-length") is not None or answer.header(b"transfer-encoding") is not None
        assert framed or method == b"HEAD" or answer.status in (204, 304), f"answer {index} has no length"
        data = reader.trailing_data[0]
        if reader.their_state is h11.MUST_CLOSE:
            # Nothing may follow; but a client that asked with HEAD ignores the
            # body of an answer to it that ends the connection anyway.
            assert not data or (method == b"HEAD" and answer.header(b"connection") == b"close"), data[:200]
            break
    return answers


AUTHORITY = re.compile(rb"([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.?)(?::([0-9]*))?")
ABSOLUTE_URL = re.compile(rb"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^#]*)(?:#.*)?")


def _host_and_port(authority: bytes) -> tuple[str, int | None] | None:
    """host[:port] (RFC 9110, 7.2), canonical; None if it is anything else."""
    match = AUTHORITY.fullmatch(authority)
    if match is None or (match[2] and int(match[2]) > 65535):
        return None
    return match[1].decode().lower().removesuffix("."), int(match[2]) if match[2] else None


def destinations(request: Sent, allowed: set[tuple[str, str, int]]) -> set[tuple[str, str, int]]:
    """The allowed origins (scheme, host, port) a request names exactly, read
    strictly: one Host of host[:port], and an origin-form target, or an
    absolute one for the same host and port; no tunnels."""
    hosts = request.header(b"host")
    if request.method.upper() in (b"CONNECT", b"TRACE") or request.header(b"upgrade") or len(hosts) != 1:
        return set()
    host = _host_and_port(hosts[0])
    if host is None:
        return set()
    if request.target.startswith(b"/"):
        return {o for o in allowed if (o[1], o[2]) == (host[0], host[1] or DEFAULT_PORTS[o[0]])}
    url = ABSOLUTE_URL.fullmatch(request.target)
    scheme = url and url[1].decode().lower()
    if scheme not in DEFAULT_PORTS or (named := _host_and_port(url[2])) is None:
        return set()
    origin = (scheme, named[0], named[1] or DEFAULT_PORTS[scheme])
    return {origin} & allowed if (host[0], host[1] or DEFAULT_PORTS[scheme]) == origin[1:] else set()


def upstream_target(request: Sent) -> str:
    """The origin-form target an upstream must get for a request."""
    if request.target.startswith(b"/"):
        return request.target.decode()
    rest = ABSOLUTE_URL.fullmatch(request.target)[3].decode()
    return rest if rest.startswith("/") else "/" + rest


def signed_reply(upstream: Upstream) -> Callable[[Received], Reply]:
    """The default answer, saying which upstream gave it, to which of the
    requests it received: so each answer the guest gets leads to the
    request the upstream saw."""

    def reply(request: Received) -> Reply:
        status, headers, body = default_reply(request)
        served = [("x-served-by", upstream.origin), ("x-request", str(len(upstream.requests) - 1))]
        return status, headers + served, body

    return reply


class FuzzedGateway:
    """A gateway on the host whose policy allows A and T, with credentials
    made up for this run, and what a check needs to judge its answers."""

    def __init__(
        self, gateway: Gateway, upstreams: tuple[Upstream, Upstream, Upstream], credentials: dict[str, str],
        errors: list[BaseException], log: pytest.LogCaptureFixture,
    ) -> None:  # fmt: skip
        a, self.canary, a_tls = upstreams
        self.gateway, self.a, self.errors, self.log = gateway, a, errors, log
        self.upstreams = {(u.scheme, "localhost", u.port): u for u in (a, a_tls)}
        self.ports = {"{A}": a.port, "{T}": a_tls.port, "{B}": self.canary.port}
        self.credentials = {name.encode(): value for name, value in credentials.items()}
        for upstream in (a, a_tls):
            upstream.reply = signed_reply(upstream)

    def render(self, data: bytes) -> bytes:
        for placeholder, port in self.ports.items():
            data = data.replace(placeholder.encode(), str(port).encode())
        return data

    async def exchange(self, data: bytes, cuts: Sequence[int] = ()) -> bytes:
        """Send data on a new connection, end the sending side, and return
        all the gateway answers until it closes. Sending and reading overlap,
        as for any client that may be answered before it has sent it all.
        With ``cuts``, the data goes in pieces cut there, each sent only once
        the gateway has taken everything before it and waits for more: each
        piece is a read of its own."""
        received = bytearray()
        async with await trio.open_unix_socket(str(self.gateway.socket_path)) as stream:

            async def send() -> None:
                try:
                    edges = [0, *sorted(set(cuts)), len(data)]
                    for start, end in itertools.pairwise(edges):
                        if start:
                            await trio.testing.wait_all_tasks_blocked()
                        await stream.send_all(data[start:end])
                    await stream.send_eof()
                except trio.BrokenResourceError:
                    pass  # the gateway closed first: it refused what it had read

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                try:
                    while chunk := await stream.receive_some():
                        received += chunk
                except trio.BrokenResourceError:
                    pass  # closed with our bytes unread: a reset, after its answer
        return bytes(received)

    async def run_example(self, data: bytes, cuts: Sequence[int] | None = None) -> None:
        """The guest's bytes on one connection, then a well-formed request on
        another, each judged. With ``cuts``, the bytes go once whole and once
        in pieces, and must get the same answers."""
        # What an earlier example left must not fail this one.
        self.errors.clear()
        self.log.clear()
        answers = await self.check(data)
        if cuts is not None:
            in_pieces = await self.check(data, cuts)
            assert [a.status for a in in_pieces] == [a.status for a in answers], "answered otherwise in pieces"
        still_serving = await self.check(http("GET", "/still-serving", self.a.host))
        assert [answer.status for answer in still_serving] == [200], "the gateway stopped serving"

    async def check(self, data: bytes, cuts: Sequence[int] = ()) -> list[Answer]:
        rendered = self.render(data)
        # A cut placed in the data with placeholders lands where the same
        # bytes are in the rendered data.
        cuts = [len(self.render(data[:cut])) for cut in cuts]
        data = rendered
        sent, leftover = read_requests(data)
        before = {origin: len(upstream.requests) for origin, upstream in self.upstreams.items()}
        with trio.fail_after(HANG_LIMIT):
            received = await self.exchange(data, cuts)
        for value in self.credentials.values():
            assert value.encode() not in received, "a credential came back to the guest"
        answers = read_answers(received, sent, leftover)
        served = dict.fromkeys(self.upstreams, 0)
        for index, answer in enumerate(answers):
            by = answer.header(b"x-served-by")
            if index < len(sent) and sent[index].method.upper() == b"CONNECT" and answer.status == 200:
                # The gateway's own answer: a tunnel, to an allowed https
                # origin (the one of the two that carries credentials, so
                # the gateway itself is its far end; no ClientHello follows
                # here, so nothing goes on to the upstream).
                tunnelled = _host_and_port(sent[index].target)
                assert tunnelled == ("localhost", self.ports["{T}"]), f"a tunnel to {sent[index].target!r}"
                continue
            assert by is not None or not 200 <= answer.status < 300, f"answer {index}: a success no upstream gave"
            if by is not None:
                assert index < len(sent), f"answer {index}: something h11 cannot read went to {by}"
                assert sent[index].body is not None, f"request {index} went to {by} without a whole body"
                [origin] = [origin for origin, upstream in self.upstreams.items() if upstream.origin == by.decode()]
                assert origin in destinations(sent[index], set(self.upstreams)), f"request {index} went to {by}"
                upstream = self.upstreams[origin]
                self._check_forwarded(sent[index], upstream, upstream.requests[int(answer.header(b"x-request"))])
                served[origin] += 1
        for origin, upstream in self.upstreams.items():
            assert len(upstream.requests) - before[origin] == served[origin], f"{upstream.origin}: unanswered requests"
            assert upstream.connections == len(upstream.requests), f"{upstream.origin}: a connection without a request"
        assert self.canary.connections == 0, "the canary upstream, allowed by no policy, was reached"
        assert self.errors == [], self.errors
        for value in self.credentials.values():
            assert value not in self.log.text, "a credential in a log record"
        return answers

    def _check_forwarded(self, request: Sent, upstream: Upstream, received: Received) -> None:
        assert (received.method, received.target) == (request.method.decode(), upstream_target(request))
        assert received.body == request.body
        fields = [(name.encode(), value.encode("latin-1")) for name, value in received.fields]
        assert [value for name, value in fields if name == b"host"] == [upstream.host.encode()]
        for name, value in self.credentials.items():
            assert [v for n, v in fields if n == name] == [value.encode()], f"{name} was not the policy's, once"
        for name, value in fields:
            if name in (b"host", b"content-length", *self.credentials):
                continue
            assert name.decode() not in NEVER_FORWARDED and name not in request.connection_options, f"{name} forwarded"
            assert (name, value) in request.headers, f"{name}: {value} is not what the guest sent"
        assert [int(v) for n, v in fields if n == b"content-length"] in ([], [len(request.body)])


@pytest.fixture
async def fuzzed_gateway(nursery, upstreams, client_context, caplog):
    a, b, a_tls = upstreams
    caplog.set_level(logging.DEBUG, logger="sandboxns.gateway")
    credentials = {"authorization": f"Bearer {secrets.token_hex(16)}", "x-api-key": secrets.token_hex(16)}
    errors: list[BaseException] = []
    hub = GatewayHub(client_context, on_error=errors.append)
    gateway = Gateway(hub, "fuzz", check_network_policy(policy_for(a, a_tls, headers=credentials)))
    await nursery.start(gateway.run)
    return FuzzedGateway(gateway, upstreams, credentials, errors, caplog)


async def test_hostile_guests_cannot_misroute_leak_or_stop_the_gateway(fuzzed_gateway):
    # Hypothesis drives the examples from a worker thread; each runs back
    # here, in the trio run that holds the gateway and the upstreams.
    @settings(database=None, deadline=None, max_examples=EXAMPLES, print_blob=True)
    @given(GUEST_BYTES)
    def gateway_holds(data: bytes) -> None:
        trio.from_thread.run(fuzzed_gateway.run_example, data)

    await trio.to_thread.run_sync(gateway_holds)


def cuts(data: bytes) -> st.SearchStrategy:
    """Where to cut a guest's bytes into reads: anywhere, and most often
    where a client pauses, after a line or a whole head (a body sent
    after 100 Continue, say)."""
    pauses = [match.end() for match in re.finditer(rb"\r\n(\r\n)?", data) if match.end() < len(data)]
    anywhere = st.integers(1, max(1, len(data) - 1))
    return st.lists(mostly(st.sampled_from(pauses), anywhere) if pauses else anywhere, max_size=8)


async def test_requests_split_across_reads_are_judged_the_same(fuzzed_gateway):
    # A client may write a request in any number of pieces (a head, then
    # its body once 100 Continue came, or a byte at a time): the gateway
    # must read each piece as it comes and end up where it would with the
    # request whole.
    @settings(database=None, deadline=None, max_examples=EXAMPLES, print_blob=True)
    @given(GUEST_BYTES.flatmap(lambda data: st.tuples(st.just(data), cuts(data))))
    def gateway_holds(example: tuple[bytes, list[int]]) -> None:
        trio.from_thread.run(fuzzed_gateway.run_example, *example)

    await trio.to_thread.run_sync(gateway_holds)
