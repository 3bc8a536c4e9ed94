"""Shared fixtures. Every behavioural test takes ``session`` (or
``driver_name``), so it runs against every driver the project has."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import ssl
from pathlib import Path

import pytest
import trio
import trustme
from egress_upstreams import (
    GitServer,
    NpmRegistry,
    PackageIndex,
    demo_packages,
    make_repository,
    start_git_server,
    start_npm_registry,
    start_package_index,
    tool_env,
)
from upstream import Upstream, start_upstream

import sandboxns
from sandboxns import ErrorCode, SandboxError
from sandboxns._bwrap import find_bwrap

pytest_plugins = ["skip_reasons"]

DRIVERS = ["native", "bwrap"]


@pytest.fixture(params=DRIVERS)
def driver_name(request: pytest.FixtureRequest) -> str:
    """Every driver must pass every behavioural test. Without bubblewrap the
    bwrap runs are skipped, unless SANDBOXNS_REQUIRE_BWRAP=1 (as in CI)."""
    if request.param == "bwrap" and find_bwrap() is None:
        if os.environ.get("SANDBOXNS_REQUIRE_BWRAP") == "1":
            pytest.fail("SANDBOXNS_REQUIRE_BWRAP=1 but bubblewrap is not installed")
        pytest.skip("bubblewrap is not installed")
    return request.param


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
async def session(driver_name: str, workspace: Path):
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as opened:
        yield opened


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
async def backend(driver_name: str, state_dir: Path):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as opened:
        yield opened


async def refused(code: ErrorCode, operation) -> SandboxError:
    """Await ``operation``; it must fail with SandboxError ``code``."""
    with pytest.raises(SandboxError) as error:
        await operation
    assert error.value.code == code, error.value
    return error.value


def sleep_marker() -> str:
    """A unique `sleep` duration, so a test can find exactly its own guest
    processes in the host's process table."""
    return f"{1000 + random.random():.9f}"


def host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains marker, as the kernel lists them."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def descendants(pid: int) -> set[int]:
    """Every live descendant of pid on the host."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = {int(child) for child in f.read().split()}
            except OSError:
                continue
            pending.extend(children - found)
            found |= children
    return found


async def kill_native_holder(session) -> None:
    """SIGKILL a native session's holder from the host (as an operator or
    the OOM killer might) and return once it is dead."""
    pidfd = os.pidfd_open(session.driver.holder_pid)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


async def start_waiting_guest(session, workspace, nursery, marker: str, setup: str = "") -> None:
    """Start a long-running guest process whose command line carries marker,
    after the shell commands in setup, and return once that process itself
    runs: it signals through a FIFO after its exec, so the host sees it and
    not the shell that preceded it."""
    ready = workspace / f"ready-{marker}"
    os.mkfifo(ready)
    program = 'import sys, time; open(sys.argv[1], "w").close(); time.sleep(10**6)'

    async def run_guest() -> None:
        result = await session.run(
            "sh", ["-c", f"{setup} exec python3 -c '{program}' /workspace/{ready.name} {marker}"]
        )
        # Only reached when the guest ended early: release the host's read
        # rather than leave it blocked, and fail with what the guest said.
        with contextlib.suppress(OSError):
            os.close(os.open(ready, os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError(f"the waiting guest ended early: {result}")

    nursery.start_soon(run_guest)
    await trio.to_thread.run_sync(ready.read_bytes)


class FirstLine:
    """An output sink for tests that drive a driver directly: keeps stdout
    and says when its first line has come. Output moves only while the
    process is waited for."""

    def __init__(self) -> None:
        self.stdout = b""
        self.arrived = trio.Event()

    def feed(self, name: str, chunk: bytes) -> bool:
        if name == "stdout":
            self.stdout += chunk
            if b"\n" in self.stdout:
                self.arrived.set()
        return False


@contextlib.contextmanager
def no_free_file_descriptors():
    """Every file descriptor this process may have in use, as on a host that
    ran out of them: the next one opened fails with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    fillers = []
    try:
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# The egress gateway's tests: loopback upstreams A and A over TLS (which
# policies allow) and B (which none does), and the requests guests send.

SECRET = "Bearer s3cr3t-policy-value-7f3a"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def upstreams(nursery, ca):
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    a = await start_upstream(nursery, "http")
    b = await start_upstream(nursery, "http")
    a_tls = await start_upstream(nursery, "https", server_context)
    return a, b, a_tls


@pytest.fixture
def client_context(ca) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def policy_for(*upstreams: Upstream, headers: dict | None = None) -> dict:
    return {"allow": [{"origin": u.origin, "headers": headers or {"authorization": SECRET}} for u in upstreams]}


def http(method: str, target: str, host: str, *headers: str, body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", *headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# Real upstreams for the tools the egress proxy serves (pip, git, npm, curl):
# each an HTTPS server on loopback with a certificate from ``ca``, and an
# environment in which the tools trust that CA and read no host config.


@pytest.fixture
def ca_pem(ca, tmp_path) -> Path:
    """The CA's certificate as a PEM file, for the tools."""
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
def host_tool_env(tmp_path, ca_pem) -> dict[str, str]:
    """For tools run on the host: HOME (and so pip's and npm's caches) in tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    return tool_env(home, ca_pem)


@pytest.fixture
async def package_index(request, nursery, ca) -> PackageIndex:
    """demo_packages(N) on a PEP 503 index, N = 2 unless parametrized
    indirectly (``@pytest.mark.parametrize("package_index", [20], indirect=True)``)."""
    return await start_package_index(nursery, ca, demo_packages(getattr(request, "param", 2)))


@pytest.fixture
async def git_server(nursery, ca, tmp_path) -> GitServer:
    """Serves tmp_path/git-root, which has repo.git: one commit with README.md ("hello from git.test")."""
    root = tmp_path / "git-root"
    root.mkdir()
    make_repository(root, "repo.git", {"README.md": "hello from git.test\n"})
    return await start_git_server(nursery, ca, root)


@pytest.fixture
async def npm_registry(request, nursery, ca) -> NpmRegistry:
    """demo_packages(N) as npm packages, N = 2 unless parametrized indirectly."""
    return await start_npm_registry(nursery, ca, demo_packages(getattr(request, "param", 2)))
