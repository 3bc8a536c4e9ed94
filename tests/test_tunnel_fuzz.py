"""Fuzzing the ClientHello reader of CONNECT tunnels (hypothesis).

A tunnel to an https origin goes on only once the guest's TLS ClientHello
names the CONNECT's host, so the reader stands between a guest and domain
fronting. Whatever a guest sends first:

1. a real ClientHello (Python's ssl, as a client: TLS 1.2 and 1.3, any
   name, ALPN lists, cipher suites, key shares) reads as the name the client
   was given, lower case and without a trailing dot, or as no name when it
   sent none; every prefix of it is "not whole yet", and so it is when its
   records are cut into other records, of any size a client may send;
2. any other bytes (mutated ClientHellos: lengths that lie, names twice or
   of another type, odd records first, cut short, flipped, followed by
   junk; random bytes) read as "not whole yet", a name, or NotTLS, and
   nothing else; a verdict, once given, stays as more bytes come;
3. the reader never says whole, or names a server, where the upstream's
   TLS would not: OpenSSL reads the same bytes as a server does (the oracle),
   and whenever it reads a ClientHello's server name the reader gives that
   name or refuses; where OpenSSL still waits for bytes, so does the reader;
4. a second ClientHello (after a HelloRetryRequest) reads the same after
   the change_cipher_spec and early data records a client may send first,
   and an upstream's first answer, real or not, cut anywhere, reads as a
   HelloRetryRequest exactly when it is one, once its random has come.

The default run (200 examples per target, a few seconds) is for CI; for a
long one:

    SANDBOXNS_FUZZ_EXAMPLES=20000 .venv/bin/pytest tests/test_tunnel_fuzz.py
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import ssl
import time
from dataclasses import dataclass, field, replace

import pytest
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxns._tunnel import (
    MAX_CLIENT_HELLO,
    HandshakeReader,
    NotTLS,
    RetryRequestReader,
    client_hello_server_name,
    server_name,
)

pytestmark = pytest.mark.smoke

EXAMPLES = int(os.environ.get("SANDBOXNS_FUZZ_EXAMPLES", "200"))
FUZZ = settings(database=None, deadline=None, max_examples=EXAMPLES, print_blob=True)

HANDSHAKE, ALERT, CHANGE_CIPHER_SPEC, APPLICATION_DATA = 0x16, 0x15, 0x14, 0x17
SERVER_NAME = 0x0000
MAX_RECORD = 2**14
CA = trustme.CA()
# A ServerHello with this random is a HelloRetryRequest (RFC 8446, 4.1.3).
RETRY_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")

# Every cipher suite this OpenSSL has for TLS 1.2 and below (1.3's are
# fixed), but those a client cannot offer without a pre-shared key.
_ALL = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
_ALL.set_ciphers("ALL:@SECLEVEL=0")
CIPHERS = sorted(
    cipher["name"]
    for cipher in _ALL.get_ciphers()
    if cipher["protocol"] != "TLSv1.3" and not any(kind in cipher["name"] for kind in ("PSK", "SRP"))
)


def verdict(data: bytes) -> tuple[bool, str | None] | type[NotTLS]:
    """What the reader makes of data; any exception but NotTLS fails the test."""
    try:
        result = client_hello_server_name(data)
    except NotTLS:
        return NotTLS
    assert result == (False, None) or (result[0] is True and (result[1] is None or isinstance(result[1], str))), result
    return result


def fed(data: bytes, cuts: list[int], after_retry: bool = False) -> list[tuple[bool, str | None] | type[NotTLS]]:
    """What a HandshakeReader makes of data fed in pieces (cut at cuts):
    its verdict after each piece, up to the first that is not "not whole
    yet"."""
    reader = HandshakeReader(after_retry=after_retry)
    verdicts: list[tuple[bool, str | None] | type[NotTLS]] = []
    for start, end in itertools.pairwise([0, *sorted(set(cuts)), len(data)]):
        try:
            message = reader.feed(data[start:end])
            verdicts.append((False, None) if message is None else (True, server_name(message)))
        except NotTLS:
            verdicts.append(NotTLS)
        if verdicts[-1] != (False, None):
            break
    return verdicts


def retry_verdicts(data: bytes, cuts: list[int]) -> list[bool | None]:
    """What a RetryRequestReader makes of data fed in pieces, up to the
    first verdict that is not "not known yet"."""
    reader = RetryRequestReader()
    verdicts = []
    for start, end in itertools.pairwise([0, *sorted(set(cuts)), len(data)]):
        verdicts.append(reader.feed(data[start:end]))
        if verdicts[-1] is not None:
            break
    return verdicts


def canonical(name: str) -> str:
    return name.lower().removesuffix(".")


# The oracle.


class OpenSSLServer:
    """The oracle: an OpenSSL server reading a guest's first bytes, as the
    upstream at the other end of a tunnel would."""

    def __init__(self) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        self.context.set_ciphers("ALL:@SECLEVEL=0")
        CA.issue_cert("a.example").configure_cert(self.context)
        self.context.sni_callback = self._server_name
        self._seen: list[str | None] = []

    def _server_name(self, _ssl_object, name: str | None, _context) -> int:
        self._seen.append(name)
        # The ClientHello is read, and its name known: no need to go on.
        return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE

    def read(self, data: bytes) -> tuple[str, str | None]:
        """("name", its server name or None) once OpenSSL has read a whole
        ClientHello; ("waits", None) while it waits for more bytes;
        ("refuses", None) if it gave up before."""
        self._seen.clear()
        incoming = ssl.MemoryBIO()
        server = self.context.wrap_bio(incoming, ssl.MemoryBIO(), server_side=True)
        incoming.write(data)
        try:
            server.do_handshake()
        except ssl.SSLWantReadError:
            outcome = "waits"
        except ssl.SSLError:
            outcome = "refuses"
        if self._seen:
            return "name", self._seen[0]
        return outcome, None


@pytest.fixture(scope="module")
def openssl() -> OpenSSLServer:
    return OpenSSLServer()


def check_against_openssl(openssl: OpenSSLServer, data: bytes) -> None:
    ours = verdict(data)
    theirs, name = openssl.read(data)
    if theirs == "name":
        # The upstream would serve this name: the reader must say so, or refuse.
        assert ours in (NotTLS, (True, None if name is None else canonical(name))), (ours, name)
    elif theirs == "waits":
        assert ours in (NotTLS, (False, None)), f"the reader says {ours} where OpenSSL waits for more"


# Real ClientHellos.

LABELS = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=1).flatmap(
    lambda first: st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_", max_size=20).map(
        first.__add__
    )
)
NAMES = st.tuples(st.lists(LABELS, min_size=1, max_size=4).map(".".join), st.sampled_from(["", "", "."])).map("".join)
# An address or no name at all: a client sends no server name then.
NAMELESS = st.sampled_from([None, "127.0.0.1", "203.0.113.9", "::1", "2001:db8::1"])
VERSIONS = st.sampled_from([ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
ALPN_PROTOCOLS = st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789/.-", min_size=1, max_size=255), max_size=8)
# Now and then enough ALPN to need several records (a ClientHello of up to 64 KiB).
HUGE_ALPN = st.integers(1, 250).map(lambda count: [f"{i:03}" + "p" * 251 for i in range(count)])


@dataclass(frozen=True)
class Client:
    """A TLS client as a guest may configure one."""

    server_hostname: str | None
    minimum: ssl.TLSVersion
    maximum: ssl.TLSVersion
    alpn: list[str] = field(default_factory=list)
    ciphers: list[str] = field(default_factory=list)
    curve: str | None = None
    tickets: bool = True
    post_handshake_auth: bool = False

    def client_hello(self) -> bytes:
        """The records of its ClientHello: what it writes first."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.minimum_version, context.maximum_version = self.minimum, self.maximum
        if self.alpn:
            context.set_alpn_protocols(self.alpn)
        if self.ciphers:
            context.set_ciphers(":".join(self.ciphers) + ":@SECLEVEL=0")
        if self.curve:
            context.set_ecdh_curve(self.curve)
        if not self.tickets:
            context.options |= ssl.OP_NO_TICKET
        context.post_handshake_auth = self.post_handshake_auth
        outgoing = ssl.MemoryBIO()
        client = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=self.server_hostname)
        with pytest.raises(ssl.SSLWantReadError):
            client.do_handshake()  # the ClientHello is out: it waits for the server's answer
        return outgoing.read()

    @property
    def expected_name(self) -> str | None:
        host = self.server_hostname
        if host is None or host.replace(".", "").isdigit() or ":" in host:
            return None
        return canonical(host)


def sometimes(draw, odds: int) -> bool:
    """True one time in odds; examples shrink toward False, so a failure
    shows only the twists it needs."""
    return draw(st.integers(1, odds)) == odds


def settable_curves(*names: str) -> list[str]:
    """Those of names this Python's ssl can offer: the set_ecdh_curve of
    some (Debian's 3.11.2, CI's smoke run) takes EC curves alone, and X25519
    and X448 are unknown groups to it."""
    settable = []
    for name in names:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).set_ecdh_curve(name)
        except ssl.SSLError:
            continue
        settable.append(name)
    return settable


CLIENT_CURVES = settable_curves("prime256v1", "secp384r1", "secp521r1", "X25519", "X448")


@st.composite
def clients(draw) -> Client:
    low, high = sorted(draw(st.lists(VERSIONS, min_size=2, max_size=2)))
    return Client(
        server_hostname=draw(st.one_of(NAMES, NAMES, NAMES, NAMELESS)),
        minimum=low,
        maximum=high,
        alpn=draw(HUGE_ALPN if sometimes(draw, 8) else ALPN_PROTOCOLS),
        ciphers=draw(st.lists(st.sampled_from(CIPHERS), max_size=40, unique=True)),
        curve=draw(st.sampled_from([None, *CLIENT_CURVES])),
        tickets=draw(st.booleans()),
        post_handshake_auth=draw(st.booleans()),
    )


def records_of(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """The TLS records in data: (content type, version, payload)."""
    records, position = [], 0
    while position < len(data):
        length = int.from_bytes(data[position + 3 : position + 5])
        records.append((data[position], data[position + 1 : position + 3], data[position + 5 : position + 5 + length]))
        position += 5 + length
    return records


def record(kind: int, payload: bytes, version: bytes = b"\x03\x01") -> bytes:
    return bytes([kind]) + version + len(payload).to_bytes(2) + payload


def refragment(message: bytes, sizes: list[int], version: bytes = b"\x03\x01") -> bytes:
    """message in handshake records of these sizes (cycling), the last one what is left."""
    records, position = [], 0
    for size in itertools.cycle(sizes or [MAX_RECORD]):
        if position >= len(message):
            return b"".join(records)
        records.append(record(HANDSHAKE, message[position : position + size], version))
        position += size


def handshake_message(data: bytes) -> bytes:
    return b"".join(payload for _, _, payload in records_of(data))


RECORD_SIZES = st.lists(st.one_of(st.integers(1, 16), st.integers(1, MAX_RECORD)), min_size=1, max_size=20)


def cuts_of(data: bytes, draw) -> list[int]:
    """Where to cut a ClientHello: after every byte of a small one; a large
    one around its records' edges, and anywhere now and then."""
    if len(data) <= 2048:
        return list(range(1, len(data)))
    edges = [sum(5 + len(payload) for _, _, payload in records_of(data)[:i]) for i in range(6)]
    near = {edge + delta for edge in edges for delta in (-1, 0, 1, 4, 5, 6)}
    anywhere = draw(st.lists(st.integers(1, len(data) - 1), max_size=40))
    return sorted({cut for cut in near if 0 < cut < len(data)} | set(anywhere))


def check_whole_only_at_the_end(hello: bytes, name: str | None, draw) -> None:
    """hello reads as name, and never as whole before its last byte:
    neither a prefix of it nor any piece but the last, fed in pieces."""
    assert verdict(hello) == (True, name)
    cuts = cuts_of(hello, draw)
    assert fed(hello, cuts) == [(False, None)] * len(cuts) + [(True, name)]
    for cut in draw(st.lists(st.sampled_from(cuts), max_size=10)) if cuts else []:
        assert verdict(hello[:cut]) == (False, None), cut


BEFORE_A_SECOND_HELLO = st.lists(
    st.sampled_from(
        [
            record(CHANGE_CIPHER_SPEC, b"\x01"),
            record(APPLICATION_DATA, b"early"),
            record(APPLICATION_DATA, bytes(2**14 + 256)),
        ]
    ),
    max_size=3,
)


def check_as_a_second_hello(hello: bytes, name: str | None, before: list[bytes], draw) -> None:
    """hello, read as a second ClientHello, reads the same after records
    a client may send before one; never with them between its records,
    nor before a first hello."""
    first = b"".join(before)
    if len(first + hello) > MAX_CLIENT_HELLO:
        # They count toward the 64 KiB a hello may take.
        assert fed(first + hello, [], after_retry=True) == [NotTLS]
        return
    cuts = [len(first)] * bool(first) + [len(first) + cut for cut in cuts_of(hello, draw)]
    assert fed(first + hello, cuts, after_retry=True) == [(False, None)] * len(cuts) + [(True, name)]
    message = handshake_message(hello)
    middle = draw(st.integers(1, len(message) - 1))
    if first:
        split = record(HANDSHAKE, message[:middle]) + first + record(HANDSHAKE, message[middle:])
        assert fed(split, [], after_retry=True) == [NotTLS]
        assert fed(first + hello, []) == [NotTLS]


@FUZZ
@given(clients(), st.data())
def test_a_real_client_hello_reads_as_its_server_name_once_whole(openssl, client, data):
    hello = client.client_hello()
    # OpenSSL reads it as the client meant it; so where it reads a hostile
    # one otherwise than the reader, that says something of the bytes.
    theirs, name = openssl.read(hello)
    assert (theirs, None if name is None else canonical(name)) == ("name", client.expected_name)
    check_whole_only_at_the_end(hello, client.expected_name, data.draw)
    check_as_a_second_hello(hello, client.expected_name, data.draw(BEFORE_A_SECOND_HELLO), data.draw)


@FUZZ
@given(clients(), RECORD_SIZES, st.sampled_from([b"\x03\x01", b"\x03\x03", b"\x03\x00"]), st.data())
def test_a_client_hello_in_other_records_reads_the_same(client, sizes, version, data):
    # A client may cut its ClientHello into records as it likes; those
    # records may take at most 64 KiB.
    hello = refragment(handshake_message(client.client_hello()), sizes, version)
    if len(hello) > MAX_CLIENT_HELLO:
        assert verdict(hello) is NotTLS
    else:
        check_whole_only_at_the_end(hello, client.expected_name, data.draw)


# Hostile bytes: real ClientHellos taken apart and put back together with
# twists, and bytes of any kind.


@dataclass(frozen=True)
class Hello:
    """A ClientHello's fields. Each length-prefixed one is declared with its
    length, unless ``lies`` says otherwise: (field, "by", n) declares it n
    bytes longer, (field, "as", n) as n bytes long."""

    version_random: bytes
    session_id: bytes
    ciphers: bytes
    compression: bytes
    extensions: tuple[tuple[int, bytes], ...]
    lies: tuple[tuple[str, str, int], ...] = ()
    no_extensions: bool = False

    @classmethod
    def of(cls, message: bytes) -> Hello:
        body = message[4:]

        def vector(position: int, size: int) -> tuple[bytes, int]:
            length = int.from_bytes(body[position : position + size])
            return body[position + size : position + size + length], position + size + length

        session_id, position = vector(34, 1)
        ciphers, position = vector(position, 2)
        compression, position = vector(position, 1)
        block, _ = vector(position, 2)
        extensions = []
        while block:
            length = int.from_bytes(block[2:4])
            extensions.append((int.from_bytes(block[:2]), block[4 : 4 + length]))
            block = block[4 + length :]
        return cls(body[:34], session_id, ciphers, compression, tuple(extensions))

    def _vector(self, key: str, data: bytes, size: int) -> bytes:
        length = len(data)
        for field_name, how, n in self.lies:
            if field_name == key:
                length = max(0, length + n) if how == "by" else n
        return (length % 256**size).to_bytes(size) + data

    def message(self) -> bytes:
        extensions = b"".join(
            kind.to_bytes(2) + self._vector(f"extension {i}", data, 2) for i, (kind, data) in enumerate(self.extensions)
        )
        body = (
            self.version_random
            + self._vector("session id", self.session_id, 1)
            + self._vector("cipher suites", self.ciphers, 2)
            + self._vector("compression", self.compression, 1)
            + (b"" if self.no_extensions else self._vector("extensions", extensions, 2))
        )
        return bytes([1]) + self._vector("message", body, 3)


def server_name_extension(entries: list[tuple[int, bytes]], name_by: int = 0, list_by: int = 0) -> bytes:
    """A server_name extension's data: a list of (name type, name), each
    name's length and the list's declared that many bytes longer."""
    listed = b"".join(bytes([kind]) + max(0, len(name) + name_by).to_bytes(2) + name for kind, name in entries)
    return max(0, len(listed) + list_by).to_bytes(2) + listed


HOSTILE_NAMES = st.sampled_from(
    [
        b"a.example", b"A.EXAMPLE.", b"a.example..", b"", b".", b"a.example\x00.evil.example", b"\x00",
        "b\u00fccher.example".encode(), b"\xff\xfe", b"evil.example", b"a" * 300, b"a.example ", b"*.example",
        b"127.0.0.1", b"[::1]",
    ]
)  # fmt: skip
NAME_TYPES = st.sampled_from([0, 0, 0, 1, 2, 255])


@st.composite
def server_names(draw) -> list[tuple[int, bytes]]:
    """The server_name extensions to put in: usually one with one name;
    else none, an empty one, two names, another name type, or two
    extensions."""
    entries = st.lists(st.tuples(NAME_TYPES, HOSTILE_NAMES), min_size=0, max_size=3)
    by = st.sampled_from([0, 0, 0, 0, -1, 1, 300])
    count = draw(st.sampled_from([1, 1, 1, 0, 2]))
    return [(SERVER_NAME, server_name_extension(draw(entries), draw(by), draw(by))) for _ in range(count)]


LENGTH_FIELDS = st.sampled_from(
    ["message", "session id", "cipher suites", "compression", "extensions", "extension 0", "extension 1",
     "extension 2"]
)  # fmt: skip
# A length as a liar states it: off by a little, zero, or far past the end.
LIES = st.tuples(
    LENGTH_FIELDS,
    st.one_of(
        st.tuples(st.just("by"), st.sampled_from([-3, -1, 1, 3])),
        st.tuples(st.just("as"), st.sampled_from([0, 255, 2**14, 2**16 - 1, 2**24 - 1])),
    ),
).map(lambda lie: (lie[0], *lie[1]))
ODD_RECORDS = st.sampled_from(
    [
        record(HANDSHAKE, b""),  # OpenSSL takes an empty handshake record; the reader refuses one
        record(ALERT, b"\x01\x00"),
        record(APPLICATION_DATA, b"x"),
        record(CHANGE_CIPHER_SPEC, b"\x01"),
        b"\x80\x2e\x01\x03\x01",  # an SSLv2-style hello's start
        b"GET / HTTP/1.1\r\n\r\n",
    ]
)


@st.composite
def mutated_hellos(draw) -> bytes:
    """A real ClientHello with a few twists."""
    hello = Hello.of(handshake_message(draw(clients()).client_hello()))
    if sometimes(draw, 2):
        kept = [(kind, data) for kind, data in hello.extensions if kind != SERVER_NAME]
        names = draw(server_names())
        at = draw(st.integers(0, len(kept)))
        hello = replace(hello, extensions=tuple(kept[:at] + names + kept[at:]))
    if sometimes(draw, 10):
        hello = replace(hello, no_extensions=True)
    if sometimes(draw, 3):
        hello = replace(hello, lies=tuple(draw(st.lists(LIES, min_size=1, max_size=2))))
    data = refragment(hello.message(), draw(RECORD_SIZES) if sometimes(draw, 2) else [])
    if sometimes(draw, 8):
        data = draw(ODD_RECORDS) + data
    if sometimes(draw, 8):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at + draw(st.integers(0, 4)) :]
    if sometimes(draw, 8):
        data += draw(st.one_of(ODD_RECORDS, st.binary(max_size=64)))
    if sometimes(draw, 5):
        data = data[: draw(st.integers(0, len(data)))]
    return data


# Random bytes: mostly a record header first, so they get past its check;
# now and then megabytes of a pattern (many tiny records, say).
RECORD_STARTS = st.sampled_from([b"", b"\x16\x03\x01", b"\x16\x03\x01\x02\x00\x01", b"\x16\x03\x01\x00\x01"])
RANDOM_BYTES = st.one_of(
    st.tuples(RECORD_STARTS, st.binary(max_size=2048)).map(b"".join),
    st.tuples(RECORD_STARTS, st.binary(min_size=1, max_size=16), st.integers(2**16, 2**22)).map(
        lambda parts: parts[0] + parts[1] * (parts[2] // len(parts[1]))
    ),
)
HOSTILE = st.one_of(mutated_hellos(), mutated_hellos(), mutated_hellos(), RANDOM_BYTES)


# Python's ssl cannot decode a server name that is not ASCII for the
# oracle's callback: it says so as an unraisable error, and the handshake
# fails (OpenSSL "refuses" such a hello, as the reader does).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@FUZZ
@given(HOSTILE, st.data())
def test_hostile_bytes_read_as_openssl_reads_them(openssl, hostile, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(hostile) - 1)), max_size=10))) - {len(hostile)})
    for cut in [*cuts, len(hostile)]:
        check_against_openssl(openssl, hostile[:cut])
    # A verdict, once given, stays as more bytes come: "not whole yet" at
    # each prefix until then. Fed in those pieces, the reader says the same.
    prefixes = [verdict(hostile[:cut]) for cut in [*cuts, len(hostile)]]
    given = next((index for index, now in enumerate(prefixes) if now != (False, None)), len(prefixes) - 1)
    assert all(now == prefixes[given] for now in prefixes[given:]), prefixes
    assert fed(hostile, cuts) == prefixes[: given + 1]
    # An upstream under "internet" may be anyone's: as its first answer,
    # the same bytes read as a HelloRetryRequest or not, the same in pieces.
    retries = retry_verdicts(hostile, cuts)
    assert all(verdict is None for verdict in retries[:-1]) and retries[-1] in (None, True, False), retries
    assert retry_verdicts(hostile, []) == retries[-1:]


def test_the_reader_refuses_past_64_kib_of_records_however_they_come():
    # Past 64 KiB of records, not yet a whole ClientHello, the reader
    # refuses and reads no further. It used to say whole for such a
    # hello read at once (6 bytes a record of 1) and refuse it in pieces,
    # and it went through every record it was given, copying the message
    # again at each.
    hello = Client("a.example", ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_3, alpn=["p" * 255] * 48)
    message = handshake_message(hello.client_hello())
    a_byte_a_record = refragment(message, [1])
    assert len(message) < MAX_CLIENT_HELLO < len(a_byte_a_record)
    assert verdict(a_byte_a_record[:MAX_CLIENT_HELLO]) == (False, None)
    assert fed(a_byte_a_record, [MAX_CLIENT_HELLO]) == [(False, None), NotTLS]
    # A message of 64 KiB, all but its type and length zeros, in records
    # of a byte; megabytes of such records; and of noise.
    zeros = refragment(b"\x01" + (MAX_CLIENT_HELLO - 8).to_bytes(3) + bytes(MAX_CLIENT_HELLO - 8), [1])
    for data in (a_byte_a_record, zeros, record(HANDSHAKE, b"\x01") * 2**20, os.urandom(2**23)):
        started = time.process_time()
        assert verdict(data) is NotTLS
        assert time.process_time() - started < 1


def test_a_record_that_goes_on_past_the_client_hello_is_refused(openssl):
    # A ClientHello ends where a record does (RFC 8446, 5.1), as OpenSSL
    # requires: so what a tunnel passes on after it starts with a record.
    message = handshake_message(Client("a.example", ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3).client_hello())
    data = record(HANDSHAKE, message + b"\x01")
    assert openssl.read(data) == ("refuses", None)
    assert verdict(data) is NotTLS
    # Known from the record's length, before its last byte comes.
    assert verdict(data[:-1]) is NotTLS


# After a HelloRetryRequest: the upstream's answer that asks for one.

SERVER_CURVES = st.sampled_from([None, "prime256v1", "secp384r1"])


@functools.cache
def server_context(curve: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    CA.issue_cert("a.example").configure_cert(context)
    if curve:
        context.set_ecdh_curve(curve)
    return context


def first_answer(client: Client, curve: str | None) -> bytes:
    """What an OpenSSL server (with keys of curve only, if given) sends
    first to a client's ClientHello."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_context(curve).wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(client.client_hello())
    with contextlib.suppress(ssl.SSLError):
        server.do_handshake()
    return outgoing.read()


def is_retry_request(answer: bytes) -> bool:
    """Read by hand from a record of OpenSSL's, which begins with the
    whole ServerHello's start."""
    return answer[:1] == b"\x16" and answer[5:6] == b"\x02" and answer[11:43] == RETRY_RANDOM


@FUZZ
@given(clients(), SERVER_CURVES, RECORD_SIZES, st.data())
def test_an_upstreams_first_answer_reads_as_a_retry_request_exactly_when_it_is_one(client, curve, sizes, data):
    answer = first_answer(client, curve)
    expected = is_retry_request(answer)
    kind, version, payload = records_of(answer)[0]
    if kind == HANDSHAKE and sizes and sometimes(data.draw, 2):
        # An upstream may cut its first message into records too.
        answer = refragment(payload, sizes, version) + answer[5 + len(payload) :]
    # Its length varies (a signature's does), so where to cut it is drawn
    # as a fraction of it.
    cuts = [int(len(answer) * part) for part in data.draw(st.lists(st.floats(0, 1), max_size=10))]
    verdicts = retry_verdicts(answer, [cut for cut in cuts if 0 < cut < len(answer)])
    assert verdicts[-1] is expected, verdicts
    assert all(verdict is None for verdict in verdicts[:-1]), verdicts
