"""Declarative sandbox specs: loading, validation, building."""

from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import trio
from conftest import refused

import sandboxns
from sandboxns import ErrorCode, SandboxError, SandboxSpec
from sandboxns._network import check_network_policy

pytestmark = pytest.mark.smoke

TOML = """
id = "py-agent"
description = "an agent's box"
driver = "{driver}"

[template.files]
"main.py" = "print('hello')\\n"
"pkg/data.txt" = "data"

[env]
vars = {{ GREETING = "hi" }}
passthrough = ["SPEC_TEST_USER"]
auto_passthrough = true

[network]
egress = [{{ origin = "https://api.example.com", headers = {{ authorization = {{ env = "SPEC_TEST_TOKEN", prefix = "Bearer " }} }} }}]

[limits]
timeout = 2
max_output_bytes = 64
max_file_bytes = 100
max_concurrent_commands = 3

[lifecycle]
idle_timeout = 600
destroy_on_close = true
"""

SAME_AS_JSON = {
    "id": "py-agent",
    "description": "an agent's box",
    "driver": "native",
    "template": {"files": {"main.py": "print('hello')\n", "pkg/data.txt": "data"}},
    "env": {"vars": {"GREETING": "hi"}, "passthrough": ["SPEC_TEST_USER"], "auto_passthrough": True},
    "network": {
        "egress": [
            {
                "origin": "https://api.example.com",
                "headers": {"authorization": {"env": "SPEC_TEST_TOKEN", "prefix": "Bearer "}},
            }
        ]
    },
    "limits": {"timeout": 2, "max_output_bytes": 64, "max_file_bytes": 100, "max_concurrent_commands": 3},
    "lifecycle": {"idle_timeout": 600, "destroy_on_close": True},
}

SANDBOX_MD = """---
id: py-agent
description: an agent's box
driver: native
template:
  files:
    main.py: "print('hello')\\n"
    pkg/data.txt: data
env:
  vars: {GREETING: hi}
  passthrough: [SPEC_TEST_USER]
  auto_passthrough: true
network:
  egress:
    - origin: https://api.example.com
      headers:
        authorization: {env: SPEC_TEST_TOKEN, prefix: "Bearer "}
limits: {timeout: 2, max_output_bytes: 64, max_file_bytes: 100, max_concurrent_commands: 3}
lifecycle: {idle_timeout: 600, destroy_on_close: true}
---

# py-agent

Prose about the sandbox, for people.
"""

HOST = {
    "SPEC_TEST_USER": "alice",
    "SPEC_TEST_TOKEN": "s3cret-token",
    "SPEC_TEST_KEY": "sk-auto-7e1d",
    "GREETING": "host",
}
# The caller's credential variables: one the host lacks, one the spec passes
# through anyway, one it sets itself.
CREDENTIALS = ("SPEC_TEST_KEY", "SPEC_TEST_UNSET", "SPEC_TEST_USER", "GREETING")


def write(tmp_path, name: str, text: str | bytes):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_toml_json_and_sandbox_md_say_the_same_thing(tmp_path):
    specs = [
        SandboxSpec.load(write(tmp_path, "box.toml", TOML.format(driver="native"))),
        SandboxSpec.load(write(tmp_path, "box.json", json.dumps(SAME_AS_JSON))),
        SandboxSpec.load(write(tmp_path, "SANDBOX.md", SANDBOX_MD)),
    ]
    for spec in specs:
        assert spec.validate() == [], spec
        assert spec.id == "py-agent" and spec.driver == "native"
        assert spec.limits == sandboxns.SpecLimits(2, 64, 100, 3)
        assert spec.environment(HOST) == {**sandboxns._session.DEFAULT_ENV, "GREETING": "hi", "SPEC_TEST_USER": "alice"}
        assert spec.environment(HOST, credential_env=CREDENTIALS) == {
            **spec.environment(HOST),
            "SPEC_TEST_KEY": "sk-auto-7e1d",
        }
        assert spec.network_policy(HOST) == check_network_policy(
            {"allow": [{"origin": "https://api.example.com", "headers": {"authorization": "Bearer s3cret-token"}}]}
        )
        assert spec.template_files() == {"main.py": b"print('hello')\n", "pkg/data.txt": b"data"}


def test_validate_lists_every_problem_with_its_field(tmp_path):
    bad = """
id = "no spaces allowed"
driver = "qemu"
colour = "red"
[template]
files = 3
[env]
vars = { GREETING = 1, "BAD=NAME" = "x" }
passthrough = ["OK", 7]
auto_passthrough = "yes"
[network]
egress = [{ origin = "ftp://example.com", headers = { authorization = "Bearer literal-secret" } }, { headers = {} }]
[limits]
timeout = -1
max_output_bytes = "lots"
surprise = 1
[lifecycle]
destroy_on_close = "yes"
idle_timeout = 0
retain_stopped = -5
"""
    spec = SandboxSpec.load(write(tmp_path, "bad.toml", bad))
    problems = {problem.field: problem.message for problem in spec.validate()}
    assert set(problems) == {
        "colour",
        "id",
        "driver",
        "template.files",
        "env.vars.GREETING",
        "env.vars.BAD=NAME",
        "env.passthrough[1]",
        "env.auto_passthrough",
        "network.egress[0].origin",
        "network.egress[0].headers.authorization",
        "network.egress[1].origin",
        "limits.timeout",
        "limits.max_output_bytes",
        "limits.surprise",
        "lifecycle.destroy_on_close",
        "lifecycle.idle_timeout",
        "lifecycle.retain_stopped",
    }
    assert "not a known field" in problems["colour"]
    assert problems["lifecycle.retain_stopped"] == "must be from 0.001 to inf, not -5"
    assert problems["env.auto_passthrough"] == "must be true or false, not a string"
    assert "never holds a credential" in problems["network.egress[0].headers.authorization"]
    assert "literal-secret" not in json.dumps(problems)  # a would-be secret is not echoed back


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("box.toml", "id = ", "cannot parse"),
        ("box.json", "{", "cannot parse"),
        ("SANDBOX.md", "# no front matter\n", "front matter"),
        ("SANDBOX.md", "---\nid: [unclosed\n---\n", "cannot parse"),
        ("box.yaml", "id: x", "unknown spec format"),
        ("box.json", "[1, 2]", "must be a table of fields"),
    ],
)
def test_unparseable_documents_are_problems_not_exceptions(tmp_path, name, text, expected):
    spec = SandboxSpec.load(write(tmp_path, name, text))
    [problem] = spec.validate()
    assert expected in problem.message


def test_a_missing_file_is_not_found(tmp_path):
    with pytest.raises(SandboxError) as error:
        SandboxSpec.load(tmp_path / "nowhere.toml")
    assert error.value.code == ErrorCode.SANDBOX_NOT_FOUND


async def test_an_invalid_spec_starts_nothing(tmp_path):
    spec = SandboxSpec.from_dict({"id": "x", "limits": {"timeout": "soon"}})
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, spec.build(state_directory=tmp_path / "state"))
    assert not (tmp_path / "state").exists()


async def test_missing_host_variables_are_refused_before_anything_starts(tmp_path):
    spec = SandboxSpec.load(write(tmp_path, "box.toml", TOML.format(driver="native")))
    error = await refused(
        ErrorCode.SANDBOX_INVALID_ARGUMENT,
        spec.build(state_directory=tmp_path / "state", host_env={"SPEC_TEST_USER": "alice"}),
    )
    assert "SPEC_TEST_TOKEN" in error.message
    assert not (tmp_path / "state").exists()


async def test_a_built_sandbox_applies_the_spec(driver_name, tmp_path):
    spec = SandboxSpec.load(write(tmp_path, "box.toml", TOML.format(driver=driver_name)))
    building = spec.build(state_directory=tmp_path / "state", host_env=HOST, credential_env=CREDENTIALS)
    async with building as sandbox:
        session = sandbox.session
        assert sandbox.backend.name == driver_name and sandbox.backend.max_concurrent_commands == 3
        assert session.network.kind == "allow" and "s3cret" not in repr(session.network)
        shown = "cat main.py pkg/data.txt; echo; echo $GREETING $SPEC_TEST_USER $SPEC_TEST_KEY ${SPEC_TEST_UNSET-unset}"
        result = await session.run("sh", ["-c", shown])
        assert result.stdout == "print('hello')\ndata\nhi alice sk-auto-7e1d unset\n"
        assert "SPEC_TEST_TOKEN" not in (await session.run("env")).stdout  # header values never reach the guest
        assert (await session.run("sh", ["-c", "head -c 1000 /dev/zero"])).truncated  # max_output_bytes = 64
        assert (await session.run("sleep", ["10"])).timed_out  # timeout = 2
        await refused(ErrorCode.SANDBOX_LIMIT, session.write_file("big", b"x" * 101))  # max_file_bytes = 100
        session_dir = tmp_path / "state" / "sessions" / sandbox.handle.session_id
        assert session_dir.is_dir()
        # Passthrough (explicit or automatic) and header values live in
        # memory only, never on disk.
        for stored in (tmp_path / "state").rglob("*"):
            if stored.is_file() and not stored.is_symlink():
                content = stored.read_bytes()
                assert b"alice" not in content and b"s3cret" not in content and b"sk-auto" not in content, stored
    assert not session_dir.exists()  # destroy_on_close


def test_credentials_pass_through_only_when_the_spec_asks():
    spec = SandboxSpec.from_dict({"id": "plain", "env": {"passthrough": ["SPEC_TEST_USER"]}})
    assert "SPEC_TEST_KEY" not in spec.environment(HOST, credential_env=CREDENTIALS)


@pytest.mark.parametrize("names", ["SPEC_TEST_KEY", ["SPEC_TEST_KEY", 7], ["BAD=NAME"], None])
async def test_bad_credential_env_is_refused_before_anything_starts(tmp_path, names):
    spec = SandboxSpec.from_dict({"id": "auto", "env": {"auto_passthrough": True}})
    building = spec.build(state_directory=tmp_path / "state", host_env=HOST, credential_env=names)
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, building)
    assert "credential_env must be" in error.message
    assert not (tmp_path / "state").exists()


async def test_awaiting_build_and_a_kept_session(tmp_path):
    (tmp_path / "files" / "sub").mkdir(parents=True)
    (tmp_path / "files" / "sub" / "f.txt").write_text("from a directory")
    spec = SandboxSpec.from_dict({"id": "kept", "template": {"files": "files"}}, base=tmp_path)
    sandbox = await spec.build(state_directory=tmp_path / "state")
    try:
        assert (await sandbox.session.read_text_file("sub/f.txt")) == "from a directory"
        await sandbox.session.write_file("new.txt", b"stays")
        state = sandbox.handle.capture_state()
    finally:
        await sandbox.aclose()
    async with sandboxns.open_backend(state_directory=tmp_path / "state") as backend:
        handle = await backend.create(state=state, template=state["template"])
        async with handle:
            assert await handle.session.read_text_file("new.txt") == "stays"


async def test_a_spec_binds_a_workspace(tmp_path):
    (tmp_path / "project").mkdir()
    spec = SandboxSpec.from_dict({"id": "bound", "workspace": "project"}, base=tmp_path)
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        await sandbox.session.run("sh", ["-c", "echo written > out.txt"])
    assert (tmp_path / "project" / "out.txt").read_text() == "written\n"


async def test_template_symlinks_and_special_files_are_problems(tmp_path):
    (tmp_path / "files" / "sub").mkdir(parents=True)
    (tmp_path / "files" / "kept.txt").write_text("fine")
    os.symlink("/etc/passwd", tmp_path / "files" / "link")
    os.symlink("/etc", tmp_path / "files" / "sub" / "dirlink")
    os.mkfifo(tmp_path / "files" / "sub" / "fifo")
    spec = SandboxSpec.from_dict({"id": "links", "template": {"files": "files"}}, base=tmp_path)
    problems = spec.validate()
    assert {problem.field for problem in problems} == {"template.files"}
    assert sorted(problem.message.split()[0].rsplit("/", 1)[1] for problem in problems) == ["dirlink", "fifo", "link"]
    # Building reads the directory before anything starts, refusing the same.
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, spec.build(state_directory=tmp_path / "state"))
    assert not (tmp_path / "state").exists()


def test_each_bad_inline_template_path_is_its_own_problem():
    spec = SandboxSpec.from_dict({"id": "x", "template": {"files": {"../a": "x", "/etc/b": "y", "ok.txt": "z"}}})
    assert sorted(problem.field for problem in spec.validate()) == [
        'template.files["../a"]',
        'template.files["/etc/b"]',
    ]


def test_a_file_that_is_not_utf8_is_a_problem(tmp_path):
    spec = SandboxSpec.load(write(tmp_path, "box.toml", "id = 'x'\n# caf\xe9\n".encode("latin-1")))
    [problem] = spec.validate()
    assert problem.field == "" and "not UTF-8" in problem.message


async def test_create_session_checks_the_backend_driver(tmp_path):
    spec = SandboxSpec.from_dict({"id": "x", "driver": "bwrap"})
    async with sandboxns.open_backend(state_directory=tmp_path / "state") as backend:
        await refused(ErrorCode.SANDBOX_STATE_MISMATCH, spec.create_session(backend))


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"id": "x", "driver": []}, "driver"),
        ({"id": "x", "env": {"vars": 5}}, "env.vars"),
        ({"id": "x", "env": {"vars": {None: "x"}}}, "env.vars"),
        (
            {"id": "x", "network": {"egress": [{"origin": "https://a.example", "headers": True}]}},
            "network.egress[0].headers",
        ),
        ({"id": "x", "limits": {"timeout": 10**400}}, "limits.timeout"),
        ({"id": "x", "limits": {"max_file_bytes": 2**63 - 1}}, "limits.max_file_bytes"),
        ({"id": "x", "lifecycle": {"idle_timeout": 10**400}}, "lifecycle.idle_timeout"),
        ({"id": "x", "lifecycle": {"retain_stopped": True}}, "lifecycle.retain_stopped"),
        ({"id": "x", "lifecycle": {"retain_stopped": float("nan")}}, "lifecycle.retain_stopped"),
        ({"id": "x", "template": {"files": "a\0b"}}, "template.files"),
        ({"id": "x", "template": {"files": {"a": "1", "./a": "2"}}}, "template.files"),
        ({"id": "x", "template": {"files": {"d": "1", "d/e": "2"}}}, "template.files"),
        ({"id": "x", "template": {"files": {".": "1"}}}, 'template.files["."]'),
        (
            {"id": "x", "network": {"egress": [{"origin": "https://a.example", "headers": {"X Bad": {"env": "T"}}}]}},
            "network.egress[0].headers.X Bad",
        ),
        (
            {
                "id": "x",
                "network": {"egress": [{"origin": "https://a.example", "headers": {"Proxy-Auth": {"env": "T"}}}]},
            },
            "network.egress[0].headers.Proxy-Auth",
        ),
        (
            {
                "id": "x",
                "network": {
                    "egress": [
                        {
                            "origin": "https://a.example",
                            "headers": {"Authorization": {"env": "A"}, "authorization": {"env": "B"}},
                        }
                    ]
                },
            },
            "network.egress[0].headers.authorization",
        ),
    ],
)
def test_odd_documents_are_problems_with_their_field(document, field):
    problems = SandboxSpec.from_dict(document).validate()
    assert field in {problem.field for problem in problems}, problems


@pytest.mark.parametrize(
    "lifecycle",
    [
        {"destroy_on": []},
        {"destroy_on": ["close"], "destroy_on_close": True},
        {"destroy_on": [], "destroy_on_close": False},
        {"destroy_on": ["idle", "close"], "idle_timeout": 60},
    ],
)
def test_destroy_on_and_destroy_on_close_may_both_be_given_if_they_agree(lifecycle):
    assert SandboxSpec.from_dict({"id": "x", "lifecycle": lifecycle}).validate() == []


@pytest.mark.parametrize(
    ("lifecycle", "field", "message"),
    [
        ({"destroy_on": "close"}, "lifecycle.destroy_on", "must be a list drawn from 'close' and 'idle'"),
        ({"destroy_on": ["close", "kill"]}, "lifecycle.destroy_on[1]", "must be 'close' or 'idle', not 'kill'"),
        ({"destroy_on": [["close"]]}, "lifecycle.destroy_on[0]", "must be 'close' or 'idle'"),
        ({"destroy_on": ["close", "close"]}, "lifecycle.destroy_on[1]", "listed twice"),
        ({"destroy_on": ["idle"]}, "lifecycle.destroy_on", "'idle' needs a lifecycle.idle_timeout"),
        ({"destroy_on": ["close"], "destroy_on_close": False}, "lifecycle.destroy_on_close", "give one of them"),
        ({"destroy_on": [], "destroy_on_close": True}, "lifecycle.destroy_on_close", "give one of them"),
    ],
)
def test_a_bad_destroy_on_is_one_problem_at_its_field(lifecycle, field, message):
    [problem] = SandboxSpec.from_dict({"id": "x", "lifecycle": lifecycle}).validate()
    assert (problem.field, message in problem.message) == (field, True), problem


@pytest.mark.parametrize(
    "text", ["---\nid: !!int abc\n---\n", "---\nid: !!bool maybe\n---\n", "---\nid: !!timestamp x\n---\n"]
)
def test_yaml_tags_that_cannot_construct_are_problems(tmp_path, text):
    [problem] = SandboxSpec.load(write(tmp_path, "SANDBOX.md", text)).validate()
    assert "cannot parse" in problem.message


def test_deep_nesting_and_alias_bombs_stay_problems(tmp_path):
    deep = SandboxSpec.load(write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000))
    assert "cannot parse" in deep.validate()[0].message
    bomb = "---\na: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    bomb += "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nid: x\nnetwork: {egress: *c}\n---\n"
    problems = SandboxSpec.load(write(tmp_path, "SANDBOX.md", bomb)).validate()
    assert sum(len(str(problem)) for problem in problems) < 10_000


def test_two_unparsable_origins_are_not_duplicates():
    spec = SandboxSpec.from_dict({"id": "x", "network": {"egress": [{"origin": "ftp://a"}, {"origin": "ftp://b"}]}})
    assert not any("twice" in problem.message for problem in spec.validate())


async def test_a_build_is_used_once_and_its_await_form_nests_in_cancel_scopes(tmp_path):
    spec = SandboxSpec.from_dict({"id": "once"})
    building = spec.build(state_directory=tmp_path / "state")
    with trio.fail_after(30):
        sandbox = await building
    with trio.move_on_after(30):
        assert (await sandbox.session.run("true")).exit_code == 0
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, building)
    with trio.move_on_after(30):
        await sandbox.aclose()
    await refused(ErrorCode.SANDBOX_STOPPED, sandbox.session.run("true"))


async def test_a_spec_sets_the_sessions_confinement(driver_name, tmp_path):
    text = f"""
id = "bounded"
driver = "{driver_name}"
[limits]
processes = 77
open_files = 55
tmp_size = 8388608
[seccomp]
allow = ["ptrace"]
deny = ["uname"]
"""
    spec = SandboxSpec.load(write(tmp_path, "box.toml", text))
    assert spec.validate() == []
    assert spec.confinement.limits.processes == 77 and spec.confinement.seccomp.deny == {"uname"}
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        result = await sandbox.session.run(
            "sh", ["-c", "ulimit -n; df -k /tmp | tail -n 1 | awk '{print $2}'; uname || echo denied"]
        )
    assert result.stdout.split() == ["55", "8192", "denied"], result


def test_confinement_problems_have_their_fields(tmp_path):
    text = """
id = "bounded"
[limits]
processes = 0
open_files = "many"
address_space = 99999999999999999999999
tmp_size = 10
[seccomp]
allow = ["everything"]
deny = "uname"
"""
    problems = [problem.field for problem in SandboxSpec.load(write(tmp_path, "box.toml", text)).validate()]
    assert len(problems) == len(set(problems))  # each once
    assert set(problems) == {
        "limits.processes",
        "limits.open_files",
        "limits.address_space",
        "limits.tmp_size",
        "seccomp.allow",
        "seccomp.deny",
    }


async def test_an_awaited_build_lives_in_the_given_nursery(tmp_path):
    spec = SandboxSpec.from_dict({"id": "nursed", "template": {"files": {"a.txt": "a"}}})
    async with trio.open_nursery() as nursery:
        sandbox = await spec.build(state_directory=tmp_path / "state", nursery=nursery)
        assert (await sandbox.session.run("cat", ["a.txt"])).stdout == "a"
        nursery.cancel_scope.cancel()  # the nursery's end ends the sandbox
    assert not sandbox.handle.live
    await refused(ErrorCode.SANDBOX_STOPPED, sandbox.session.run("true"))
    await sandbox.aclose()  # and closing it afterwards is harmless
    async with sandboxns.open_backend(state_directory=tmp_path / "state") as backend:
        # Stopped cleanly, so it resumes.
        resumed = await backend.create(state=sandbox.handle.capture_state(), template=sandbox.handle.template_key)
        await resumed.aclose()


async def test_nursery_is_only_for_the_awaited_form(tmp_path):
    spec = SandboxSpec.from_dict({"id": "nursed"})
    async with trio.open_nursery() as nursery:
        building = spec.build(state_directory=tmp_path / "state", nursery=nursery)
        with pytest.raises(SandboxError) as error:
            async with building:
                pass
        assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    with pytest.raises(SandboxError) as error:
        spec.build(nursery="mine")
    assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert not (tmp_path / "state").exists()


def test_a_spec_is_resolved_once_when_it_is_made():
    document = {"id": "fixed", "env": {"vars": {"A": "1"}}}
    spec = SandboxSpec.from_dict(document)
    document["id"] = "changed"
    document["env"]["vars"]["A"] = "2"
    document["limits"] = {"timeout": "soon"}
    assert spec.id == "fixed" and spec.validate() == []
    assert spec.environment({})["A"] == "1"
    with pytest.raises(AttributeError):
        spec.document = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec._checked().vars["A"] = "3"  # type: ignore[index]


async def test_a_build_whose_nursery_is_cancelled_or_ended_is_stopped(tmp_path):
    spec = SandboxSpec.from_dict({"id": "nursed"})

    async def hold(task_status=trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as given:
            task_status.started(given)
            await trio.sleep_forever()

    async with trio.open_nursery() as outer:
        given = await outer.start(hold)
        given.cancel_scope.cancel()  # ends before the build's task gets anywhere
        error = await refused(ErrorCode.SANDBOX_STOPPED, spec.build(state_directory=tmp_path / "s", nursery=given))
        assert "cancelled" in error.message
    await refused(ErrorCode.SANDBOX_STOPPED, spec.build(state_directory=tmp_path / "s", nursery=given))
    assert not list(tmp_path.rglob("session.json"))  # nothing was left behind


def test_a_spec_pickles_and_copies_as_the_value_it_is(tmp_path):
    spec = SandboxSpec.from_dict({"id": "carried", "env": {"vars": {"A": "1"}}}, base=tmp_path)
    for again in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert (again.id, again.base, again.source) == ("carried", tmp_path, "<dict>")
        assert again.environment({})["A"] == "1"
    broken = SandboxSpec.from_dict({"id": "x", "limits": {"timeout": "soon"}})
    assert pickle.loads(pickle.dumps(broken)).validate() == broken.validate() != []
