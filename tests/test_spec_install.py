"""A spec's [install]: pip and npm packages installed in the session when
the sandbox is built, through its proxy under the spec's network policy.
The index and registry are tests/egress_upstreams.py's, allowed by name as
https://localhost:PORT; the guests trust the test CA (a template file) and
send loopback through the proxy, as in test_egress_proxy.py."""

from __future__ import annotations

import json
import sys

import pytest
import trio
from conftest import refused
from egress_upstreams import tool_env

import sandboxns
from sandboxns import ErrorCode, SandboxSpec

pytestmark = pytest.mark.smoke

GUEST_PATH = "/usr/local/bin:/usr/bin:/bin"
PIP = ["sandboxns-demo-0==1.0"]
NPM = ["sandboxns-demo-0@1.0.0"]
# Each demo package pulls in sandboxns-demo-1; the python is the venv's.
IMPORT = "import sys, sandboxns_demo_0 as a, sandboxns_demo_1 as b; print(sys.prefix, a.NAME, b.NAME)"
REQUIRE = "const a = require('sandboxns-demo-0'); console.log(a.name, a.dependencies['sandboxns-demo-1'].name)"


def spec_document(driver: str, ca_pem, *, package_index=None, npm_registry=None, **install) -> dict:
    """A spec that installs ``install``'s packages from the servers given,
    each named as its tool's source and allowed by name."""
    sources = {}
    if package_index is not None:
        sources["pip_index_url"] = f"https://localhost:{package_index.server.port}/simple/"
    if npm_registry is not None:
        sources["npm_registry"] = f"https://localhost:{npm_registry.server.port}/"
    guest_env = {**tool_env("/workspace", "/workspace/ca.pem", GUEST_PATH), "NO_PROXY": "", "no_proxy": ""}
    return {
        "id": "installing",
        "driver": driver,
        "template": {"files": {"ca.pem": ca_pem.read_text()}},
        "env": {"vars": guest_env},
        "network": {"egress": [{"origin": url.removesuffix("simple/").removesuffix("/")} for url in sources.values()]},
        "install": {**sources, **install},
    }


async def test_a_built_sandbox_has_its_packages_and_a_resume_keeps_them(
    driver_name, tmp_path, ca_pem, package_index, npm_registry
):
    spec = SandboxSpec.from_dict(
        spec_document(driver_name, ca_pem, package_index=package_index, npm_registry=npm_registry, pip=PIP, npm=NPM)
    )
    assert spec.validate() == []
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        pip, npm = sandbox.installs
        assert (pip.tool, pip.packages, pip.result.exit_code) == ("pip", tuple(PIP), 0)
        assert "Successfully installed sandboxns-demo-0-1.0 sandboxns-demo-1-1.0" in pip.result.stdout
        assert (npm.tool, npm.packages, npm.result.exit_code) == ("npm", tuple(NPM), 0)
        assert "added 2 packages" in npm.result.stdout
        session = sandbox.session
        imported = await session.run("python", ["-c", IMPORT])
        assert imported.stdout.split() == ["/workspace/.venv", "sandboxns-demo-0", "sandboxns-demo-1"], imported
        assert (await session.run("node", ["-e", REQUIRE])).stdout.split() == ["sandboxns-demo-0", "sandboxns-demo-1"]
        state = sandbox.handle.capture_state()
    # Through the proxy, with the guest's own TLS: the upstreams saw its SNI.
    assert {request.sni for request in [*package_index.server.requests, *npm_registry.server.requests]} == {"localhost"}
    fetched = len(package_index.server.requests), len(npm_registry.server.requests)
    # Resumed, the session still has its packages, and nothing is fetched again.
    async with (
        sandboxns.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend,
        await backend.create(state=state, template=state["template"], network=spec.network_policy()) as handle,
    ):
        spec.configure_session(handle.session)
        imported_again = await handle.session.run("python", ["-c", IMPORT])
        required_again = await handle.session.run("node", ["-e", REQUIRE])
    assert imported_again.stdout == imported.stdout, imported_again
    assert required_again.stdout.split() == ["sandboxns-demo-0", "sandboxns-demo-1"], required_again
    assert (len(package_index.server.requests), len(npm_registry.server.requests)) == fetched


@pytest.mark.parametrize(("tool", "missing"), [("pip", "no-such-package==9"), ("npm", "no-such-package@9")])
async def test_a_package_that_cannot_be_installed_fails_the_build_and_leaves_no_session(
    driver_name, tmp_path, ca_pem, package_index, npm_registry, tool, missing
):
    # When npm fails, pip has installed its packages already: they go with the session.
    listed = {"pip": [*PIP, missing], "npm": NPM} if tool == "pip" else {"pip": PIP, "npm": [*NPM, missing]}
    spec = SandboxSpec.from_dict(
        spec_document(driver_name, ca_pem, package_index=package_index, npm_registry=npm_registry, **listed)
    )
    error = await refused(ErrorCode.SANDBOX_UNAVAILABLE, spec.build(state_directory=tmp_path / "state"))
    # The message names what failed, and the tool's own last lines say why.
    assert f"installing {', '.join(listed[tool])} with {tool} failed: {tool} exited with status 1" in error.message
    said = "No matching distribution found for no-such-package==9" if tool == "pip" else "404 Not Found"
    assert said in error.message, error.message
    assert list((tmp_path / "state" / "sessions").iterdir()) == []


async def test_an_index_that_needs_a_token_is_installed_from_through_the_intercepted_tunnel(
    driver_name, tmp_path, package_index, client_context
):
    # The egress entry gives the index a token from the host's environment:
    # pip trusts the session's CA (the spec names no CA of its own) and the
    # gateway sends each request on with the token, which the guest never has.
    origin = f"https://localhost:{package_index.server.port}"
    trust = {
        "PIP_CERT",
        "GIT_SSL_CAINFO",
        "npm_config_cafile",
        "NODE_EXTRA_CA_CERTS",
        "CURL_CA_BUNDLE",
        "SSL_CERT_FILE",
    }
    guest_env = {name: value for name, value in tool_env("/workspace", "", GUEST_PATH).items() if name not in trust}
    spec = SandboxSpec.from_dict(
        {
            "id": "token",
            "driver": driver_name,
            "env": {"vars": {**guest_env, "NO_PROXY": "", "no_proxy": ""}},
            "network": {"egress": [{"origin": origin, "headers": {"authorization": {"env": "INDEX_TOKEN"}}}]},
            "install": {"pip": PIP, "pip_index_url": f"{origin}/simple/"},
        }
    )
    assert spec.validate() == []
    secret = "Bearer index-token-4ff1"
    async with spec.build(
        state_directory=tmp_path / "state", host_env={"INDEX_TOKEN": secret}, upstream_ssl_context=client_context
    ) as sandbox:
        [pip] = sandbox.installs
        assert pip.result.exit_code == 0, pip.result
        imported = await sandbox.session.run("python", ["-c", IMPORT])
        # (The script spells the token's tail in two pieces, so its own command line does not hold it.)
        seen = await sandbox.session.run("sh", ["-c", "env; cat /proc/*/cmdline; grep -r 4f''f1 /workspace"])
    assert imported.stdout.split() == ["/workspace/.venv", "sandboxns-demo-0", "sandboxns-demo-1"], imported
    assert package_index.server.requests
    assert all(request.headers["authorization"] == secret for request in package_index.server.requests)
    assert seen.stdout and "4ff1" not in seen.stdout + seen.stderr


def test_install_problems_have_their_fields():
    bad = {
        "id": "x",
        "network": {"egress": [{"origin": "https://pypi.org"}]},
        "install": {
            "pip": ["ok==1", 7, "", "two words", "--index-url=https://evil.example/", "x" * 300, "bell\a"],
            "npm": "left-pad",
            "pip_index_url": "ftp://pypi.org/simple/",
            "npm_registry": "https://user:s3cret@registry.example/",
            "timeout": 0,
            "yarn": ["x"],
        },
    }
    problems = {problem.field: problem.message for problem in SandboxSpec.from_dict(bad).validate()}
    assert set(problems) == {
        "install.pip[1]",
        "install.pip[2]",
        "install.pip[3]",
        "install.pip[4]",
        "install.pip[5]",
        "install.pip[6]",
        "install.npm",
        "install.pip_index_url",
        "install.npm_registry",
        "install.timeout",
        "install.yarn",
    }, problems
    assert (
        problems["install.pip[4]"]
        == "must not start with '-': '--index-url=https://evil.example/' would be read as an option"
    )
    assert "white space" in problems["install.pip[3]"] and problems["install.pip[2]"] == "must not be empty"
    assert "s3cret" not in json.dumps(problems)  # a would-be credential is not echoed back
    too_many = SandboxSpec.from_dict({"id": "x", "network": {"egress": "internet"}, "install": {"npm": ["a"] * 257}})
    [problem] = too_many.validate()
    assert (problem.field, problem.message) == ("install.npm", "lists 257 packages; at most 256")


@pytest.mark.parametrize(
    ("network", "install", "field", "message"),
    [
        # deny-all, the default: nothing to fetch from.
        (
            {},
            {"pip": ["x"]},
            "install.pip",
            "pip fetches from https://pypi.org, which network.egress ('deny-all') does not allow",
        ),
        (
            {"egress": [{"origin": "https://pypi.org"}]},
            {"npm": ["x"]},
            "install.npm",
            "npm fetches from https://registry.npmjs.org, which network.egress does not allow",
        ),
        (
            {"egress": [{"origin": "https://*.example.com"}]},
            {"pip": ["x"], "pip_index_url": "https://example.com/simple/"},
            "install.pip_index_url",
            "pip fetches from https://example.com, which network.egress does not allow",
        ),
    ],
)
def test_installs_need_an_egress_that_reaches_their_source(network, install, field, message):
    [problem] = SandboxSpec.from_dict({"id": "x", "network": network, "install": install}).validate()
    assert problem.field == field and message in problem.message, problem


@pytest.mark.parametrize(
    ("network", "install"),
    [
        ("internet", {"pip": ["requests==2.32.3"], "npm": ["typescript@5"]}),
        ("allow-all", {"pip": ["requests"]}),
        ([{"origin": "https://*.example.com"}], {"npm": ["x"], "npm_registry": "https://npm.example.com:443/"}),
        # Injected headers: the gateway reads those requests, plain or (https) in its intercepted tunnel.
        (
            [{"origin": "http://pypi.internal:8080", "headers": {"authorization": {"env": "TOKEN"}}}],
            {"pip": ["x"], "pip_index_url": "http://pypi.internal:8080/simple/"},
        ),
        (
            [{"origin": "https://pypi.example.com", "headers": {"authorization": {"env": "TOKEN"}}}],
            {"pip": ["x"], "pip_index_url": "https://pypi.example.com/simple/"},
        ),
        ("deny-all", {"pip": [], "npm": [], "timeout": 5}),  # nothing to install, nothing to reach
    ],
)
def test_installs_that_can_reach_their_source_are_valid(network, install):
    assert SandboxSpec.from_dict({"id": "x", "network": {"egress": network}, "install": install}).validate() == []


def test_installs_make_their_packages_found_by_every_command():
    spec = SandboxSpec.from_dict(
        {
            "id": "x",
            "env": {"vars": {"PATH": "/opt/bin:/usr/bin", "NODE_PATH": "/opt/node"}},
            "network": {"egress": "internet"},
            "install": {"pip": ["a"], "npm": ["b"]},
        }
    )
    environment = spec.environment({})
    assert environment["PATH"] == "/workspace/.venv/bin:/workspace/.npm-global/bin:/opt/bin:/usr/bin"
    assert environment["NODE_PATH"] == "/workspace/.npm-global/lib/node_modules:/opt/node"
    assert (environment["VIRTUAL_ENV"], environment["npm_config_prefix"]) == (
        "/workspace/.venv",
        "/workspace/.npm-global",
    )
    assert SandboxSpec.from_dict({"id": "x"}).environment({}) == sandboxns._session.DEFAULT_ENV


async def sandboxns_cli(*args: str, cwd) -> trio.CompletedProcess:
    # In this trio run, so that the upstreams serve while the command runs.
    return await trio.run_process(
        [sys.executable, "-m", "sandboxns", *args], cwd=cwd, check=False, capture_stdout=True, capture_stderr=True
    )


async def test_the_cli_runs_a_spec_with_installs_and_exec_does_not_reinstall(
    driver_name, tmp_path, ca_pem, package_index
):
    spec_file = tmp_path / "box.json"
    spec_file.write_text(json.dumps(spec_document(driver_name, ca_pem, package_index=package_index, pip=PIP)))
    state = str(tmp_path / "state")
    done = await sandboxns_cli(
        "run", "--spec", str(spec_file), "--state-dir", state, "--", "python", "-c", IMPORT, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [b"/workspace/.venv", b"sandboxns-demo-0", b"sandboxns-demo-1"]
    session = done.stderr.split(b"--session ")[1].split()[0].decode()
    fetched = len(package_index.server.requests)
    again = await sandboxns_cli(
        "exec", "--state-dir", state, "--session", session, "--spec", str(spec_file), "--", "python", "-c", IMPORT,
        cwd=tmp_path,
    )  # fmt: skip
    assert again.stdout == done.stdout, again.stderr
    assert len(package_index.server.requests) == fetched

    spec_file.write_text(
        json.dumps(spec_document(driver_name, ca_pem, package_index=package_index, pip=["no-such-package==9"]))
    )
    failed = await sandboxns_cli("run", "--spec", str(spec_file), "--state-dir", state, "--", "true", cwd=tmp_path)
    assert failed.returncode == 125 and failed.stdout == b""
    assert b"sandboxns: installing no-such-package==9 with pip failed" in failed.stderr
    assert b"No matching distribution found for no-such-package==9" in failed.stderr
