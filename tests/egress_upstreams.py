"""Real upstreams for the egress proxy's tests: a PEP 503 package index, a
git smart-HTTP server and an npm registry, each over HTTPS on loopback with a
certificate from the tests' trustme CA. Their content is built at test time,
so the real pip, git and npm use them with no network. Every request that
reaches a server is recorded, so a test can check what arrived (an injected
header) or that nothing did.

Nothing here needs pytest: a benchmark can start the same servers in its
own trio nursery."""

from __future__ import annotations

import base64
import contextvars
import functools
import hashlib
import io
import json
import os
import re
import ssl
import subprocess
import tarfile
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import h11
import trio
import trustme
from upstream import Received, Reply


@dataclass
class Request(Received):
    # The name the client sent in its TLS handshake (SNI); None for none,
    # as when it connects to an IP address.
    sni: str | None = None

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def host(self) -> str | None:
        return self.headers.get("host")


# Set by the TLS handshake's SNI callback, which runs inside the task that
# serves the connection, so each connection reads its own.
_sni: contextvars.ContextVar[str | None] = contextvars.ContextVar("sni", default=None)


def _record_sni(ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
    _sni.set(server_name)


@dataclass
class Server:
    """One HTTPS server on 127.0.0.1. Its certificate names localhost,
    127.0.0.1 and ``name`` (a made-up host such as pypi.test), so a proxy
    can reach it by name and a client by IP with the name as SNI."""

    name: str
    handler: Callable[[Request], Awaitable[Reply]]
    port: int = 0
    requests: list[Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def named_url(self) -> str:
        return f"https://{self.name}:{self.port}"

    async def _serve(self, stream: trio.SSLStream) -> None:
        connection = h11.Connection(h11.SERVER)
        async with stream:
            try:
                await stream.do_handshake()
                sni = _sni.get()
                # Keep-alive: pip, git and npm send several requests on one connection.
                while (request := await _receive(connection, stream, sni)) is not None:
                    self.requests.append(request)
                    status, headers, body = await self.handler(request)
                    headers = [*headers, ("content-length", str(len(body)))]
                    await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)))
                    if request.method != "HEAD":
                        await stream.send_all(connection.send(h11.Data(data=body)))
                    await stream.send_all(connection.send(h11.EndOfMessage()))
                    if connection.our_state is h11.MUST_CLOSE:
                        return
                    connection.start_next_cycle()
            except (trio.BrokenResourceError, h11.RemoteProtocolError):
                return  # a client that hangs up or fails the handshake (an untrusted CA) is not our failure


async def _receive(connection: h11.Connection, stream: trio.SSLStream, sni: str | None) -> Request | None:
    """The next whole request (h11 undoes chunked framing), or None once the client is done."""
    head, body = None, b""
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            if connection.they_are_waiting_for_100_continue:  # else curl waits a second before a large body
                await stream.send_all(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
            connection.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            return None
    # Latin-1: a header value may carry any byte a client sent.
    fields = [(name.decode(), value.decode("latin-1")) for name, value in head.headers]
    return Request(head.method.decode(), head.target.decode(), dict(fields), body, fields, sni)


async def start_server(
    nursery: trio.Nursery, ca: trustme.CA, name: str, handler: Callable[[Request], Awaitable[Reply]]
) -> Server:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1", name).configure_cert(context)
    context.sni_callback = _record_sni
    context.set_alpn_protocols(["http/1.1"])  # curl and git offer h2 too; say which one this server speaks
    server = Server(name, handler)
    serve = functools.partial(trio.serve_ssl_over_tcp, server._serve, 0, context, host="127.0.0.1")
    [listener] = await nursery.start(serve)
    server.port = listener.transport_listener.socket.getsockname()[1]
    return server


def tool_env(home: str | os.PathLike, ca_file: str | os.PathLike, path: str | None = None) -> dict[str, str]:
    """An environment in which pip, git, npm, node, curl and Python trust
    ca_file and read no configuration but what lives in home: this host's
    own (its pip.conf's extra indexes, its npmrc's cafile, the CA bundle its
    environment names) would otherwise decide where the tools go and whom
    they trust."""
    home, ca_file = str(home), str(ca_file)
    return {
        "PATH": path if path is not None else os.environ["PATH"],
        "HOME": home,
        "LANG": "C.UTF-8",
        "PIP_CONFIG_FILE": os.devnull,  # no pip.conf at all, even the global one
        "PIP_CERT": ca_file,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",  # else pip asks the index about itself
        "PIP_NO_INPUT": "1",
        "PIP_ROOT_USER_ACTION": "ignore",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_SSL_CAINFO": ca_file,
        "npm_config_globalconfig": os.devnull,  # the global npmrc names a cafile, which would replace ours
        "npm_config_cafile": ca_file,
        "npm_config_update_notifier": "false",  # else npm asks the registry about itself
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "NODE_EXTRA_CA_CERTS": ca_file,
        "CURL_CA_BUNDLE": ca_file,
        "SSL_CERT_FILE": ca_file,  # Python's ssl (urllib) and other OpenSSL clients
    }


# ---- a PEP 503 "simple" package index


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def demo_packages(count: int = 2) -> dict[str, list[str]]:
    """``count`` packages, name -> the names it requires: the first requires
    the second, so installing it pulls a dependency from the same place."""
    names = [f"sandboxns-demo-{i}" for i in range(count)]
    return {name: names[1:2] if i == 0 else [] for i, name in enumerate(names)}


def build_wheel(name: str, requires: list[str], version: str = "1.0") -> tuple[str, bytes]:
    """A pure-Python wheel (file name, content) written directly (a wheel is
    a zip with a dist-info): its module sets NAME and imports the modules of
    what it requires, so importing it proves they were installed too."""
    module = normalise(name).replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": "".join(f"import {normalise(r).replace('-', '_')}\n" for r in requires)
        + f"NAME = {name!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: sandboxns-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{p},sha256={_b64(hashlib.sha256(c.encode()).digest())},{len(c.encode())}" for p, c in files.items()]
    files[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for member, content in files.items():
            wheel.writestr(member, content)
    return f"{module}-{version}-py3-none-any.whl", buffer.getvalue()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass
class PackageIndex:
    server: Server
    packages: list[str]

    @property
    def index_url(self) -> str:
        return f"{self.server.url}/simple/"


async def start_package_index(
    nursery: trio.Nursery, ca: trustme.CA, packages: dict[str, list[str]], name: str = "pypi.test"
) -> PackageIndex:
    wheels = {normalise(p): build_wheel(p, requires) for p, requires in packages.items()}
    files = dict(wheels.values())

    async def reply(request: Request) -> Reply:
        html = [("content-type", "text/html")]
        if request.path == "/simple/":
            links = "".join(f'<a href="{p}/">{p}</a>\n' for p in wheels)
            return 200, html, f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n".encode()
        if (project := request.path.removeprefix("/simple/").rstrip("/")) in wheels:
            wheel, content = wheels[project]
            # Relative, so it names the host the client asked for, as pip resolves it against the page.
            link = f'<a href="../../files/{wheel}#sha256={hashlib.sha256(content).hexdigest()}">{wheel}</a>\n'
            return 200, html, f"<!DOCTYPE html>\n<html><body>\n{link}</body></html>\n".encode()
        if (wheel := request.path.removeprefix("/files/")) in files:
            return 200, [("content-type", "application/octet-stream")], files[wheel]
        return 404, [("content-type", "text/plain")], b"not found\n"

    return PackageIndex(await start_server(nursery, ca, name, reply), list(packages))


# ---- a git smart-HTTP server (git http-backend as CGI)


def make_repository(root: Path, name: str, files: dict[str, str], tags: int = 0) -> Path:
    """A bare repository root/name: one commit on main with ``files``, then
    ``tags`` more commits, each tagged. Written by one git fast-import, so a
    repository with a thousand refs costs no more processes than one with one."""
    repository = root / name
    env = {"PATH": os.environ["PATH"], "HOME": str(root), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "init", "-q", "--bare", "--initial-branch=main", str(repository)], env=env, check=True)
    stream = io.BytesIO()

    def data(content: str) -> None:
        stream.write(f"data {len(content.encode())}\n{content}\n".encode())

    for mark in range(1, tags + 2):
        stream.write(f"commit refs/heads/main\nmark :{mark}\ncommitter T <t@test> 1700000000 +0000\n".encode())
        data(f"commit {mark}\n")
        for path, content in files.items() if mark == 1 else ():
            stream.write(f"M 100644 inline {path}\n".encode())
            data(content)
        if mark > 1:
            stream.write(f"reset refs/tags/v{mark - 1}\nfrom :{mark}\n".encode())
    subprocess.run(["git", "fast-import", "--quiet"], input=stream.getvalue(), cwd=repository, env=env, check=True)
    return repository


@dataclass
class GitServer:
    server: Server
    root: Path

    def url(self, repository: str = "repo.git") -> str:
        return f"{self.server.url}/{repository}"


async def start_git_server(nursery: trio.Nursery, ca: trustme.CA, root: Path, name: str = "git.test") -> GitServer:
    """Serves every repository under root through git http-backend, read-only (clone and fetch)."""
    backend = (await trio.run_process(["git", "--exec-path"], capture_stdout=True)).stdout.decode().strip()

    async def reply(request: Request) -> Reply:
        url = urlsplit(request.target)
        env = {
            "PATH": os.environ["PATH"],
            "GIT_PROJECT_ROOT": str(root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REQUEST_METHOD": request.method,
            "PATH_INFO": unquote(url.path),
            "QUERY_STRING": url.query,
            "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": request.headers.get("content-type", ""),
            # The body as h11 handed it over, unchunked.
            "CONTENT_LENGTH": str(len(request.body)),
        }
        # CGI hands the other request headers over as HTTP_*: the backend
        # reads Git-Protocol (protocol v2) and Content-Encoding (git gzips
        # request bodies over 1 KiB; the backend inflates them) from there.
        for header, value in request.fields:
            if header.lower() not in ("content-type", "content-length", "transfer-encoding"):
                env["HTTP_" + header.upper().replace("-", "_")] = value
        # run_process kills and reaps the CGI if the test ends mid-request.
        result = await trio.run_process(
            [f"{backend}/git-http-backend"], stdin=request.body, capture_stdout=True, capture_stderr=True, env=env
        )
        parts = re.split(rb"\r?\n\r?\n", result.stdout, maxsplit=1)
        if len(parts) != 2:
            raise RuntimeError(f"git http-backend gave no CGI answer: {result.stderr.decode(errors='replace')}")
        status, headers = 200, []
        for line in parts[0].decode("latin-1").splitlines():
            header, _, value = line.partition(":")
            if header.lower() == "status":
                status = int(value.split()[0])
            elif header.lower() not in ("content-length", "transfer-encoding"):
                headers.append((header, value.strip()))
        return status, headers, parts[1]

    return GitServer(await start_server(nursery, ca, name, reply), root)


# ---- an npm registry


def build_npm_tarball(name: str, version: str, dependencies: list[str]) -> bytes:
    """package/package.json and package/index.js, gzipped tar as npm packs
    them; index.js requires its dependencies, so requiring it proves they
    were installed too."""
    manifest = {"name": name, "version": version, "main": "index.js"}
    manifest["dependencies"] = dict.fromkeys(dependencies, version)
    requires = ", ".join(f"{json.dumps(d)}: require({json.dumps(d)})" for d in dependencies)
    files = {
        "package/package.json": json.dumps(manifest, indent=2),
        "package/index.js": f"module.exports = {{ name: {json.dumps(name)}, dependencies: {{ {requires} }} }};\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, content in files.items():
            info = tarfile.TarInfo(member)
            info.size, info.mode, info.mtime = len(content.encode()), 0o644, 1700000000
            tar.addfile(info, io.BytesIO(content.encode()))
    return buffer.getvalue()


@dataclass
class NpmRegistry:
    server: Server
    packages: list[str]

    @property
    def url(self) -> str:
        return f"{self.server.url}/"


async def start_npm_registry(
    nursery: trio.Nursery,
    ca: trustme.CA,
    packages: dict[str, list[str]],
    name: str = "npm.test",
    version: str = "1.0.0",
) -> NpmRegistry:
    tarballs = {p: build_npm_tarball(p, version, dependencies) for p, dependencies in packages.items()}

    def document(package: str, origin: str) -> dict:
        tarball = tarballs[package]
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
        dist = {
            # Absolute, so it names the host the client asked for: 127.0.0.1 directly, npm.test through a proxy.
            "tarball": f"{origin}/{package}/-/{package}-{version}.tgz",
            "shasum": hashlib.sha1(tarball).hexdigest(),
            "integrity": integrity,
        }
        manifest = {"name": package, "version": version, "dependencies": dict.fromkeys(packages[package], version)}
        return {"name": package, "dist-tags": {"latest": version}, "versions": {version: {**manifest, "dist": dist}}}

    async def reply(request: Request) -> Reply:
        package, _, file = unquote(request.path).strip("/").partition("/-/")
        if package in tarballs and not file:
            body = json.dumps(document(package, f"https://{request.host}")).encode()
            return 200, [("content-type", "application/json")], body
        if package in tarballs and file == f"{package}-{version}.tgz":
            return 200, [("content-type", "application/octet-stream")], tarballs[package]
        return 404, [("content-type", "application/json")], b'{"error": "not found"}'

    return NpmRegistry(await start_server(nursery, ca, name, reply), list(packages))
