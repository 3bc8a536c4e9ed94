"""The egress proxy's upstreams are real: pip, git, npm, curl and Python's
urllib, unmodified, succeed against them on the host (no sandbox yet). The
proxy's tests will run the same tools inside a sandbox."""

from __future__ import annotations

import json
import os
import sys

import pytest
import trio
import trustme
from conftest import descendants
from egress_upstreams import make_repository

pytestmark = pytest.mark.smoke


async def run(argv: list[str], env: dict[str, str], cwd=None) -> str:
    """Run a tool to its end; its stdout. A failure says what the tool said."""
    result = await trio.run_process(
        [str(arg) for arg in argv], env=env, cwd=cwd, capture_stdout=True, capture_stderr=True, check=False
    )
    assert result.returncode == 0, f"{argv[:2]} exited {result.returncode}: {result.stderr.decode(errors='replace')}"
    return result.stdout.decode()


def by_ip(server) -> set[tuple[str | None, str | None]]:
    """(Host, SNI) of a client that connects by IP: it sends no SNI."""
    return {(f"127.0.0.1:{server.port}", None)}


async def test_pip_installs_a_package_and_its_dependency_from_the_index(package_index, host_tool_env, tmp_path):
    a, b = package_index.packages
    target = tmp_path / "target"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--index-url", package_index.index_url, "--target", target]
    await run([*pip, a], host_tool_env)
    # Importing a imports b: both came from the index.
    imported = await run(
        [sys.executable, "-c", "import sandboxns_demo_0 as a, sandboxns_demo_1 as b; print(a.NAME, b.NAME)"],
        {**host_tool_env, "PYTHONPATH": str(target)},
    )
    assert imported.split() == [a, b]
    requests = package_index.server.requests
    wheels = [f"/files/sandboxns_demo_{i}-1.0-py3-none-any.whl" for i in (0, 1)]
    assert sorted(r.path for r in requests) == wheels + [f"/simple/{p}/" for p in (a, b)]
    assert {(r.host, r.sni) for r in requests} == by_ip(package_index.server)


@pytest.mark.parametrize("package_index", [20], indirect=True)
async def test_pip_installs_twenty_packages_in_one_run(package_index, host_tool_env, tmp_path):
    target = tmp_path / "target"
    await run(
        [sys.executable, "-m", "pip", "install", "-q", "--index-url", package_index.index_url, "--target", target]
        + package_index.packages,
        host_tool_env,
    )
    installed = sorted(p.name for p in target.glob("sandboxns_demo_*.dist-info"))
    assert installed == sorted(f"sandboxns_demo_{i}-1.0.dist-info" for i in range(20))
    assert len(package_index.server.requests) == 40


async def test_git_clones_over_smart_http(git_server, host_tool_env, tmp_path):
    await run(["git", "clone", "-q", git_server.url("repo.git"), tmp_path / "clone"], host_tool_env)
    assert (tmp_path / "clone" / "README.md").read_text() == "hello from git.test\n"
    first, *posts = git_server.server.requests
    assert (first.method, first.target) == ("GET", "/repo.git/info/refs?service=git-upload-pack")
    assert posts and {(r.method, r.path) for r in posts} == {("POST", "/repo.git/git-upload-pack")}
    # Git-Protocol reached the backend: it answered in protocol v2 (ls-refs, then fetch).
    assert all(r.headers["git-protocol"] == "version=2" for r in git_server.server.requests)
    assert {(r.host, r.sni) for r in git_server.server.requests} == by_ip(git_server.server)
    # Every git http-backend the server started was reaped with its answer.
    assert descendants(os.getpid()) == set()


@pytest.mark.parametrize(
    ("tags", "config", "header", "value"),
    [
        # git gzips a request body over 1 KiB: 30 wants are about 1.5 KiB.
        (30, [], "content-encoding", "gzip"),
        # A body over http.postBuffer (64 KiB at least) goes chunked: 1500 wants are 75 KiB.
        (1500, ["-c", "http.postBuffer=65536"], "transfer-encoding", "chunked"),
    ],
)
async def test_git_fetches_with_a_large_request_body(git_server, host_tool_env, tmp_path, tags, config, header, value):
    make_repository(git_server.root, "tags.git", {"README.md": "tags\n"}, tags=tags)
    clone = tmp_path / "clone"
    await run(["git", *config, "clone", "-q", git_server.url("tags.git"), clone], host_tool_env)
    assert len((await run(["git", "-C", clone, "tag"], host_tool_env)).split()) == tags
    assert any(r.headers.get(header) == value for r in git_server.server.requests if r.method == "POST")


async def test_npm_installs_a_package_and_its_dependency_from_the_registry(npm_registry, host_tool_env, tmp_path):
    a, b = npm_registry.packages
    project = tmp_path / "project"
    project.mkdir()
    # A package.json of its own, so npm does not look for a project in the directories above.
    (project / "package.json").write_text(json.dumps({"name": "project", "version": "1.0.0", "private": True}))
    await run(["npm", "install", "--registry", npm_registry.url, "--no-audit", "--no-fund", a], host_tool_env, project)
    # a's index.js requires b: both came from the registry.
    script = f"const a = require({json.dumps(a)}); console.log(a.name, Object.keys(a.dependencies).join())"
    assert (await run(["node", "-e", script], host_tool_env, project)).split() == [a, b]
    requests = npm_registry.server.requests
    tarballs = [f"/{p}/-/{p}-1.0.0.tgz" for p in (a, b)]
    assert sorted(r.path for r in requests) == sorted([f"/{a}", f"/{b}", *tarballs])
    assert {(r.host, r.sni) for r in requests} == by_ip(npm_registry.server)


async def test_curl_reaches_a_server_by_its_made_up_name(package_index, host_tool_env, ca_pem):
    server = package_index.server
    host = f"{server.name}:{server.port}"
    # --resolve stands in for the proxy, which will resolve the name itself.
    curl = ["curl", "-q", "-sS", "--fail", "--cacert", ca_pem, "--resolve", f"{host}:127.0.0.1"]
    page = await run([*curl, f"{server.named_url}/simple/"], host_tool_env)
    assert all(f'href="{p}/"' in page for p in package_index.packages)
    [request] = server.requests
    assert (request.method, request.target, request.host, request.sni) == ("GET", "/simple/", host, "pypi.test")


async def test_python_urllib_reads_the_index(package_index, host_tool_env):
    program = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"
    page = await run([sys.executable, "-c", program, package_index.index_url], host_tool_env)
    assert all(f'href="{p}/"' in page for p in package_index.packages)
    assert [r.path for r in package_index.server.requests] == ["/simple/"]


async def test_a_client_that_does_not_trust_the_ca_gets_nothing(package_index, host_tool_env, tmp_path):
    """The servers' TLS is verified for real, and a refused handshake
    reaches no handler: nothing is recorded."""
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    result = await trio.run_process(
        ["curl", "-q", "-sS", "--cacert", str(other), package_index.index_url],
        env=host_tool_env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 60, result.stderr  # curl: the peer's certificate could not be verified
    assert package_index.server.requests == []
