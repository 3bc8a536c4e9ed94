"""The coding tools, on both drivers: what an agent can do, what the host's
hooks see, and every way a call is refused."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle

import pytest
import trio
from conftest import host_processes_with, kill_native_holder, no_free_file_descriptors, sleep_marker

import sandboxns
from sandboxns import CodingHooks, CodingLimits, ErrorCode, SandboxError, _coding, create_sandbox_coding_tools

pytestmark = pytest.mark.smoke


class Recorder:
    """An authorize hook that records every operation and says yes unless
    told otherwise."""

    def __init__(self) -> None:
        self.operations: list = []
        self.paths: list[str] = []
        self.deny_kinds: set[str] = set()
        self.deny_paths: set[str] = set()

    def authorize(self, operation) -> bool:
        self.operations.append(operation)
        return operation.kind not in self.deny_kinds

    async def authorize_path(self, path: str) -> bool:  # async on purpose: both kinds must work
        self.paths.append(path)
        return path not in self.deny_paths


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def tools(session, recorder):
    return await create_sandbox_coding_tools(
        session, authorize=recorder.authorize, authorize_path=recorder.authorize_path
    )


async def call(tools, name: str, **arguments) -> dict:
    result = await tools.dispatch(name, arguments)
    json.dumps(result)  # every result is JSON for the model
    return result


def refused(result: dict, code: str) -> None:
    assert result.get("error") == code, result
    assert result["hint"], f"a refusal with nothing to do about it: {result}"  # every refusal says what to do


async def test_the_tool_set_and_its_schemas(tools):
    assert tools.names == [
        "read_file", "write_file", "edit_file", "list_directory", "glob", "search_files", "run_command",
        "read_output", "search_output",
    ]  # fmt: skip
    openai, anthropic = tools.as_openai_tools(), tools.as_anthropic_tools()
    assert [t["function"]["name"] for t in openai] == tools.names == [t["name"] for t in anthropic]
    assert anthropic[0]["input_schema"]["properties"]["path"]["type"] == "string"
    json.dumps(openai)
    with pytest.raises(TypeError):
        pickle.dumps(tools)
    with pytest.raises(TypeError):
        pickle.dumps(tools["read_file"])
    refused(await call(tools, "no_such_tool"), "SANDBOX_INVALID_ARGUMENT")
    refused(await tools.dispatch("read_file", ["not", "an", "object"]), "SANDBOX_INVALID_ARGUMENT")
    refused(await call(tools, "read_file", path=3), "SANDBOX_INVALID_ARGUMENT")
    refused(await call(tools, "write_file", path="x"), "SANDBOX_INVALID_ARGUMENT")


# A value of the wrong JSON type for each schema type the tools use.
WRONG_TYPE = {"string": 7, "integer": "7", "boolean": "yes", "array": "not a list"}


async def test_every_argument_is_checked_as_its_schema_says(tools, recorder):
    for tool in tools:
        schema = tool.input_schema
        assert schema["additionalProperties"] is False
        valid = {"path": "f.txt", "content": "x", "old_text": "x", "new_text": "y", "pattern": "*", "query": "x",
                 "executable": "shell", "reference": "out-none"}  # fmt: skip
        for name, prop in schema["properties"].items():
            arguments = {key: valid[key] for key in schema["required"]}
            arguments[name] = WRONG_TYPE[prop["type"]]
            refused(await call(tools, tool.name, **arguments), "SANDBOX_INVALID_ARGUMENT")
            assert f"{name} must be" in (await call(tools, tool.name, **arguments))["message"]
        for name in schema["required"]:
            missing = {key: valid[key] for key in schema["required"] if key != name}
            result = await call(tools, tool.name, **missing)
            refused(result, "SANDBOX_INVALID_ARGUMENT")
            assert result["message"] == f"missing argument {name!r}"
        typo = await call(tools, tool.name, **{key: valid[key] for key in schema["required"]}, extra_argument=1)
        refused(typo, "SANDBOX_INVALID_ARGUMENT")
        assert "extra_argument" in typo["message"] and all(name in typo["hint"] for name in schema["properties"])
    assert recorder.operations == []  # nothing reached the host's hooks


async def test_integers_below_their_minimum_are_refused_and_above_their_maximum_capped(tools, workspace):
    (workspace / "big.txt").write_text("x" * 300_000)
    (workspace / "small.txt").write_text("a\nx\nb\n")
    read = await call(tools, "read_file", path="big.txt", max_bytes=10**9)
    assert read["bytes"] == tools["read_file"].input_schema["properties"]["max_bytes"]["maximum"]
    refused(await call(tools, "read_file", path="big.txt", max_bytes=0), "SANDBOX_INVALID_ARGUMENT")
    refused(await call(tools, "search_files", query="x", context_lines=-1), "SANDBOX_INVALID_ARGUMENT")
    found = await call(tools, "search_files", query="x", include="small.txt", context_lines=99)
    assert [match["path"] for match in found["matches"]] == ["/workspace/small.txt"], found
    result = await call(tools, "run_command", executable="shell", args=["-c", "echo hi"])
    refused(await call(tools, "read_output", reference="out-x", stream="stdin"), "SANDBOX_NOT_FOUND")
    assert result["stdout"] == "hi\n"


async def test_read_pages_text_without_splitting_characters(tools, workspace):
    text = "añ€😀z" * 50
    (workspace / "t.txt").write_text(text)
    whole = hashlib.sha256(text.encode()).hexdigest()
    pieces, offset = [], 0
    while offset is not None:
        result = await call(tools, "read_file", path="t.txt", offset=offset, max_bytes=5)
        assert result["sha256"] == whole and result["size"] == len(text.encode())
        pieces.append(result["text"])
        assert "\ufffd" not in result["text"]
        offset = result["next_offset"]
        assert result["truncated"] == (offset is not None)
    assert "".join(pieces) == text
    mid = await call(tools, "read_file", path="/workspace/t.txt", offset=2, max_bytes=10)
    assert mid["offset"] == 3 and mid["text"].startswith("€")  # moved past the middle of "ñ"


async def test_read_refusals(tools, workspace):
    (workspace / "dir").mkdir()
    refused(await call(tools, "read_file", path="missing"), "SANDBOX_NOT_FOUND")
    refused(await call(tools, "read_file", path="dir"), "SANDBOX_INVALID_ARGUMENT")
    refused(await call(tools, "read_file", path="x", offset=-1), "SANDBOX_INVALID_ARGUMENT")


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "/etc/passwd", "a\\b", "a//b", "./a", "a/./b", "a/../b", "/workspace/../etc", ""]
)
async def test_paths_that_are_not_plainly_inside_are_refused(tools, path):
    result = await call(tools, "read_file", path=path)
    assert result["error"] in ("SANDBOX_PATH_REFUSED", "SANDBOX_INVALID_ARGUMENT"), result


async def test_overlong_paths_are_a_limit(tools):
    refused(await call(tools, "read_file", path="a" * 5000), "SANDBOX_LIMIT")


async def test_write_creates_directories_and_never_clobbers_unasked(tools, workspace, recorder):
    result = await call(tools, "write_file", path="new/deep/f.txt", content="one")
    assert result["created_directories"] == ["/workspace/new", "/workspace/new/deep"]
    write = recorder.operations[-1]
    assert (write.kind, write.bytes, write.overwrite, write.creates_directories) == (
        "write",
        3,
        False,
        ("/workspace/new", "/workspace/new/deep"),
    )
    refused(await call(tools, "write_file", path="new/deep/f.txt", content="two"), "SANDBOX_INVALID_ARGUMENT")
    assert (workspace / "new/deep/f.txt").read_text() == "one"
    assert (await call(tools, "write_file", path="new/deep/f.txt", content="two", overwrite=True))["bytes"] == 3
    assert (workspace / "new/deep/f.txt").read_text() == "two"
    refused(await call(tools, "write_file", path="big", content="x" * (256 * 1024 + 1)), "SANDBOX_LIMIT")
    assert not (workspace / "big").exists()
    assert sorted(os.listdir(workspace / "new/deep")) == ["f.txt"]  # no temporary left


async def test_edits(tools, workspace, recorder):
    (workspace / "m.py").write_text("a = 1\nb = 1\nc = 2\n")
    base = hashlib.sha256(b"a = 1\nb = 1\nc = 2\n").hexdigest()
    refused(await call(tools, "edit_file", path="m.py", old_text="zzz", new_text="y"), "EDIT_NO_MATCH")
    refused(await call(tools, "edit_file", path="m.py", old_text="= 1", new_text="= 3"), "EDIT_AMBIGUOUS")
    stale = await call(tools, "edit_file", path="m.py", old_text="c", new_text="d", expected_sha256="0" * 64)
    refused(stale, "EDIT_STALE")
    dry = await call(tools, "edit_file", path="m.py", old_text="c = 2", new_text="c = 3", dry_run=True)
    assert dry["replacements"] == 1 and dry["base_sha256"] == base
    assert (workspace / "m.py").read_text() == "a = 1\nb = 1\nc = 2\n"  # nothing changed so far
    edit = recorder.operations[-1]
    assert (edit.kind, edit.base_sha256, edit.result_sha256, edit.replacements, edit.dry_run) == (
        "edit",
        base,
        dry["sha256"],
        1,
        True,
    )
    done = await call(tools, "edit_file", path="m.py", old_text="= 1", new_text="= 9", replace_all=True)
    assert done["replacements"] == 2
    assert (workspace / "m.py").read_text() == "a = 9\nb = 9\nc = 2\n"


async def test_two_edits_from_one_base_apply_exactly_once(tools, workspace):
    (workspace / "f").write_text("value = 0\n")
    base = hashlib.sha256(b"value = 0\n").hexdigest()
    results = []

    async def edit(new: str) -> None:
        results.append(
            await call(tools, "edit_file", path="f", old_text="value = 0", new_text=new, expected_sha256=base)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(edit, "value = 1")
        nursery.start_soon(edit, "value = 2")
    assert sorted("error" in r for r in results) == [False, True]
    assert next(r for r in results if "error" in r)["error"] == "EDIT_STALE"
    assert (workspace / "f").read_text() in ("value = 1\n", "value = 2\n")


async def test_listing_globbing_and_searching(tools, workspace, recorder):
    for path, content in {
        "src/app.py": "import os\nTODO = 'fix'\n",
        "src/lib/util.py": "def f():\n    return 'TODO later'\n",
        "README.md": "todo list\n",
        "node_modules/x/index.js": "TODO in deps\n",
        ".git/config": "TODO in git\n",
        "secret/keys.txt": "TODO secret\n",
    }.items():
        (workspace / path).parent.mkdir(parents=True, exist_ok=True)
        (workspace / path).write_text(content)
    os.symlink("/etc", workspace / "etc-link")
    recorder.deny_paths.add("/workspace/secret")

    listing = await call(tools, "list_directory")
    assert {e["name"] for e in listing["entries"]} == {"src", "README.md", "node_modules", ".git", "etc-link"}
    assert listing["denied"] == ["secret"]
    assert {"symlink"} == {e["kind"] for e in listing["entries"] if e["name"] == "etc-link"}

    globbed = await call(tools, "glob", pattern="**/*.py")
    assert globbed["matches"] == ["/workspace/src/app.py", "/workspace/src/lib/util.py"]
    assert "/workspace/secret" in globbed["denied"]

    found = await call(tools, "search_files", query="TODO", context_lines=1)
    assert [(m["path"], m["line"]) for m in found["matches"]] == [
        ("/workspace/src/app.py", 2), ("/workspace/src/lib/util.py", 2)
    ]  # fmt: skip
    assert found["matches"][0]["before"] == ["import os"]
    regex = await call(tools, "search_files", query=r"todo\s+\w+", regex=True)
    assert [m["path"] for m in regex["matches"]] == ["/workspace/README.md"]
    only_lib = await call(tools, "search_files", query="TODO", include="src/lib/*.py")
    assert [m["path"] for m in only_lib["matches"]] == ["/workspace/src/lib/util.py"]
    by_name = await call(tools, "search_files", query="util", search_paths=True)
    assert by_name["matches"] == [{"path": "/workspace/src/lib/util.py"}]
    refused(await call(tools, "search_files", query="(", regex=True), "SANDBOX_INVALID_ARGUMENT")
    search = next(op for op in recorder.operations if op.kind == "search")
    assert (search.path, search.query, search.regex) == ("/workspace", "TODO", False)


async def test_search_results_are_bounded(session, workspace, recorder):
    tools = await create_sandbox_coding_tools(
        session, authorize=recorder.authorize, limits=CodingLimits(max_search_results=5)
    )
    (workspace / "many.txt").write_text("hit\n" * 50)
    found = await call(tools, "search_files", query="hit")
    assert len(found["matches"]) == 5 and found["truncated"]
    tools = await create_sandbox_coding_tools(
        session, authorize=recorder.authorize, limits=CodingLimits(max_list_entries=3)
    )
    for i in range(5):
        (workspace / f"f{i}").write_text("")
    listing = await call(tools, "list_directory")
    assert len(listing["entries"]) == 3 and listing["truncated"]


async def test_authorize_is_asked_first_and_a_no_changes_nothing(tools, workspace, recorder):
    recorder.deny_kinds = {"write", "shell", "read"}
    refused(await call(tools, "write_file", path="nope", content="x"), "FORBIDDEN")
    assert not (workspace / "nope").exists()
    refused(await call(tools, "run_command", executable="shell", args=["-c", "touch ran"]), "FORBIDDEN")
    assert not (workspace / "ran").exists()
    (workspace / "r").write_text("x")
    refused(await call(tools, "read_file", path="r"), "FORBIDDEN")
    shell = next(op for op in recorder.operations if op.kind == "shell")
    assert (shell.executable, shell.args, shell.cwd) == ("shell", ("-c", "touch ran"), "/workspace")


async def test_authorize_path_is_asked_segment_by_segment(tools, workspace, recorder):
    (workspace / "a/b").mkdir(parents=True)
    (workspace / "a/b/c.txt").write_text("x")
    await call(tools, "read_file", path="a/b/c.txt")
    assert recorder.paths[-3:] == ["/workspace/a", "/workspace/a/b", "/workspace/a/b/c.txt"]
    recorder.deny_paths.add("/workspace/a/b")
    refused(await call(tools, "read_file", path="a/b/c.txt"), "FORBIDDEN")
    refused(await call(tools, "write_file", path="a/b/new", content="x"), "FORBIDDEN")
    assert not (workspace / "a/b/new").exists()


@pytest.mark.parametrize("operation", ["read", "write", "edit", "search"])
async def test_a_symlink_swapped_in_after_authorization_fails_closed(tools, workspace, tmp_path, recorder, operation):
    (workspace / "dir").mkdir()
    (workspace / "dir/f").write_text("inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("outside secret")

    def swap_then_allow(path: str) -> bool:
        # Once the host has said yes to the directory, the guest swaps it.
        if path == "/workspace/dir" and (workspace / "dir").is_dir() and not (workspace / "dir").is_symlink():
            os.rename(workspace / "dir", workspace / "moved")
            os.symlink(outside, workspace / "dir")
        return True

    recorder.authorize_path = swap_then_allow  # type: ignore[method-assign]
    tools = await create_sandbox_coding_tools(
        tools._binding.target.handle, authorize=recorder.authorize, authorize_path=swap_then_allow
    )
    arguments = {
        "read": ("read_file", {"path": "dir/f"}),
        "write": ("write_file", {"path": "dir/f", "content": "planted", "overwrite": True}),
        "edit": ("edit_file", {"path": "dir/f", "old_text": "outside", "new_text": "planted"}),
        "search": ("search_files", {"query": "secret", "path": "dir"}),
    }[operation]
    result = await call(tools, *arguments[:1], **arguments[1])
    assert result.get("error") == "SANDBOX_PATH_REFUSED" or result.get("matches") == [], result
    assert str(tmp_path) not in json.dumps(result)  # no host path in what the model sees
    assert (outside / "f").read_text() == "outside secret"


async def test_commands(tools, workspace, monkeypatch):
    monkeypatch.setenv("HOST_SECRET", "do-not-leak")
    result = await call(tools, "run_command", executable="shell", args=["-c", "echo out; echo err >&2; env; exit 3"])
    assert (result["exit_code"], result["outcome"], result["artifact"]) == (3, "exited", None)
    assert result["stdout"].startswith("out\n") and result["stderr"] == "err\n"
    assert sorted(result["stdout"].split()[1:]) == sorted(
        f"{k}={v}" for k, v in {**sandboxns._session.DEFAULT_ENV, "PWD": "/workspace"}.items()
    )
    assert "do-not-leak" not in json.dumps(result)
    (workspace / "sub").mkdir()
    assert (await call(tools, "run_command", executable="shell", args=["-c", "pwd"], cwd="sub"))["stdout"] == (
        "/workspace/sub\n"
    )
    refused(await call(tools, "run_command", executable="python"), "SANDBOX_NOT_FOUND")
    refused(await call(tools, "run_command", executable="shell", args=["x"] * 129), "SANDBOX_LIMIT")
    refused(await call(tools, "run_command", executable="shell", args=["x" * 70000]), "SANDBOX_LIMIT")
    refused(await call(tools, "run_command", executable="shell", args=[3]), "SANDBOX_INVALID_ARGUMENT")
    refused(await call(tools, "run_command", executable="shell", cwd="../x"), "SANDBOX_PATH_REFUSED")


async def test_a_missing_executable_path_is_refused_cleanly(session, recorder):
    tools = await create_sandbox_coding_tools(
        session, authorize=recorder.authorize, executables={"shell": "/usr/bin/sh", "ghost": "/usr/bin/no-such"}
    )
    refused(await call(tools, "run_command", executable="ghost"), "SANDBOX_NOT_FOUND")


async def test_long_output_becomes_an_artifact_with_an_exact_preview(tools):
    script = "i=0; while [ $i -lt 20000 ]; do echo line-$i; i=$((i+1)); done"
    result = await call(tools, "run_command", executable="shell", args=["-c", script])
    expected = "".join(f"line-{i}\n" for i in range(20000)).encode()
    artifact = result["artifact"]
    assert artifact["bytes"] == len(expected) and not artifact["truncated"]
    assert artifact["head_bytes"] + artifact["tail_bytes"] + artifact["omitted_bytes"] == artifact["bytes"]
    head, _, tail = result["stdout"].partition("\n[... output omitted; page it with read_output ...]\n")
    assert head.encode() == expected[: artifact["head_bytes"]]
    assert tail.encode() == expected[len(expected) - artifact["tail_bytes"] :]
    assert len(result["stdout"].encode()) <= 64 * 1024
    pages, offset = [], 0
    while offset is not None:
        page = await call(tools, "read_output", reference=artifact["reference"], offset=offset, max_bytes=100_000)
        pages.append(page["text"])
        offset = page["next_offset"]
    assert "".join(pages).encode() == expected
    hits = await call(tools, "search_output", reference=artifact["reference"], query="line-19999")
    assert hits["matches"] == [{"stream": "stdout", "line": 20000, "text": "line-19999"}]
    refused(await call(tools, "read_output", reference="out-nope"), "SANDBOX_NOT_FOUND")


async def test_timeout_output_limit_and_cancellation_kill_background_children(session, recorder):
    tools = await create_sandbox_coding_tools(
        session,
        authorize=recorder.authorize,
        limits=CodingLimits(shell_timeout=0.5, max_artifact_bytes=200_000),
    )
    for args, outcome in (
        (["-c", "sleep {m} & sleep {m}"], "timeout"),
        (["-c", "sleep {m} & yes"], "output-limit"),
    ):
        marker = sleep_marker()
        result = await call(tools, "run_command", executable="shell", args=[a.format(m=marker) for a in args])
        assert result.get("outcome") == outcome, result
        assert host_processes_with(marker) == []
    marker = sleep_marker()
    with trio.move_on_after(0.3):
        await call(tools, "run_command", executable="shell", args=["-c", f"sleep {marker} & sleep {marker}"])
    assert host_processes_with(marker) == []


async def test_commands_and_the_probe_share_the_admission_limit(driver_name, state_dir, workspace, recorder):
    seen = []
    hooks = CodingHooks(on_tool_error=lambda tool, exc: seen.append((tool, exc)))
    async with sandboxns.open_backend(
        driver=driver_name, state_directory=state_dir, max_concurrent_commands=1
    ) as backend:
        handle = await backend.create(workspace=workspace)
        tools = await create_sandbox_coding_tools(handle, authorize=recorder.authorize, hooks=hooks)
        started = workspace / "started"
        os.mkfifo(started)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.session.run, "sh", ["-c", "echo > started; sleep 100"])
            await trio.to_thread.run_sync(started.read_bytes)
            refused(await call(tools, "run_command", executable="shell", args=["-c", "true"]), "SANDBOX_BUSY")
            # A full backend is the caller's to wait out, not a broken sandbox.
            with pytest.raises(SandboxError) as error:
                await create_sandbox_coding_tools(handle, authorize=recorder.authorize, hooks=hooks)
            assert error.value.code == ErrorCode.SANDBOX_BUSY
            nursery.cancel_scope.cancel()
    assert seen == []


async def test_stopped_tools_refuse_everything_and_new_ones_work(driver_name, state_dir, recorder):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="t", files={"a.txt": b"a"})
        handle = await backend.create(template=template.template_key)
        tools = await create_sandbox_coding_tools(handle, authorize=recorder.authorize)
        assert (await call(tools, "read_file", path="a.txt"))["text"] == "a"
        state = handle.capture_state()
        assert json.dumps(state).count("tool") == 0
        await handle.stop()
        for name, arguments in (
            ("read_file", {"path": "a.txt"}),
            ("write_file", {"path": "b", "content": "x"}),
            ("run_command", {"executable": "shell"}),
            ("list_directory", {}),
        ):
            refused(await tools.dispatch(name, arguments), "SANDBOX_STOPPED")
        resumed = await backend.create(template=template.template_key, state=state)
        fresh = await create_sandbox_coding_tools(resumed, authorize=recorder.authorize)
        assert (await call(fresh, "read_file", path="a.txt"))["text"] == "a"
        refused(await call(tools, "read_file", path="a.txt"), "SANDBOX_STOPPED")


async def test_restrictions_are_verified_and_rechecked(driver_name, workspace, recorder):
    async with sandboxns.open_sandbox(workspace, driver=driver_name, network="allow-all") as session:
        with pytest.raises(SandboxError) as error:
            await create_sandbox_coding_tools(session, authorize=recorder.authorize)
        assert error.value.code == ErrorCode.SANDBOX_INSUFFICIENT and "network-denied" in error.value.message
        tools = await create_sandbox_coding_tools(
            session, authorize=recorder.authorize, required_restrictions=("write-contained",)
        )
        assert (await call(tools, "run_command", executable="shell", args=["-c", "true"]))["exit_code"] == 0
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
        tools = await create_sandbox_coding_tools(session, authorize=recorder.authorize)
        await session.set_network_policy("allow-all")
        refused(await call(tools, "run_command", executable="shell", args=["-c", "true"]), "SANDBOX_INSUFFICIENT")


async def test_a_policy_change_during_preparation_voids_the_launch(session, workspace):
    async def authorize(operation) -> bool:
        if operation.kind == "shell":
            await session.set_network_policy("deny-all")  # a change, even to the same policy
        return True

    tools = await create_sandbox_coding_tools(session, authorize=authorize)
    refused(await call(tools, "run_command", executable="shell", args=["-c", "touch ran"]), "SANDBOX_INSUFFICIENT")
    assert not (workspace / "ran").exists()


async def test_probe_and_preparation_failures_give_a_fixed_reason(session, recorder, monkeypatch):
    seen = []
    hooks = CodingHooks(on_tool_error=lambda tool, exc: seen.append((tool, exc)))
    monkeypatch.setattr(_coding, "PROBE", "exit 3")
    with pytest.raises(SandboxError) as error:
        await create_sandbox_coding_tools(session, authorize=recorder.authorize, hooks=hooks)
    assert (error.value.code, error.value.message) == (ErrorCode.SANDBOX_UNAVAILABLE, _coding.UNAVAILABLE_REASON)
    [(tool, cause)] = seen
    assert tool == "create_sandbox_coding_tools" and cause is error.value.__cause__
    assert str(cause).startswith("restriction probe failed: 3")
    seen.clear()
    monkeypatch.undo()
    tools = await create_sandbox_coding_tools(session, authorize=recorder.authorize, hooks=hooks)

    async def broken(*args, **kwargs):
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "holder exploded at /some/host/path")

    monkeypatch.setattr(session, "_execute", broken)
    result = await call(tools, "run_command", executable="shell")
    assert result == {
        "error": "SANDBOX_UNAVAILABLE",
        "message": _coding.UNAVAILABLE_REASON,
        "hint": _coding.DEFAULT_HINTS["SANDBOX_UNAVAILABLE"],
    }
    assert [(tool, exc.message) for tool, exc in seen] == [("run_command", "holder exploded at /some/host/path")]


async def test_a_raw_os_error_while_the_tools_are_made_is_unavailable(session, recorder):
    seen = []
    hooks = CodingHooks(on_tool_error=lambda tool, exc: seen.append((tool, exc)))
    with no_free_file_descriptors(), pytest.raises(SandboxError) as error:
        await create_sandbox_coding_tools(session, authorize=recorder.authorize, hooks=hooks)
    assert (error.value.code, error.value.message) == (ErrorCode.SANDBOX_UNAVAILABLE, _coding.UNAVAILABLE_REASON)
    # The session says what failed (a SandboxError, see test_run), and
    # its cause is the host's.
    [(tool, cause)] = seen
    assert tool == "create_sandbox_coding_tools" and isinstance(cause, SandboxError)
    assert isinstance(cause.__cause__, OSError) and cause.__cause__.errno == errno.EMFILE
    # The session itself is fine once the host has descriptors again.
    tools = await create_sandbox_coding_tools(session, authorize=recorder.authorize, hooks=hooks)
    assert (await call(tools, "run_command", executable="shell", args=["-c", "true"]))["exit_code"] == 0


async def test_a_driver_without_a_workspace_binding_is_refused(session):
    class Remote:
        """A custom driver with no host-side workspace."""

        name = "remote"
        network = session.driver.network

    with pytest.raises(SandboxError) as error:
        await create_sandbox_coding_tools(sandboxns.Session(Remote()), authorize=lambda op: True)
    assert error.value.code == ErrorCode.SANDBOX_UNAVAILABLE


async def run_command_interrupted(tools, workspace, script: str, interrupt) -> dict:
    """The run_command result of ``script`` (which writes to the FIFO
    ``started`` once it runs) when ``await interrupt()`` comes while it runs."""
    started = workspace / "started"
    os.mkfifo(started)
    results = []

    async def run() -> None:
        results.append(await call(tools, "run_command", executable="shell", args=["-c", script]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.to_thread.run_sync(started.read_bytes)
        await interrupt()
    [result] = results
    return result


@pytest.mark.parametrize("output", ["partial\n", ""])
async def test_stopping_the_session_cancels_a_running_command(driver_name, state_dir, workspace, recorder, output):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        handle = await backend.create(workspace=workspace)
        tools = await create_sandbox_coding_tools(handle, authorize=recorder.authorize)
        marker = sleep_marker()
        script = f"printf '{output}'; echo > started; sleep {marker} & sleep {marker}"
        result = await run_command_interrupted(tools, workspace, script, handle.stop)
    assert (result.get("outcome"), result.get("exit_code"), result.get("stdout")) == ("cancelled", None, output), result
    assert host_processes_with(marker) == []


@pytest.mark.parametrize("when", ["between calls", "under a command"])
async def test_a_holder_killed_from_the_host_is_unavailable_then_stopped(workspace, recorder, when):
    seen = []
    hooks = CodingHooks(on_tool_error=lambda tool, exc: seen.append((tool, exc)))
    marker = sleep_marker()
    async with sandboxns.open_sandbox(workspace, driver="native") as session:
        tools = await create_sandbox_coding_tools(session, authorize=recorder.authorize, hooks=hooks)
        if when == "between calls":
            await kill_native_holder(session)
            result = await call(tools, "run_command", executable="shell", args=["-c", "true"])
        else:
            script = f"echo partial; echo > started; sleep {marker}"
            result = await run_command_interrupted(tools, workspace, script, lambda: kill_native_holder(session))
        assert host_processes_with(marker) == []
        # A broken sandbox, not a stop: the model gets the fixed reason, the
        # host the cause.
        assert result == {
            "error": "SANDBOX_UNAVAILABLE",
            "message": _coding.UNAVAILABLE_REASON,
            "hint": _coding.DEFAULT_HINTS["SANDBOX_UNAVAILABLE"],
        }
        [(tool, cause)] = seen
        assert tool == "run_command" and cause.code == ErrorCode.SANDBOX_UNAVAILABLE and "holder" in cause.message
        # The session is gone for the tools and the session alike.
        for name, arguments in (("run_command", {"executable": "shell"}), ("read_file", {"path": "x"})):
            refused(await tools.dispatch(name, arguments), "SANDBOX_STOPPED")
        with pytest.raises(SandboxError) as error:
            await session.run("true")
        assert error.value.code == ErrorCode.SANDBOX_STOPPED


async def test_what_a_model_writes_cannot_hang_or_crash_the_host(session, workspace, recorder):
    tools = await create_sandbox_coding_tools(
        session, authorize=recorder.authorize, limits=CodingLimits(search_seconds=0.5)
    )
    (workspace / ("a" * 40)).write_text("a" * 5000 + "b\n")
    with trio.fail_after(10):  # a guard against a hang, not a performance claim
        globbed = await call(tools, "glob", pattern="*a" * 12 + "b")
        assert globbed["matches"] == []
        slow = await call(tools, "search_files", query="(a|aa)+$", regex=True)
        refused(slow, "SANDBOX_LIMIT")
        for bad in ("a{99999999999}", "(" * 2000 + ")" * 2000, "["):
            refused(await call(tools, "search_files", query=bad, regex=True), "SANDBOX_INVALID_ARGUMENT")
        refused(await call(tools, "search_files", query=""), "SANDBOX_INVALID_ARGUMENT")
        refused(await call(tools, "glob", pattern="*" * 2000), "SANDBOX_INVALID_ARGUMENT")
    for name, arguments in (
        ("read_file", {"path": "\ud800"}),
        ("write_file", {"path": "x", "content": "\ud800"}),
        ("run_command", {"executable": "shell", "args": ["\ud800"]}),
        ("edit_file", {"path": "x", "old_text": "a", "new_text": "\udfff"}),
    ):
        refused(await call(tools, name, **arguments), "SANDBOX_INVALID_ARGUMENT")


async def test_search_output_is_bounded(tools):
    result = await call(tools, "run_command", executable="shell", args=["-c", "yes '' | head -c 4000000"])
    reference = result["artifact"]["reference"]
    refused(await call(tools, "search_output", reference=reference, query=""), "SANDBOX_INVALID_ARGUMENT")
    found = await call(tools, "search_output", reference=reference, query="^$", regex=True)
    assert len(found["matches"]) == 100 and found["truncated"]


async def test_an_edit_reveals_nothing_about_a_file_it_may_not_read(tools, workspace, recorder):
    (workspace / "secret.txt").write_text("token=h\n")
    recorder.deny_kinds = {"read"}
    for guess in ("token=h", "token=x"):
        refused(await call(tools, "edit_file", path="secret.txt", old_text=guess, new_text="y"), "FORBIDDEN")
    assert (workspace / "secret.txt").read_text() == "token=h\n"


async def test_a_character_is_never_split_even_when_asked_for_less(tools, workspace):
    (workspace / "e.txt").write_text("é😀")
    first = await call(tools, "read_file", path="e.txt", max_bytes=1)
    second = await call(tools, "read_file", path="e.txt", offset=first["next_offset"], max_bytes=1)
    assert (first["text"], second["text"], second["next_offset"]) == ("é", "😀", None)


async def test_read_says_where_it_replaced_bytes_that_are_not_utf8(tools, workspace):
    # Latin-1 bytes, a cut-off character and stray continuation bytes.
    (workspace / "mixed.txt").write_bytes(b"ok \xff\xfe mid \xe2\x82 end " + b"\x80" * 3 + "é".encode())
    whole = await call(tools, "read_file", path="mixed.txt")
    assert whole["text"] == "ok \ufffd\ufffd mid \ufffd end \ufffd\ufffd\ufffdé"
    assert (whole["replaced_invalid_utf8"], whole["invalid_utf8_offsets"]) == (True, [3, 4, 10, 17, 18])  # 5 of 6
    part = await call(tools, "read_file", path="mixed.txt", offset=8, max_bytes=6)
    assert (part["text"], part["invalid_utf8_offsets"]) == ("d \ufffd e", [10])  # offsets in the file
    (workspace / "clean.txt").write_text("a\ufffdb")  # U+FFFD itself is text like any other
    clean = await call(tools, "read_file", path="clean.txt")
    assert clean["text"] == "a\ufffdb" and "replaced_invalid_utf8" not in clean and "invalid_utf8_offsets" not in clean


async def test_a_read_starting_or_ending_inside_a_character_replaces_nothing(tools, workspace):
    data = ("😀😀é" * 2).encode()
    (workspace / "e.txt").write_bytes(data)
    for offset in range(len(data)):
        for max_bytes in (1, 2, 3, 4, 5):
            result = await call(tools, "read_file", path="e.txt", offset=offset, max_bytes=max_bytes)
            assert "replaced_invalid_utf8" not in result, (offset, max_bytes, result)
            # What was read is whole characters, exactly those of the file there.
            start = result["offset"]
            assert result["text"] == data[start : start + result["bytes"]].decode("utf-8"), (offset, max_bytes)
    # Command output is paged the same way.
    script = "python3 -c \"print('\\U0001f600' * 20000, end='')\""
    reference = (await call(tools, "run_command", executable="shell", args=["-c", script]))["artifact"]["reference"]
    page = await call(tools, "read_output", reference=reference, offset=1, max_bytes=1)
    assert (page["offset"], page["text"], page["next_offset"]) == (4, "😀", 8)


def test_every_code_a_refusal_can_carry_has_a_hint():
    codes = {code.value for code in ErrorCode} | {_coding.EDIT_NO_MATCH, _coding.EDIT_AMBIGUOUS, _coding.EDIT_STALE}
    assert codes <= set(_coding.DEFAULT_HINTS)


async def test_an_entry_that_cannot_be_looked_at_is_still_listed(session, tools):
    # A directory readable but not searchable: its names can be read, the
    # entries themselves not (unless the host's file operations override
    # permissions); either way the listing works.
    made = await session.run("/bin/sh", ["-c", "mkdir d && touch d/f && chmod 444 d"])
    assert made.exit_code == 0, made.stderr
    listed = await call(tools, "list_directory", path="d")
    assert [entry["name"] for entry in listed["entries"]] == ["f"], listed
    assert listed["entries"][0]["kind"] in ("file", "other")
    assert [entry.name for entry in await session.list_dir("d")] == ["f"]
    await session.run("/bin/chmod", ["755", "d"])
