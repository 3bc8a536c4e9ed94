"""The session's proxy port: unmodified tools (curl, pip, git, npm, Python)
reach allowed origins through it, with TLS from the guest to the upstream,
and nothing else, on both drivers.

The upstreams (tests/egress_upstreams.py) listen on the host's loopback and
are allowed by name as ``https://localhost:PORT``: a policy that names
localhost may reach the host's loopback (see sandboxns._routing), and the
guests send it through the proxy because their NO_PROXY is emptied (by
default a session keeps its own loopback off the proxy)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from conftest import SECRET, policy_for
from egress_upstreams import tool_env

import sandboxns
from sandboxns._network import PROXY_ENVIRONMENT

pytestmark = pytest.mark.smoke

GUEST_PATH = "/usr/local/bin:/usr/bin:/bin"


# What tool_env sets to make the tools trust a CA: a guest that is to trust
# what its session tells it to (the session CA, for interception) has none.
TRUST_VARIABLES = (
    "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO",
    "npm_config_cafile",
)  # fmt: skip


def guest_env(trust_test_ca: bool = True, **extra: str) -> dict[str, str]:
    """The tools' environment in the guest: trusting the test CA (copied to
    /workspace/ca.pem) unless told not to, home and caches in the workspace,
    loopback through the proxy. The proxy variables themselves come from the
    session."""
    env = {**tool_env("/workspace/home", "/workspace/ca.pem", GUEST_PATH), "NO_PROXY": "", "no_proxy": "", **extra}
    if not trust_test_ca:
        env = {name: value for name, value in env.items() if name not in TRUST_VARIABLES}
    return env


def allow(*servers, headers=None) -> dict:
    return {
        "allow": [
            {"origin": f"https://localhost:{s.port}", **({"headers": headers} if headers else {})} for s in servers
        ]
    }


@pytest.fixture
def proxied(driver_name, workspace, ca_pem, client_context):
    """open_sandbox(policy) for a guest that has the test CA and a home."""
    shutil.copy(ca_pem, workspace / "ca.pem")
    (workspace / "home").mkdir()

    def open_with(policy):
        return sandboxns.open_sandbox(
            workspace, driver=driver_name, network=policy, upstream_ssl_context=client_context
        )

    return open_with


async def run_ok(session, *argv: str, trust_test_ca: bool = True, **extra: str) -> str:
    result = await session.run(argv[0], list(argv[1:]), env=guest_env(trust_test_ca, **extra), timeout=60)
    assert result.exit_code == 0, f"{argv[:3]}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    return result.stdout


async def test_commands_get_the_proxy_variables_unless_they_set_their_own(proxied, package_index):
    async with proxied(allow(package_index.server)) as session:
        seen = await session.run("env")
        assert dict(line.split("=", 1) for line in seen.stdout.splitlines()).items() >= PROXY_ENVIRONMENT.items()
        # Nothing is intercepted: the guest's trust is its own.
        assert "SSL_CERT_FILE" not in seen.stdout and "/run/sandboxns/ca.pem" not in seen.stdout
        own = await session.run("sh", ["-c", "echo $HTTPS_PROXY $NO_PROXY"], env={"HTTPS_PROXY": "http://mine:1"})
        assert own.stdout.split() == ["http://mine:1", PROXY_ENVIRONMENT["NO_PROXY"]]
    async with proxied("deny-all") as session:
        assert "PROXY" not in (await session.run("env")).stdout.upper()


async def test_curl_reaches_an_allowed_origin_through_a_tunnel(proxied, package_index):
    server = package_index.server
    async with proxied(allow(server)) as session:
        page = await run_ok(session, "curl", "-sS", "--fail", f"https://localhost:{server.port}/simple/")
    assert package_index.packages[0] in page
    # The guest's own TLS reached the upstream: it saw the guest's SNI.
    [request] = server.requests
    assert (request.path, request.sni) == ("/simple/", "localhost")


async def test_pip_installs_from_an_allowed_index(proxied, package_index):
    server = package_index.server
    async with proxied(allow(server)) as session:
        await run_ok(
            session, "python3", "-m", "pip", "install", "-q", "--index-url", f"https://localhost:{server.port}/simple/",
            "--target", "/workspace/target", package_index.packages[0],
        )  # fmt: skip
        names = await run_ok(
            session, "python3", "-c", "import sandboxns_demo_0 as a, sandboxns_demo_1 as b; print(a.NAME, b.NAME)",
            PYTHONPATH="/workspace/target",
        )  # fmt: skip
    assert names.split() == package_index.packages
    assert {request.sni for request in server.requests} == {"localhost"}


async def test_git_clones_from_an_allowed_origin(proxied, git_server, workspace):
    server = git_server.server
    async with proxied(allow(server)) as session:
        await run_ok(session, "git", "clone", "-q", f"https://localhost:{server.port}/repo.git", "/workspace/clone")
    assert (workspace / "clone" / "README.md").read_text() == "hello from git.test\n"


async def test_npm_installs_from_an_allowed_registry(proxied, npm_registry, workspace):
    server = npm_registry.server
    project = workspace / "project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "project", "version": "1.0.0", "private": True}))
    async with proxied(allow(server)) as session:
        await run_ok(
            session, "sh", "-c",
            f"cd project && npm install --registry https://localhost:{server.port}/ {npm_registry.packages[0]}",
        )  # fmt: skip
        required = await run_ok(
            session, "sh", "-c", "cd project && node -e \"console.log(require('sandboxns-demo-0/package.json').name)\""
        )
    assert required.strip() == npm_registry.packages[0]


# A raw client: one request to the proxy, and the status line of its answer.
# Sends argv[1] to the proxy at argv[2] (127.0.0.1 unless given) and
# prints the answer's status line and body.
ASK = """
import http.client, socket, sys
s = socket.create_connection((sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1", 3128))
s.sendall(sys.argv[1].encode().decode("unicode_escape").encode())
answer = http.client.HTTPResponse(s)
answer.begin()
print(f"HTTP/1.1 {answer.status} {answer.reason}")
print(answer.read().decode())
"""


async def ask_proxy(session, raw: str, proxy: str = "127.0.0.1") -> str:
    result = await session.run("python3", ["-c", ASK, raw, proxy], timeout=20)
    assert result.exit_code == 0, result
    return result.stdout.strip()


async def test_what_the_policy_does_not_allow_is_refused(proxied, package_index, workspace):
    server = package_index.server
    async with proxied(allow(server)) as session:
        for target, proxy in (
            (f"localhost:{server.port + 1}", "127.0.0.1"),  # another origin
            (f"127.0.0.1:{server.port}", "127.0.0.1"),  # the allowed upstream, by an address no origin names
            ("10.0.0.1:443", "::1"),  # a private address: never even tried
            (f"[::1]:{server.port}", "::1"),
        ):
            answer = await ask_proxy(session, f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n", proxy)
            # The answer says why, in a body a tool may show.
            said = f"sandboxns gateway: {target} is not an allowed origin of the session's network policy"
            assert answer.startswith("HTTP/1.1 403 ") and answer.endswith(said), (target, answer)
        refused = await session.run(
            "curl", ["-sS", "-o", "/dev/null", "-w", "%{http_code}", f"https://localhost:{server.port + 1}/"],
            env=guest_env(),
        )  # fmt: skip
        assert refused.exit_code != 0 and refused.stdout == "000" and "403" in refused.stderr, refused
    assert server.requests == []


# A TLS client that CONNECTs to argv[1] but names argv[2] in its ClientHello.
FRONTED = """
import socket, ssl, sys
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(f"CONNECT {sys.argv[1]} HTTP/1.1\\r\\nHost: {sys.argv[1]}\\r\\n\\r\\n".encode())
print(s.recv(100).split(b"\\r\\n")[0].decode())
context = ssl.create_default_context(cafile="/workspace/ca.pem")
context.check_hostname = False
try:
    with context.wrap_socket(s, server_hostname=sys.argv[2]) as tls:
        tls.sendall(b"GET /simple/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
        print("answered", tls.recv(100)[:12])
except (OSError, ssl.SSLError) as exc:
    print("ended", type(exc).__name__)
"""


async def test_a_tunnel_whose_tls_names_another_server_is_ended(proxied, package_index, caplog):
    caplog.set_level(logging.INFO, logger="sandboxns.gateway")
    server = package_index.server
    target = f"localhost:{server.port}"
    async with proxied(allow(server)) as session:
        result = await session.run("python3", ["-c", FRONTED, target, "pypi.test"], timeout=20)
        ok = await session.run("python3", ["-c", FRONTED, target, "localhost"], timeout=20)
    assert result.stdout.splitlines()[0] == "HTTP/1.1 200 Connection established", result
    assert result.stdout.splitlines()[1].startswith("ended"), result
    assert ok.stdout.splitlines()[1].startswith("answered"), ok
    # Only the tunnel that named its host reached the upstream; the other's
    # audit record says why it ended.
    assert [request.sni for request in server.requests] == ["localhost"]
    assert "names 'pypi.test', not localhost" in caplog.text


async def test_plain_http_through_the_proxy_gets_the_policys_headers(proxied, upstreams):
    a, b, a_tls = upstreams
    async with proxied(policy_for(a)) as session:
        # curl sends an absolute-form request to the proxy for an http URL.
        body = await run_ok(session, "curl", "-sS", "--fail", f"http://{a.host}/x?y=1", "-H", "Authorization: mine")
    assert body == "hello from upstream: GET /x?y=1"
    [request] = a.requests
    assert request.headers["authorization"] == SECRET


async def test_a_name_that_resolves_into_loopback_reaches_nothing(proxied, upstreams):
    # 2130706433 is not an address literal, but the resolver reads it as
    # 127.0.0.1: allowed by name, it still may not reach the host's loopback.
    a, b, a_tls = upstreams
    async with proxied({"allow": [{"origin": f"http://2130706433:{a.port}"}]}) as session:
        answer = await ask_proxy(
            session, f"GET http://2130706433:{a.port}/ HTTP/1.1\\r\\nHost: 2130706433:{a.port}\\r\\n\\r\\n"
        )
    assert answer.startswith("HTTP/1.1 403 "), answer
    assert a.connections == 0


async def test_internet_reaches_no_loopback_no_address_and_no_private_range(proxied, upstreams):
    a, b, a_tls = upstreams
    async with proxied("internet") as session:
        for raw in (
            f"CONNECT {a_tls.host} HTTP/1.1\\r\\nHost: {a_tls.host}\\r\\n\\r\\n",
            f"CONNECT 127.0.0.1:{a_tls.port} HTTP/1.1\\r\\nHost: 127.0.0.1:{a_tls.port}\\r\\n\\r\\n",
            "CONNECT 10.0.0.1:443 HTTP/1.1\\r\\nHost: 10.0.0.1:443\\r\\n\\r\\n",
            f"GET http://{a.host}/ HTTP/1.1\\r\\nHost: {a.host}\\r\\n\\r\\n",
        ):
            assert (await ask_proxy(session, raw)).startswith("HTTP/1.1 403 "), raw
        # The session has no other way out: its namespace has only lo.
        interfaces = await session.run("cat", ["/proc/net/dev"])
        assert interfaces.stdout.count(":") == 1
    assert a.connections == a_tls.connections == 0


TOKEN = {"authorization": SECRET}


async def test_an_https_origin_that_gets_credentials_is_intercepted(proxied, package_index, workspace):
    # The guest trusts only what its session says (no test CA of its own):
    # it reaches the index through the gateway, which holds the token.
    server = package_index.server
    async with proxied(allow(server, headers=TOKEN)) as session:
        await run_ok(
            session, "python3", "-m", "pip", "install", "-q", "--index-url", f"https://localhost:{server.port}/simple/",
            "--target", "/workspace/target", package_index.packages[0], trust_test_ca=False,
        )  # fmt: skip
        shown = await session.run(
            "curl", ["-sS", "-v", "-o", "/dev/null", f"https://localhost:{server.port}/simple/"],
            env=guest_env(trust_test_ca=False),
        )  # fmt: skip
        everything = await session.run("sh", ["-c", "env; cat /run/sandboxns/ca.pem; ls -A /run/sandboxns"])
        # No key of the session's CA or its leaves is in a file, not even
        # one the guest cannot see.
        files = [path for path in session._network.gateway.directory.rglob("*") if path.is_file()]
        assert [path.name for path in files] == ["ca.pem"]
        assert not any(b"PRIVATE KEY" in path.read_bytes() for path in files)
    assert sorted(p.name for p in (workspace / "target").glob("*.dist-info")) == [
        f"sandboxns_demo_{i}-1.0.dist-info" for i in (0, 1)
    ]
    # Every request reached the index with the policy's token, over the
    # gateway's own verified TLS, and the guest saw the session's CA.
    assert server.requests and all(r.headers["authorization"] == SECRET for r in server.requests)
    assert shown.exit_code == 0 and "issuer: CN=sandboxns session" in shown.stderr, shown
    assert SECRET not in everything.stdout
    assert "BEGIN CERTIFICATE" in everything.stdout and "ca.pem" in everything.stdout
    assert "PRIVATE KEY" not in everything.stdout


async def test_an_intercepted_tunnel_serves_its_own_origin_alone(proxied, package_index, upstreams):
    a, b, a_tls = upstreams
    server = package_index.server
    async with proxied({"allow": [*allow(server, headers=TOKEN)["allow"], {"origin": a.origin}]}) as session:
        # Inside the tunnel to the index, a request for another origin
        # (allowed, even) is misdirected; the index's own one goes through.
        script = f"""
import socket, ssl
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(b"CONNECT localhost:{server.port} HTTP/1.1\\r\\nHost: localhost:{server.port}\\r\\n\\r\\n")
s.recv(100)
tls = ssl.create_default_context(cafile="/run/sandboxns/ca.pem").wrap_socket(s, server_hostname="localhost")
for host in ("{a.host}", "localhost:{server.port}"):
    tls.sendall(f"GET /simple/ HTTP/1.1\\r\\nHost: {{host}}\\r\\n\\r\\n".encode())
    print(tls.recv(4096).split(b"\\r\\n")[0].decode())
"""
        result = await session.run("python3", ["-c", script], timeout=20)
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["421", "200"], result
    assert a.requests == [] and len(server.requests) == 1


URLLIB = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())
except OSError as exc:
    print("refused:", exc, file=sys.stderr)
    sys.exit(3)
"""


async def test_python_urllib_goes_through_the_proxy(proxied, package_index):
    server = package_index.server
    async with proxied(allow(server)) as session:
        page = await run_ok(session, "python3", "-c", URLLIB, f"https://localhost:{server.port}/simple/")
    assert package_index.packages[0] in page and [r.sni for r in server.requests] == ["localhost"]


async def test_every_tool_is_told_plainly_when_an_origin_is_not_allowed(proxied, package_index, git_server):
    # The guests ask an origin the policy does not list: each tool fails,
    # saying the proxy refused (403), and nothing reaches the upstream.
    allowed, other = package_index.server, git_server.server
    url = f"https://localhost:{other.port}"
    async with proxied(allow(allowed)) as session:
        for argv in (
            ["python3", "-c", URLLIB, f"{url}/simple/"],
            [
                "python3",
                "-m",
                "pip",
                "install",
                "--index-url",
                f"{url}/simple/",
                "--retries",
                "0",
                "--target",
                "t",
                "-vv",
                "x",
            ],
            ["git", "clone", f"{url}/repo.git", "/workspace/clone"],
            ["curl", "-sS", f"{url}/"],
        ):
            result = await session.run(argv[0], argv[1:], env=guest_env(), timeout=60)
            assert result.exit_code != 0 and "403" in result.stdout + result.stderr, (argv[:3], result)
    assert other.requests == []


async def test_intercepted_credentials_never_reach_the_state_directory(
    driver_name, tmp_path, package_index, client_context
):
    server = package_index.server
    state = tmp_path / "state"
    async with sandboxns.open_backend(
        driver=driver_name, state_directory=state, upstream_ssl_context=client_context
    ) as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key, network=allow(server, headers=TOKEN))
        (handle.session.driver.workspace / "home").mkdir(exist_ok=True)
        await run_ok(
            handle.session, "curl", "-sS", "--fail", f"https://localhost:{server.port}/simple/", trust_test_ca=False
        )
        await handle.stop()
    assert [r.headers["authorization"] for r in server.requests] == [SECRET]
    for path in state.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path
