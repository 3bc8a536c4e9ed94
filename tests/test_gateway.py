"""Network policies end to end: guests on both drivers, the egress gateway,
and loopback upstreams A (allowed) and B (never allowed), over HTTP and
HTTPS (a trustme CA)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator

import pytest
import trio
import trio.testing
from conftest import SECRET, FirstLine, http, policy_for
from egress_upstreams import start_server

import sandboxns
from sandboxns import ErrorCode, SandboxError, _gateway
from sandboxns._gateway import CLIENT_TIMEOUT, MAX_CONNECTIONS, REQUEST_DEADLINE, Gateway, GatewayHub
from sandboxns._network import Origin, check_network_policy

pytestmark = pytest.mark.smoke

# The guest's client: raw bytes from stdin to the gateway socket, the raw
# answer to stdout. Raw, so tests can send what no HTTP library would.
CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect("/run/sandboxns-network.sock")
try:
    s.sendall(sys.stdin.buffer.read())
    s.shutdown(socket.SHUT_WR)
except BrokenPipeError:  # the gateway refused before reading it all
    pass
while chunk := s.recv(65536):
    sys.stdout.buffer.write(chunk)
"""


async def send(session: sandboxns.Session, raw: bytes) -> list[tuple[int, bytes]]:
    """Send raw bytes from inside the guest; (status, body) of each answer."""
    result = await session.run("python3", ["-c", CLIENT], stdin=raw, timeout=20)
    assert result.exit_code == 0, result.stderr
    answers, data = [], result.stdout_bytes
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if status == 100:
            continue
        answers.append((status, data[:length]))
        data = data[length:]
    return answers


@pytest.fixture
async def gateway_session(driver_name, workspace, upstreams, client_context):
    a, b, a_tls = upstreams
    async with sandboxns.open_sandbox(
        workspace, driver=driver_name, network=policy_for(a, a_tls), upstream_ssl_context=client_context
    ) as session:
        yield session


async def test_allowed_origin_gets_the_policy_header_instead_of_the_guests(gateway_session, upstreams):
    a, b, a_tls = upstreams
    raw = http("GET", "/resource?x=1", a.host, "Authorization: guest-token", "Cookie: c=1", "X-Kept: yes")
    [(status, body)] = await send(gateway_session, raw)
    assert status == 200 and body == b"hello from upstream: GET /resource?x=1"
    [received] = a.requests
    assert received.headers["authorization"] == SECRET
    assert "cookie" not in received.headers
    assert received.headers["x-kept"] == "yes"
    assert received.headers["host"] == a.host


async def test_https_upstream_is_verified_and_gets_the_header(gateway_session, upstreams):
    a, b, a_tls = upstreams
    [(status, body)] = await send(gateway_session, http("POST", "/upload", a_tls.host, body=b"payload"))
    assert status == 200, body
    [received] = a_tls.requests
    assert received.headers["authorization"] == SECRET and received.body == b"payload"


async def test_curl_posts_with_expect_100_continue(gateway_session, upstreams, workspace):
    # curl sends the head, waits for 100 Continue, then the body: a body
    # that arrives in a later read than its head.
    a, b, a_tls = upstreams
    (workspace / "body").write_bytes(b"x" * 100_000)
    result = await gateway_session.run(
        "curl",
        ["-sS", "--unix-socket", "/run/sandboxns-network.sock", "-H", "Expect: 100-continue",
         "--data-binary", "@body", "-w", "%{http_code}", "-o", "/dev/null", f"http://{a.host}/upload"],
        timeout=20,
    )  # fmt: skip
    assert (result.exit_code, result.stdout) == (0, "200"), result
    [received] = a.requests
    assert received.body == b"x" * 100_000 and received.headers["authorization"] == SECRET


async def test_untrusted_https_upstream_is_refused(driver_name, workspace, upstreams):
    a, b, a_tls = upstreams
    # The system trust store does not know the test CA.
    async with sandboxns.open_sandbox(workspace, driver=driver_name, network=policy_for(a_tls)) as session:
        [(status, body)] = await send(session, http("GET", "/", a_tls.host))
    assert status == 502 and b"TLS" in body
    assert a_tls.requests == []


async def test_other_origins_are_refused_and_see_nothing(gateway_session, upstreams):
    a, b, a_tls = upstreams
    for raw in (
        http("GET", "/", b.host),
        http("GET", f"http://{b.host}/", a.host),  # Host A, absolute URI of B
        http("GET", f"http://{a.host}/", b.host),  # and the reverse
        http("GET", f"http://{a_tls.host}/", a_tls.host),  # A_tls is allowed as https only
        http("GET", "/", f"localhost:{b.port + 1}"),
    ):
        [(status, _)] = await send(gateway_session, raw)
        assert status == 403, raw
    assert b.connections == 0 and a.requests == [] and a_tls.requests == []


async def test_every_request_on_a_connection_is_judged_on_its_own(gateway_session, upstreams):
    a, b, a_tls = upstreams
    answers = await send(gateway_session, http("GET", "/one", a.host) + http("GET", "/two", b.host))
    assert [status for status, _ in answers] == [200, 403]
    assert b.connections == 0


async def test_origin_spellings_are_canonical(gateway_session, upstreams):
    a, b, a_tls = upstreams
    for host in (a.host, a.host.upper(), f"localhost.:{a.port}"):
        [(status, _)] = await send(gateway_session, http("GET", "/", host))
        assert status == 200, host
    [(status, _)] = await send(gateway_session, http("GET", f"HTTPS://LOCALHOST.:{a_tls.port}/x", a_tls.host))
    assert status == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: {host}\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
        b"GET / HTTP/1.1\r\nHost: {host}\r\nX-Injected: a\r\nX-Other: b\nEvil: c\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: {host}\r\nX-Folded: a\r\n b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: {host}\r\nX-Nul: a\0b\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n",
        b"TRACE / HTTP/1.1\r\nHost: {host}\r\n\r\n",
        b"trace / HTTP/1.1\r\nHost: {host}\r\n\r\n",
    ],
    ids=[
        "cl+te",
        "duplicate-cl",
        "bare-lf",
        "obs-fold",
        "nul",
        "te-not-chunked",
        "upgrade",
        "connect",
        "trace",
        "trace-lower",
    ],
)
async def test_ambiguous_or_tunnelling_requests_are_refused_and_the_connection_closed(gateway_session, upstreams, raw):
    a, b, a_tls = upstreams
    # The valid request after the bad one never gets an answer.
    answers = await send(gateway_session, raw.replace(b"{host}", a.host.encode()) + http("GET", "/", a.host))
    assert len(answers) == 1 and 400 <= answers[0][0] < 500, answers
    assert a.requests == []


@pytest.mark.parametrize(
    "refused",
    ["GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n", "GET / HTTP/1.0\r\nHost: {host}\r\n\r\n"],
    ids=["connection-close", "http-1.0"],
)
async def test_a_refusal_ends_the_connection_when_the_guest_asks(gateway_session, upstreams, refused):
    a, b, a_tls = upstreams
    # The request after it is never read, let alone forwarded.
    answers = await send(gateway_session, refused.format(host=b.host).encode() + http("GET", "/", a.host))
    assert [status for status, _ in answers] == [403] and a.requests == []


async def test_close_wins_over_keep_alive(gateway_session, upstreams):
    a, b, a_tls = upstreams
    raw = b"GET / HTTP/1.0\r\nHost: %s\r\nConnection: keep-alive, close\r\n\r\n" % a.host.encode()
    answers = await send(gateway_session, raw + http("GET", "/", a.host))
    assert [status for status, _ in answers] == [200] and len(a.requests) == 1


async def test_the_gateways_own_answer_to_head_has_no_body(gateway_session, upstreams):
    a, b, a_tls = upstreams
    result = await gateway_session.run(
        "python3", ["-c", CLIENT], stdin=http("HEAD", "/", b.host) + http("GET", "/", a.host), timeout=20
    )
    refusal, _, rest = result.stdout_bytes.partition(b"\r\n\r\n")
    assert refusal.startswith(b"HTTP/1.1 403 ") and b"content-length: " in refusal
    # A client reads no body after an answer to HEAD: the next answer must follow at once.
    assert rest.startswith(b"HTTP/1.1 200 "), rest


async def test_redirects_are_not_followed(gateway_session, upstreams):
    a, b, a_tls = upstreams
    a.reply = lambda request: (302, [("location", f"http://{b.host}/stolen")], b"")
    [(status, body)] = await send(gateway_session, http("GET", "/", a.host))
    assert status == 502 and b"redirect" in body
    assert b.connections == 0


async def test_bodies_over_a_mebibyte_are_refused_both_ways(gateway_session, upstreams):
    a, b, a_tls = upstreams
    [(status, _)] = await send(gateway_session, http("POST", "/", a.host, body=b"x" * (2 * 1024 * 1024)))
    assert status == 413 and a.requests == []
    a.reply = lambda request: (200, [], b"y" * (2 * 1024 * 1024))
    [(status, body)] = await send(gateway_session, http("GET", "/", a.host))
    assert status == 502 and b"over" in body


async def test_a_sessions_ninth_concurrent_request_gets_503(gateway_session, upstreams, workspace):
    # Half of the backend's 16 (see the host-side test of the shares below).
    a, b, a_tls = upstreams
    a.hold = trio.Event()
    results: list[int] = []

    async def one() -> None:
        [(status, _)] = await send(gateway_session, http("GET", "/slow", a.host))
        results.append(status)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(one)
        with trio.fail_after(30):
            await a.wait_for_waiting(8)
        [(status, body)] = await send(gateway_session, http("GET", "/ninth", a.host))
        assert status == 503 and b"this session" in body
        a.hold.set()
    assert results == [200] * 8


async def test_the_secret_never_reaches_the_guest_the_disk_or_the_log(
    driver_name, tmp_path, workspace, upstreams, client_context, caplog
):
    a, b, a_tls = upstreams
    caplog.set_level(logging.DEBUG)
    state_dir = tmp_path / "state"
    async with sandboxns.open_backend(
        driver=driver_name, state_directory=state_dir, upstream_ssl_context=client_context
    ) as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key, network=policy_for(a, a_tls))
        [(status, _)] = await send(handle.session, http("GET", "/", a.host))
        assert status == 200
        probe = await handle.session.run(
            "sh", ["-c", "env; cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null; ls -la /run"]
        )
        state = handle.capture_state()
        assert SECRET not in repr(handle.session.network)
        await handle.stop()
    assert SECRET not in probe.stdout
    assert SECRET not in str(state)
    for path in state_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in caplog.text
    assert any(record.name == "sandboxns.gateway" for record in caplog.records)


async def test_audit_records(driver_name, tmp_path, upstreams):
    a, b, a_tls = upstreams
    async with sandboxns.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key, network=policy_for(a))
        async with backend.audit_records() as records:
            await send(handle.session, http("POST", "/in?q=1", a.host, body=b"12345"))
            await send(handle.session, http("GET", "/x", b.host))
            first, second = await records.receive(), await records.receive()
    assert (first.origin, first.method, first.path, first.status, first.bytes_in) == (a.origin, "POST", "/in", 200, 5)
    assert first.bytes_out > 0 and first.session_id == handle.session_id
    assert (second.origin, second.status) == (None, 403) and "not an allowed origin" in second.reason
    assert (first.requested, second.requested) == (a.host, b.host)


async def test_audit_records_of_refusals_say_what_was_asked_for(driver_name, tmp_path, upstreams):
    a, b, a_tls = upstreams
    async with sandboxns.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key, network=policy_for(a))
        asked = [
            (http("GET", "/x", "Evil.Example.:8443"), "evil.example:8443"),
            (http("GET", "https://EVIL.example/x?token=1", "evil.example:443"), "https://evil.example:443"),
            (http("GET", f"http://{b.host}/x", a.host), f"http://{b.host}"),
            (http("CONNECT", "evil.example:443", "evil.example:443"), "evil.example:443"),
            (http("GET", "/x", "evil example"), "evil example"),
            (b"GET /\x01\xff" + b"x" * 1000 + b" HTTP/1.1\r\nHost: a\r\n\r\n", "/??" + "x" * 253),
        ]
        async with backend.audit_records() as records:
            for raw, _ in asked:
                await send(handle.session, raw)
            seen = [await records.receive() for _ in asked]
    assert [(record.origin, record.requested) for record in seen] == [(None, expected) for _, expected in asked]
    assert all(record.status >= 400 for record in seen), seen


async def test_a_gateway_request_counts_as_session_activity(driver_name, tmp_path, upstreams):
    a, b, a_tls = upstreams
    async with sandboxns.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend:
        template = await backend.prewarm(template="t", files={})
        async with await backend.create(template=template.template_key, network=policy_for(a)) as handle:
            before = handle.session.last_activity
            # Straight through the driver, which notes no activity itself:
            # only the gateway can move the session's clock.
            process = await handle.session.driver.spawn(
                ["python3", "-c", CLIENT],
                env={"PATH": "/usr/bin:/bin"},
                cwd="/workspace",
                output=FirstLine(),
                stdin=http("GET", "/", a.host),
            )
            try:
                assert (await process.wait()).exit_code == 0
            finally:
                await process.aclose()
            assert handle.session.last_activity > before
            assert len(a.requests) == 1


async def test_policy_changes(driver_name, workspace, upstreams):
    a, b, a_tls = upstreams
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
        probe = await session.run("sh", ["-c", "test -e /run/sandboxns-network.sock && echo present || echo absent"])
        assert probe.stdout == "absent\n"  # deny-all: no socket at all
        await session.set_network_policy(policy_for(a))
        [(status, _)] = await send(session, http("GET", "/", a.host))
        assert status == 200
        await session.set_network_policy(policy_for(b))
        [(status, _)] = await send(session, http("GET", "/", a.host))
        assert status == 403
        fifo = workspace / "started"
        os.mkfifo(fifo)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run, "sh", ["-c", "echo > started; sleep 0.5"])
            await trio.to_thread.run_sync(fifo.read_bytes)
            with pytest.raises(SandboxError) as error:
                await session.set_network_policy("allow-all")
            assert error.value.code == ErrorCode.SANDBOX_BUSY
        await session.set_network_policy("allow-all")
        result = await session.run(
            "python3",
            ["-c", f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{a.port}/').status)"],
        )
        assert result.stdout == "200\n"
        await session.set_network_policy("deny-all")
        probe = await session.run("sh", ["-c", "test -e /run/sandboxns-network.sock && echo present || echo absent"])
        assert probe.stdout == "absent\n"


async def test_deny_all_reaches_nothing(session, upstreams):
    a, b, a_tls = upstreams
    script = f"""
import socket
for attempt in (
    lambda: socket.create_connection(("127.0.0.1", {a.port}), timeout=2),
    lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53)),
    lambda: socket.getaddrinfo("example.com", 80),
):
    try:
        attempt()
        print("reached")
    except OSError as exc:
        print("refused", type(exc).__name__)
"""
    result = await session.run("python3", ["-c", script])
    assert result.stdout.count("refused") == 3, result.stdout
    assert a.connections == 0


@pytest.mark.parametrize(
    "policy",
    [
        {"allow": [{"origin": "https://a.example/path"}]},
        {"allow": [{"origin": "https://user@a.example"}]},
        {"allow": [{"origin": "https://a.*.example"}]},
        {"allow": [{"origin": "https://*example.com"}]},
        {"allow": [{"origin": "https://*.*.example.com"}]},
        {"allow": [{"origin": "https://*.10.0.0.1"}]},
        {"allow": [{"origin": "https://*"}]},
        {"allow": [{"origin": "ftp://a.example"}]},
        {"allow": [{"origin": "https://a.example"}, {"origin": "https://A.example:443"}]},
        {"allow": [{"origin": "https://a.example", "headers": {"Host": "x"}}]},
        {"allow": [{"origin": "https://a.example", "headers": {"X-Token": "a\r\nb"}}]},
        {"allow": [{"origin": "https://a.example", "headers": {"Bad Name": "x"}}]},
        {"allow": [{"origin": "https://a.example", "headers": {"Authorization": "Bearer x "}}]},
        {"allow": [{"origin": "https://a.example", "headers": {"Authorization": "Bearer \u2603"}}]},
        {"allow": "https://a.example"},
        {"deny": []},
        "allow-some",
    ],
)
async def test_bad_policies_are_refused(session, policy):
    with pytest.raises(SandboxError) as error:
        await session.set_network_policy(policy)
    assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert "a\r\nb" not in error.value.message
    assert session.network.kind == "deny-all"  # nothing changed


def test_policy_repr_hides_header_values():
    from sandboxns._network import check_network_policy

    policy = check_network_policy({"allow": [{"origin": "https://a.example", "headers": {"Authorization": SECRET}}]})
    assert SECRET not in repr(policy) and "authorization" in repr(policy)


async def test_internal_errors_go_to_the_host_callback_not_the_guest(driver_name, workspace, upstreams, monkeypatch):
    a, b, a_tls = upstreams
    from sandboxns import _gateway

    async def broken(*args):
        raise RuntimeError("internal detail the guest must not see")

    monkeypatch.setattr(_gateway.Gateway, "_exchange", broken)
    seen: list[BaseException] = []
    async with sandboxns.open_sandbox(
        workspace, driver=driver_name, network=policy_for(a), on_broker_error=seen.append
    ) as session:
        [(status, body)] = await send(session, http("GET", "/", a.host))
    assert status == 502 and b"internal detail" not in body
    assert [str(exc) for exc in seen] == ["internal detail the guest must not see"]


async def test_targets_urlsplit_cannot_read_are_no_internal_error(driver_name, workspace, upstreams):
    a, b, a_tls = upstreams
    seen: list[BaseException] = []
    async with sandboxns.open_sandbox(
        workspace, driver=driver_name, network=policy_for(a), on_broker_error=seen.append
    ) as session:
        # A path that reads like a URL with a broken IPv6 host, then a URL with one.
        answers = await send(session, http("GET", "//[x/", a.host) + http("GET", "http://[/", a.host))
    assert [status for status, _ in answers] == [200, 400]
    assert [received.target for received in a.requests] == ["//[x/"] and seen == []


async def test_a_slow_or_silent_client_is_cut_off(gateway_session, upstreams, monkeypatch):
    a, b, a_tls = upstreams
    from sandboxns import _gateway

    monkeypatch.setattr(_gateway, "CLIENT_TIMEOUT", 0.3)
    monkeypatch.setattr(_gateway, "IDLE_TIMEOUT", 0.3)
    slowloris = """
import socket
s = socket.socket(socket.AF_UNIX)
s.connect("/run/sandboxns-network.sock")
s.sendall(b"GET / HTTP/1.1\\r\\nHost: x")  # and never the rest
print("timed-out" if s.recv(100).startswith(b"HTTP/1.1 408 ") else "other")
idle = socket.socket(socket.AF_UNIX)
idle.connect("/run/sandboxns-network.sock")
print("closed" if idle.recv(100) == b"" else "answered")
"""
    result = await gateway_session.run("python3", ["-c", slowloris], timeout=10)
    assert result.stdout.split() == ["timed-out", "closed"], result


async def test_guests_that_hang_up_or_hoard_connections_cannot_stop_the_gateway(gateway_session, upstreams):
    a, b, a_tls = upstreams
    abuse = f"""
import socket
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect("/run/sandboxns-network.sock")
    return s
for _ in range(20):  # ask, then hang up without reading the answer
    s = connect()
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: {b.host}\\r\\n\\r\\n")
    s.close()
hoard = [connect() for _ in range(32)]
extra = connect()
print("cut" if extra.recv(100) == b"" else "served")
for s in hoard:
    s.close()
"""
    result = await gateway_session.run("python3", ["-c", abuse], timeout=20)
    assert result.stdout == "cut\n", result
    [(status, _)] = await send(gateway_session, http("GET", "/", a.host))
    assert status == 200


async def test_a_guest_that_does_not_read_its_answer_is_cut_off(gateway_session, upstreams, monkeypatch):
    a, b, a_tls = upstreams
    from sandboxns import _gateway

    monkeypatch.setattr(_gateway, "CLIENT_TIMEOUT", 0.3)
    a.reply = lambda request: (200, [], b"z" * (1024 * 1024))
    sleeper = f"""
import socket, time
s = socket.socket(socket.AF_UNIX)
s.connect("/run/sandboxns-network.sock")
s.sendall(b"GET / HTTP/1.1\\r\\nHost: {a.host}\\r\\n\\r\\n")
time.sleep(2)  # far past the gateway's patience
got = 0
try:
    while chunk := s.recv(65536):
        got += len(chunk)
except ConnectionResetError:
    pass
print("cut" if got < 1024 * 1024 else "whole")
"""
    result = await gateway_session.run("python3", ["-c", sleeper], timeout=20)
    assert result.stdout == "cut\n", result


async def test_oversized_request_heads_are_refused(gateway_session, upstreams):
    a, b, a_tls = upstreams
    too_long = http("GET", "/", a.host, "X-Padding: " + "p" * 20_000)
    too_many = http("GET", "/", a.host, *(f"X-{i}: {i}" for i in range(101)))
    for raw in (too_long, too_many):
        [(status, _)] = await send(gateway_session, raw)
        assert status == 431
    assert a.requests == []


# The gateway alone, driven from the host: its timing and its limits.


async def ask(gateway: Gateway, raw: bytes) -> bytes:
    """Send one request to a gateway's socket, end the sending side, and
    return everything it answers until it closes."""
    received = b""
    async with await trio.open_unix_socket(str(gateway.socket_path)) as stream:
        await stream.send_all(raw)
        await stream.send_eof()
        while chunk := await stream.receive_some():
            received += chunk
    return received


async def test_a_request_head_has_ten_seconds_from_its_first_byte(nursery, autojump_clock):
    gateway = Gateway(GatewayHub(), "slow", check_network_policy("deny-all"))
    await nursery.start(gateway.run)
    async with await trio.open_unix_socket(str(gateway.socket_path)) as idle:
        async with await trio.open_unix_socket(str(gateway.socket_path)) as slow:
            started = trio.current_time()
            answer = b""
            for byte in b"GET / HTTP/1.1\r\nHost: a.example\r\n":  # a byte every 4 s: never a whole head
                await slow.send_all(bytes([byte]))
                with trio.move_on_after(4):
                    while chunk := await slow.receive_some():
                        answer += chunk
                    break
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert CLIENT_TIMEOUT <= trio.current_time() - started < CLIENT_TIMEOUT + 4
        # One that sent nothing yet may idle for longer: it is still open.
        await idle.send_all(http("GET", "/", "a.example"))
        assert (await idle.receive_some()).startswith(b"HTTP/1.1 403 ")


async def test_one_session_holds_at_most_half_of_the_gateway_requests(nursery, upstreams):
    a, b, a_tls = upstreams
    a.hold = trio.Event()
    hub = GatewayHub(max_concurrent_requests=4)
    first, second, third = (Gateway(hub, name, check_network_policy(policy_for(a))) for name in ("1", "2", "3"))
    for gateway in (first, second, third):
        await nursery.start(gateway.run)
    answers: list[bytes] = []

    async def held(gateway: Gateway) -> None:
        answers.append(await ask(gateway, http("GET", "/held", a.host)))

    async with trio.open_nursery() as requests:
        for _ in range(2):
            requests.start_soon(held, first)
        await a.wait_for_waiting(2)
        # The first session has its share: it waits, the second is served.
        refused = await ask(first, http("GET", "/third", a.host))
        assert refused.startswith(b"HTTP/1.1 503 ") and b"this session" in refused, refused
        for _ in range(2):
            requests.start_soon(held, second)
        await a.wait_for_waiting(4)
        # Every slot taken: a third session waits too.
        refused = await ask(third, http("GET", "/fifth", a.host))
        assert refused.startswith(b"HTTP/1.1 503 ") and b"too many" in refused, refused
        a.hold.set()
    assert [answer.split(b" ", 2)[1] for answer in answers] == [b"200"] * 4


# CONNECT tunnels, from the host: a guest's TLS through the gateway to an
# allowed upstream (A over TLS).


def tunnel_policy(*upstreams) -> dict:
    return tunnel_policy_for(*(upstream.origin for upstream in upstreams))


def tunnel_policy_for(*origins: str) -> dict:
    # No headers: no tunnel is opened to an origin that gets injected credentials.
    return {"allow": [{"origin": origin} for origin in origins]}


def client_hello(server_hostname: str, alpn: list[str] = (), curve: str | None = None) -> bytes:
    """The records of a TLS client's ClientHello (its key share for curve)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if alpn:
        context.set_alpn_protocols(alpn)
    if curve:
        context.set_ecdh_curve(curve)
    outgoing = ssl.MemoryBIO()
    client = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


async def open_tunnel(gateway: Gateway, authority: str, stream: trio.SocketStream | None = None) -> trio.SocketStream:
    """A guest's connection to the gateway (its socket's, unless given),
    through a CONNECT it allowed."""
    stream = stream or await trio.open_unix_socket(str(gateway.socket_path))
    await stream.send_all(http("CONNECT", authority, authority))
    answer = await stream.receive_some()
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n", answer
    return stream


async def test_a_client_hello_sent_in_pieces_costs_the_gateway_little(nursery, upstreams):
    # A guest may fragment its ClientHello into records of a byte and send
    # them a byte per read. The gateway read everything it had again at
    # each read (and copied it): some 40 ms a read here, so one connection
    # kept the host's event loop, every session's gateway with it, busy for
    # the 10 s a ClientHello may take. Now it reads each byte once.
    a, b, a_tls = upstreams
    hub = GatewayHub()
    gateway = Gateway(hub, "pieces", check_network_policy(tunnel_policy(a_tls)))
    await nursery.start(gateway.run)
    message = client_hello("localhost", alpn=[f"{i:03}" + "p" * 251 for i in range(39)])[5:]
    data = b"".join(b"\x16\x03\x01\x00\x01" + message[i : i + 1] for i in range(len(message)))
    assert 60_000 < len(data) <= 64 * 1024
    async with hub.audit_records() as records:
        started = time.process_time()
        async with await open_tunnel(gateway, a_tls.host) as guest:
            await guest.send_all(data[:-600])
            for i in range(len(data) - 600, len(data)):
                await trio.testing.wait_all_tasks_blocked()
                await guest.send_all(data[i : i + 1])
        record = await records.receive()
        spent = time.process_time() - started
    assert (record.status, record.reason, record.bytes_in) == (200, "", len(data)), record
    assert spent < 2, f"{spent:.1f} s of CPU for one ClientHello"


@pytest.fixture
async def retrying_upstream(nursery, ca) -> tuple[int, list[str | None]]:
    """An https upstream for localhost that asks every client for a second
    ClientHello: it takes only P-256 keys, and a client's first hello offers
    an X25519 one (RFC 8446, 4.1.4). Its port, and the server name of every
    ClientHello it read, in order."""
    names: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)
    context.set_ecdh_curve("prime256v1")
    context.sni_callback = lambda _ssl_object, name, _context: names.append(name)

    async def serve(stream: trio.SSLStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            async with stream:
                await stream.do_handshake()

    [listener] = await nursery.start(functools.partial(trio.serve_ssl_over_tcp, serve, 0, context, host="127.0.0.1"))
    return listener.transport_listener.socket.getsockname()[1], names


async def receive_record(stream: trio.SocketStream) -> bytes:
    """At least the next whole TLS record from stream."""
    data = b""
    while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5]):
        data += await stream.receive_some()
    return data


async def test_a_second_client_hello_after_a_retry_request_must_name_the_host_too(
    nursery, retrying_upstream, client_context
):
    # Answering a HelloRetryRequest, a client sends its ClientHello again,
    # and a server reads the name in that one too: OpenSSL runs its server
    # name callback (which picks a certificate, or a site) again. The
    # gateway passed all but the first hello unread, so a guest could name
    # the CONNECT's host first and any other after.
    port, names = retrying_upstream
    hub = GatewayHub()
    gateway = Gateway(hub, "retry", check_network_policy(tunnel_policy_for(f"https://localhost:{port}")))
    await nursery.start(gateway.run)
    async with hub.audit_records() as records:
        # A client that answers as TLS says gets through.
        async with await open_tunnel(gateway, f"localhost:{port}") as guest:
            tls = trio.SSLStream(guest, client_context, server_hostname="localhost")
            await tls.do_handshake()
        assert names == ["localhost", "localhost"]
        assert (await records.receive()).status == 200
        # One whose second hello names another server does not.
        async with await open_tunnel(gateway, f"localhost:{port}") as guest:
            await guest.send_all(client_hello("localhost"))
            retry = await receive_record(guest)
            assert retry[0] == 0x16 and retry[5] == 0x02 and retry[11:43].hex().startswith("cf21ad74"), retry
            await guest.send_all(client_hello("evil.example", curve="prime256v1"))
            assert await guest.receive_some() == b""
        record = await records.receive()
    assert names == ["localhost", "localhost", "localhost"]
    assert record.status == 403 and "second TLS ClientHello" in record.reason and "'evil.example'" in record.reason


async def test_a_connect_to_an_http_origin_is_refused(nursery, upstreams):
    # A tunnel to an http origin carried whatever the guest sent, unread:
    # requests with the Host header of any other site its server serves (a
    # CDN's other customers), upgrades the gateway refuses in plain
    # requests, or no HTTP at all. Plain HTTP goes through the proxy as
    # requests, each one read and rebuilt for the origin it names.
    a, b, a_tls = upstreams
    gateway = Gateway(GatewayHub(), "http", check_network_policy(tunnel_policy(a)))
    await nursery.start(gateway.run)
    answer = await ask(gateway, http("CONNECT", a.host, a.host) + http("GET", "/", b.host))
    assert answer.startswith(b"HTTP/1.1 403 ") and b"plain HTTP" in answer, answer
    assert a.connections == b.connections == 0


async def assert_tunnel_ended(tls: trio.SSLStream, request: bytes) -> None:
    """The tunnel under tls is gone: sending request fails, or its far end
    hangs up, with or without a close_notify (a blind tunnel relays the
    upstream's when the gateway's closing reaches the upstream first). Any
    answer it carried meanwhile is left to the caller's check of what reached
    the upstream."""
    with pytest.raises(trio.BrokenResourceError):
        await tls.send_all(request)
        while await tls.receive_some():
            pass
        raise trio.BrokenResourceError  # closed cleanly: ended all the same


async def test_a_policy_change_ends_the_tunnels_opened_under_the_old_one(nursery, ca, client_context):
    # A tunnel is one grant, for as long as its connection lives: it lived
    # on under a policy that no longer allowed it. (Through a session a
    # policy changes only while no command runs, so no guest holds one then;
    # a gateway must not count on that.)
    async def reply(request):
        return 200, [], b"ok"

    server = await start_server(nursery, ca, "tunnel.test", reply)
    hub = GatewayHub()
    gateway = Gateway(hub, "change", check_network_policy(tunnel_policy_for(f"https://localhost:{server.port}")))
    await nursery.start(gateway.run)
    async with hub.audit_records() as records:
        async with await open_tunnel(gateway, f"localhost:{server.port}") as guest:
            tls = trio.SSLStream(guest, client_context, server_hostname="localhost")
            await tls.send_all(http("GET", "/before", "localhost"))
            answer = b""
            while not answer.endswith(b"\r\n\r\nok"):
                answer += await tls.receive_some()
            gateway.update(check_network_policy(tunnel_policy_for("https://elsewhere.example")))
            await assert_tunnel_ended(tls, http("GET", "/after", "localhost"))
        record = await records.receive()
    assert [request.path for request in server.requests] == ["/before"]
    assert record.status == 403 and record.reason == "the session's network policy changed", record


async def test_a_policy_change_ends_an_intercepted_tunnel_too(nursery, ca, client_context):
    # Its requests get the headers of the route it was opened under.
    async def reply(request):
        return 200, [], b"ok"

    server = await start_server(nursery, ca, "tunnel.test", reply)
    hub = GatewayHub(client_context)
    origin = f"https://localhost:{server.port}"
    gateway = Gateway(hub, "change", check_network_policy({"allow": [{"origin": origin, "headers": {"x-key": "old"}}]}))
    await nursery.start(gateway.run)
    trusting = ssl.create_default_context(cafile=str(gateway.directory / "ca.pem"))
    async with await open_tunnel(gateway, f"localhost:{server.port}") as guest:
        tls = trio.SSLStream(guest, trusting, server_hostname="localhost")
        await tls.send_all(http("GET", "/before", f"localhost:{server.port}"))
        answer = b""
        while not answer.endswith(b"\r\n\r\nok"):
            answer += await tls.receive_some()
        gateway.update(check_network_policy({"allow": [{"origin": origin, "headers": {"x-key": "new"}}]}))
        await assert_tunnel_ended(tls, http("GET", "/after", f"localhost:{server.port}"))
    assert [(request.path, request.headers["x-key"]) for request in server.requests] == [("/before", "old")]


async def test_a_tunnel_to_an_origin_that_answered_lately_is_answered_at_once(ca, client_context):
    # The guest makes its ClientHello while the gateway connects; should the
    # upstream have gone meanwhile, the tunnel closes, and its record says so.
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)

    async def handshake(stream: trio.SSLStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.do_handshake()

    hub = GatewayHub()
    stopped = trio.CancelScope()

    async def upstream(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with stopped:
            await trio.serve_ssl_over_tcp(handshake, 0, server_context, host="127.0.0.1", task_status=task_status)

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(upstream)
        authority = f"localhost:{listener.transport_listener.socket.getsockname()[1]}"
        gateway = Gateway(hub, "early", check_network_policy(tunnel_policy_for(f"https://{authority}")))
        await nursery.start(gateway.run)
        async with await open_tunnel(gateway, authority) as guest:  # the first: connected to before its answer
            await trio.SSLStream(guest, client_context, server_hostname="localhost").do_handshake()
        stopped.cancel()  # its port answers no more
        await trio.testing.wait_all_tasks_blocked()
        async with hub.audit_records() as records:
            async with await open_tunnel(gateway, authority) as guest:
                assert await guest.receive_some() == b""  # closed, after its 200
            record = await records.receive()
        nursery.cancel_scope.cancel()
    assert (record.status, record.requested) == (502, authority), record
    assert "cannot connect" in record.reason, record


@contextlib.contextmanager
def unanswering_upstream() -> Iterator[int]:
    """The port of a loopback listener whose accept queue is full: the
    kernel drops the SYNs of a connection to it, which waits."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        yield port


async def test_a_policy_change_refuses_a_tunnel_still_being_opened(nursery):
    with unanswering_upstream() as port:
        gateway = Gateway(
            GatewayHub(), "connecting", check_network_policy(tunnel_policy_for(f"https://localhost:{port}"))
        )
        await nursery.start(gateway.run)
        with trio.fail_after(10):  # it used to wait for the kernel to give up connecting
            async with await trio.open_unix_socket(str(gateway.socket_path)) as guest:
                await guest.send_all(http("CONNECT", f"localhost:{port}", f"localhost:{port}"))
                await trio.testing.wait_all_tasks_blocked()
                gateway.update(check_network_policy(tunnel_policy_for("https://elsewhere.example")))
                answer = b""
                while chunk := await guest.receive_some():
                    answer += chunk
    assert answer.startswith(b"HTTP/1.1 403 ") and b"changed while the tunnel was being opened" in answer, answer


async def test_a_tunnel_has_the_request_deadline_to_connect(nursery, autojump_clock):
    # As a plain request has: a CONNECT waited for the kernel to give up
    # (two minutes), holding one of the session's connections.
    with unanswering_upstream() as port:
        hub = GatewayHub()
        gateway = Gateway(hub, "slow", check_network_policy(tunnel_policy_for(f"https://localhost:{port}")))
        await nursery.start(gateway.run)
        async with hub.audit_records() as records:
            started = trio.current_time()
            with trio.fail_after(2 * REQUEST_DEADLINE):
                answer = await ask(gateway, http("CONNECT", f"localhost:{port}", f"localhost:{port}"))
            assert answer.startswith(b"HTTP/1.1 504 "), answer
            assert trio.current_time() - started == pytest.approx(REQUEST_DEADLINE)
            record = await records.receive()
    assert (record.status, record.requested) == (504, f"localhost:{port}"), record


async def test_every_tunnel_leaves_an_audit_record_of_what_was_asked_for(nursery, upstreams, client_context):
    # However it ends: a guest that hung up on an open tunnel before its
    # ClientHello left no record at all (the error went past the audit).
    a, b, a_tls = upstreams
    hub = GatewayHub(client_context)
    policy = {"allow": [{"origin": a_tls.origin}, {"origin": "https://secret.example", "headers": {"x-key": SECRET}}]}
    gateway = Gateway(hub, "audit", check_network_policy(policy))
    await nursery.start(gateway.run)
    target = a_tls.host
    async with hub.audit_records() as records:
        # An intercepted tunnel is judged by its ClientHello as a blind one.
        await ask(gateway, http("CONNECT", "secret.example:443", "secret.example:443") + client_hello("evil.example"))
        for first in (client_hello("evil.example"), b"GET / HTTP/1.1\r\n\r\n", b""):
            await ask(gateway, http("CONNECT", target, target) + first)
        # One that hangs up before its ClientHello, leaving our answer unread
        # (so the gateway's next read fails: a reset, not an end).
        guest = await trio.open_unix_socket(str(gateway.socket_path))
        await guest.send_all(http("CONNECT", target, target) + client_hello("localhost")[:10])
        await trio.testing.wait_all_tasks_blocked()
        await guest.aclose()
        async with await open_tunnel(gateway, target) as guest:
            await trio.SSLStream(guest, client_context, server_hostname="localhost").do_handshake()
        seen = [await records.receive() for _ in range(6)]
    assert [(r.method, r.origin, r.requested) for r in seen] == [
        ("CONNECT", "https://secret.example", "secret.example:443"),
        *[("CONNECT", a_tls.origin, target)] * 5,
    ]
    assert [r.status for r in seen] == [403, 403, 403, 403, 403, 200], seen
    for record, reason in zip(
        seen,
        [
            "names 'evil.example', not secret.example",
            "names 'evil.example', not localhost",
            "does not carry a TLS ClientHello",
            "the guest closed the tunnel before its TLS ClientHello",
            "the guest closed the tunnel before its TLS ClientHello",
            "",
        ],
        strict=True,
    ):
        assert reason in record.reason and bool(reason) == bool(record.reason), record


# Spellings of the host's loopback (and of this host), as a target: names,
# address literals, forms of IPv4 the resolver reads (hex, octal, one
# number, fewer parts), IPv4 in IPv6, zone ids, percent-encoding, dots.
LOOPBACK_SPELLINGS = [
    "127.0.0.1", "127.0.0.1.", "127.1", "0x7f.1", "0x7f000001", "2130706433", "0177.0.0.1", "017700000001",
    "0", "0.0.0.0", "[::1]", "[::]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:7f00:1]",
    "[::127.0.0.1]", "[::1%lo]", "[::1%25lo]", "[fe80::1%lo]", "localhost..", "local%68ost", "localhost%2e",
    "127.0.0.1%2e",
]  # fmt: skip


async def test_no_spelling_of_the_hosts_loopback_reaches_it(nursery, upstreams, client_context):
    a, b, a_tls = upstreams

    async def answers(policy: object) -> dict[str, bytes]:
        gateway = Gateway(GatewayHub(client_context), "spellings", check_network_policy(policy))
        await nursery.start(gateway.run)
        statuses = {}
        for host in [*LOOPBACK_SPELLINGS, "localhost", "LOCALHOST", "localhost."]:
            authority = f"{host}:{a_tls.port}"
            answer = await ask(gateway, http("CONNECT", authority, authority) + client_hello("localhost"))
            statuses[host] = answer.split(b" ", 2)[1]
            answer = await ask(gateway, http("GET", f"http://{host}:{a.port}/", f"{host}:{a.port}"))
            statuses[f"http://{host}"] = answer.split(b" ", 2)[1]
        return statuses

    # Under "internet", none: only public addresses, and no literal at all.
    assert all(status[:1] in b"45" for status in (await answers("internet")).values())
    assert a.connections == a_tls.connections == 0
    # A policy that names localhost reaches it by that name alone.
    named = await answers(tunnel_policy_for(f"https://localhost:{a_tls.port}", f"http://localhost:{a.port}"))
    assert {host for host, status in named.items() if status[:1] not in b"45"} == {
        "localhost", "LOCALHOST", "localhost.", "http://localhost", "http://LOCALHOST", "http://localhost.",
    }  # fmt: skip
    assert (a.connections, a_tls.connections) == (3, 3)


async def test_tunnels_through_either_door_count_and_leave_nothing_open(nursery, upstreams):
    a, b, a_tls = upstreams
    hub = GatewayHub()
    gateway = Gateway(hub, "doors", check_network_policy(tunnel_policy(a_tls)))
    await nursery.start(gateway.run)
    # The proxy's door: a TCP listener, as a sandbox hands one over.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proxy = gateway.serve_proxy([listener])

    async def door(i: int) -> trio.SocketStream:
        if i % 2:
            return await trio.open_tcp_stream("127.0.0.1", port)
        return await trio.open_unix_socket(str(gateway.socket_path))

    await trio.testing.wait_all_tasks_blocked()
    open_files = len(os.listdir("/proc/self/fd"))
    async with hub.audit_records() as records:
        # Tunnels waiting for their ClientHello hold all 32 of the session's
        # connections, half through each door: a 33rd is closed at once.
        tunnels = [await open_tunnel(gateway, a_tls.host, await door(i)) for i in range(MAX_CONNECTIONS)]
        for i in range(2):
            async with await door(i) as extra:
                assert await extra.receive_some() == b""
        for tunnel in tunnels:
            await tunnel.aclose()
        assert {(await records.receive()).status for _ in tunnels} == {403}
        # Each freed its connection and its upstream's.
        for i in range(2):
            async with await open_tunnel(gateway, a_tls.host, await door(i)):
                pass
            assert (await records.receive()).status == 403
    await trio.testing.wait_all_tasks_blocked()
    assert len(os.listdir("/proc/self/fd")) == open_files
    assert a_tls.connections == MAX_CONNECTIONS + 2
    # Once its scope is cancelled, the proxy's listener is closed.
    proxy.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert listener.fileno() == -1
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_the_address_cache_keeps_the_newest_entries_only(nursery, monkeypatch):
    # Every name a guest connected to stayed in the backend's cache of
    # addresses for good: under "internet", names of a wildcard domain of
    # one's own made it grow without end.
    monkeypatch.setattr(_gateway, "MAX_ADDRESSES", 2)
    hub = GatewayHub()
    ports = []
    for _ in range(4):
        with trio.socket.socket() as listener:
            await listener.bind(("127.0.0.1", 0))
            listener.listen()
            ports.append(listener.getsockname()[1])
            await (await hub.connect(Origin("https", "localhost", ports[-1]), named=True)).aclose()
    assert len(hub._addresses) == 2
    assert ("localhost", ports[-1]) in hub._addresses


async def test_a_cached_address_is_judged_for_each_session_again(nursery, upstreams):
    # The backend's sessions share the addresses it resolved: one whose
    # policy names localhost leaves the loopback address of localhost there,
    # which a session under "internet" must still not reach.
    a, b, a_tls = upstreams
    hub = GatewayHub()
    named = Gateway(hub, "named", check_network_policy(tunnel_policy(a_tls)))
    internet = Gateway(hub, "internet", check_network_policy("internet"))
    for gateway in (named, internet):
        await nursery.start(gateway.run)
    async with await open_tunnel(named, a_tls.host):
        pass
    assert ("localhost", a_tls.port) in hub._addresses
    answer = await ask(internet, http("CONNECT", a_tls.host, a_tls.host) + client_hello("localhost"))
    assert answer.startswith(b"HTTP/1.1 403 ") and b"not a public address" in answer, answer
    assert a_tls.connections == 1
