"""The backend: templates, durable sessions, state descriptors, stop /
shutdown / delete, and leases between handles of one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
from conftest import host_processes_with, refused, sleep_marker

import sandboxns
from sandboxns import ErrorCode, SandboxError

pytestmark = pytest.mark.smoke

KERNEL_HAS_OVERLAYFS = "overlay" in Path("/proc/filesystems").read_text().split()


def tree(root) -> dict[str, bytes]:
    """Every file under root, by relative path."""
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


async def test_the_readme_flow(backend):
    template = await backend.prewarm(template="agent-workspace", files={"hello.txt": b"hello"})
    handle = await backend.create(template=template.template_key, network="deny-all")
    try:
        result = await handle.session.run("/usr/bin/cat", ["hello.txt"])
        assert result.stdout == "hello"
        state = handle.capture_state()
        await handle.stop()
        resumed = await backend.create(template=template.template_key, state=state, network="deny-all")
        try:
            assert await resumed.session.read_text_file("hello.txt") == "hello"
        finally:
            await resumed.delete()
    finally:
        await handle.shutdown()
    assert os.listdir(backend.state_directory / "sessions") == []


async def test_template_keys_are_content_addresses(backend):
    files = {"a.txt": b"one", "dir/b.bin": b"\x00\xff"}
    first = await backend.prewarm(template="t", files=files)
    stored = backend.state_directory / "templates" / first.template_key
    written = (stored / "template.json").stat().st_mtime_ns
    again = await backend.prewarm(template="t", files=dict(reversed(list(files.items()))))
    assert again.template_key == first.template_key
    assert (stored / "template.json").stat().st_mtime_ns == written  # not rewritten
    assert tree(stored / "files") == {"a.txt": b"one", "dir/b.bin": b"\x00\xff"}
    variants = [
        ("other-name", files),
        ("t", {**files, "a.txt": b"two"}),
        ("t", {"a2.txt": b"one", "dir/b.bin": b"\x00\xff"}),
        ("t", {**files, "c": b""}),
    ]
    keys = {(await backend.prewarm(template=name, files=variant)).template_key for name, variant in variants}
    assert len(keys) == len(variants) and first.template_key not in keys


@pytest.mark.parametrize(
    "files, code",
    [
        ({"../escape": b"x"}, ErrorCode.SANDBOX_PATH_REFUSED),
        ({"/etc/passwd": b"x"}, ErrorCode.SANDBOX_PATH_REFUSED),
        ({"a": "text, not bytes"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"a": b"file", "a/b": b"under a file"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"a": b"1", "/workspace/a": b"2"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ([("a", b"x")], ErrorCode.SANDBOX_INVALID_ARGUMENT),
    ],
)
async def test_bad_templates_are_refused_and_nothing_is_stored(backend, files, code):
    await refused(code, backend.prewarm(template="bad", files=files))
    assert os.listdir(backend.state_directory / "templates") == []


async def test_sessions_from_one_template_are_independent(backend):
    template = await backend.prewarm(template="t", files={"shared.txt": b"original", "sub/keep": b"k"})
    first = await backend.create(template=template.template_key)
    second = await backend.create(template=template.template_key)
    await first.session.run("sh", ["-c", "echo changed > shared.txt; rm -r sub; echo new > mine"])
    assert await first.session.read_text_file("shared.txt") == "changed\n"
    assert {e.name for e in await first.session.list_dir(".")} == {"shared.txt", "mine"}
    assert await second.session.read_text_file("shared.txt") == "original"
    assert {e.name for e in await second.session.list_dir(".")} == {"shared.txt", "sub"}
    files = backend.state_directory / "templates" / template.template_key / "files"
    assert tree(files) == {"shared.txt": b"original", "sub/keep": b"k"}  # the template never changes


async def test_files_survive_stop_and_resume(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    handle = await backend.create(template=template.template_key)
    await handle.session.run("sh", ["-c", "echo 2 > b; rm a; mkdir -p d/e; echo 3 > d/e/f"])
    await handle.session.write_file("from-host", b"4")
    state = handle.capture_state()
    await handle.stop()
    resumed = await backend.create(template=template.template_key, state=state)
    result = await resumed.session.run("sh", ["-c", "ls; cat b d/e/f from-host"])
    assert result.stdout.split() == ["b", "d", "from-host", "2", "3", "4"]
    await resumed.delete()


async def test_a_copied_workspace_behaves_the_same(backend):
    backend._overlay = False  # as on a kernel without unprivileged overlayfs
    template = await backend.prewarm(template="t", files={"a": b"1", "d/b": b"2"})
    handle = await backend.create(template=template.template_key)
    description = json.loads((backend.state_directory / "sessions" / handle.session_id / "session.json").read_text())
    assert description["layout"] == "copy"
    await handle.session.run("sh", ["-c", "echo changed > a"])
    state = handle.capture_state()
    await handle.stop()
    resumed = await backend.create(template=template.template_key, state=state)
    assert await resumed.session.read_text_file("a") == "changed\n"
    assert await resumed.session.read_text_file("d/b") == "2"
    await resumed.delete()
    assert tree(backend.state_directory / "templates" / template.template_key / "files") == {"a": b"1", "d/b": b"2"}


async def test_a_bound_host_directory(backend, tmp_path):
    host_dir = tmp_path / "project"
    host_dir.mkdir()
    (host_dir / "README").write_text("mine")
    handle = await backend.create(workspace=host_dir)
    await handle.session.run("sh", ["-c", "cat README > copy"])
    assert (host_dir / "copy").read_text() == "mine"
    state = handle.capture_state()
    assert state["template"] is None
    await handle.stop()
    resumed = await backend.create(state=state)
    assert await resumed.session.read_text_file("copy") == "mine"
    await resumed.delete()
    assert sorted(os.listdir(host_dir)) == ["README", "copy"]  # the host's directory is never deleted
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(workspace=backend.state_directory))
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(workspace=backend.state_directory / "sessions"))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(workspace=tmp_path / "missing"))


async def test_state_descriptors(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    other = await backend.prewarm(template="u", files={"a": b"1"})
    handle = await backend.create(template=template.template_key, network="allow-all")
    state = handle.capture_state()
    assert json.loads(json.dumps(state)) == state
    assert set(state) == {"format", "backend", "template", "session"}
    await handle.stop()
    stored = "".join(p.read_text() for p in (backend.state_directory / "sessions").rglob("*") if p.is_file())
    assert "allow-all" not in stored  # policies are never stored

    key = template.template_key
    await refused(
        ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(template=key, state={**state, "backend": "another-backend"})
    )
    await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(template=other.template_key, state=state))
    await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(state=state))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(template=key, state={**state, "session": "0" * 32}))
    for bad in ({**state, "session": "../../etc"}, {**state, "format": 99}, "not a dict"):
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=key, state=bad))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=key, state=state, network="bogus"))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(template="f" * 64))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template="not-a-key"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create())
    # None of those refusals touched the session.
    resumed = await backend.create(template=key, state=state)
    assert await resumed.session.read_text_file("a") == "1"
    await resumed.delete()
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(template=key, state=state))


async def test_stop_kills_commands_keeps_files_and_is_idempotent(backend, workspace):
    handle = await backend.create(workspace=workspace)
    marker = sleep_marker()
    started = workspace / "started"
    os.mkfifo(started)
    outcome = {}

    async def long_command():
        try:
            await handle.session.run("sh", ["-c", f"echo kept > f; echo > started; sleep {marker}"])
        except SandboxError as exc:
            outcome["code"] = exc.code

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_command)
        await trio.to_thread.run_sync(started.read_bytes)
        assert host_processes_with(marker)
        await handle.stop()
    assert outcome["code"] == ErrorCode.SANDBOX_STOPPED
    assert host_processes_with(marker) == []
    assert backend.active_commands == 0
    await handle.stop()
    await handle.shutdown()
    await refused(ErrorCode.SANDBOX_STOPPED, handle.session.run("true"))
    await refused(ErrorCode.SANDBOX_STOPPED, handle.session.read_file("f"))
    resumed = await backend.create(state=handle.capture_state())
    assert await resumed.session.read_text_file("f") == "kept\n"
    await resumed.delete()
    await resumed.delete()
    await handle.delete()  # nothing left to delete: still fine


async def test_one_owner_at_a_time(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    key = template.template_key
    first = await backend.create(template=key)
    state = first.capture_state()
    error = await refused(ErrorCode.SANDBOX_BUSY, backend.create(template=key, state=state))
    assert "this process" in error.message
    await first.stop()
    second = await backend.create(template=key, state=state)
    # The older handle can no longer stop or delete what the newer one owns...
    await refused(ErrorCode.SANDBOX_BUSY, first.stop())
    await refused(ErrorCode.SANDBOX_BUSY, first.delete())
    await first.shutdown()  # ...and shutdown() never touches it.
    assert (await second.session.run("cat", ["a"])).stdout == "1"
    await second.stop()
    await first.delete()  # nobody owns it now
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(template=key, state=state))


async def test_templates_outlive_their_sessions(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    for _ in range(2):
        handle = await backend.create(template=template.template_key)
        await handle.delete()
    assert os.listdir(backend.state_directory / "templates") == [template.template_key]


async def test_closing_the_backend_shuts_its_sessions_down(driver_name, state_dir):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key)
    await refused(ErrorCode.SANDBOX_STOPPED, handle.session.run("true"))
    await refused(ErrorCode.SANDBOX_STOPPED, backend.create(template=template.template_key))


@pytest.mark.parametrize(
    "options",
    [
        {"driver": "qemu"},
        {"max_concurrent_commands": 0},
        {"max_concurrent_commands": True},
        {"on_broker_error": "print"},
        {"state_directory": None},
    ],
)
async def test_bad_backend_options(options, state_dir):
    with pytest.raises(SandboxError) as error:
        async with sandboxns.open_backend(**{"state_directory": state_dir, **options}):
            pass
    assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT


async def test_concurrent_stops_and_deletes_of_one_handle(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    handle = await backend.create(template=template.template_key)
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(handle.stop)
        nursery.start_soon(handle.shutdown)
    resumed = await backend.create(template=template.template_key, state=handle.capture_state())
    await resumed.stop()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(resumed.delete)
        nursery.start_soon(resumed.stop)
        nursery.start_soon(resumed.delete)
    assert os.listdir(backend.state_directory / "sessions") == []


async def test_delete_removes_whatever_the_guest_left(backend):
    """Read-only directories, symlinks inside them, a mode-000 directory:
    a guest's mess never makes delete fail (nor follows a symlink)."""
    template = await backend.prewarm(template="t", files={"sub/a": b"1"})
    handle = await backend.create(template=template.template_key)
    outside = backend.state_directory.parent / "outside"
    outside.write_text("keep")
    await handle.session.run(
        "sh", ["-c", f"mkdir -p ro locked; ln -s {outside} ro/link; chmod 555 ro sub; chmod 000 locked; rm sub/a"]
    )
    await handle.delete()
    assert os.listdir(backend.state_directory / "sessions") == []
    assert outside.read_text() == "keep" and outside.stat().st_mode & 0o777 != 0o700


async def test_a_sessions_confinement_is_stored_and_kept_on_resume(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    confinement = sandboxns.Confinement(
        tmp_size=8 << 20,
        limits=sandboxns.ResourceLimits(open_files=50),
        seccomp=sandboxns.SeccompPolicy(deny={"uname"}),
    )
    probe = "df -k /tmp | tail -n 1 | awk '{print $2}'; ulimit -n; uname >/dev/null 2>&1 || echo no-uname"
    handle = await backend.create(template=template.template_key, confinement=confinement)
    first = await handle.session.run("sh", ["-c", probe])
    state = handle.capture_state()
    await handle.stop()
    with pytest.raises(SandboxError) as caught:
        await backend.create(template=template.template_key, state=state, confinement=sandboxns.Confinement())
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    resumed = await backend.create(template=template.template_key, state=state)
    second = await resumed.session.run("sh", ["-c", probe])
    assert first.stdout.split() == second.stdout.split() == ["8192", "50", "no-uname"], (first, second)
    await resumed.delete()


async def test_a_pool_hands_out_only_default_confinement(backend):
    template = await backend.prewarm(template="t", files={"a": b"1"})
    await backend.pool(template=template.template_key, size=1)
    confinement = sandboxns.Confinement(tmp_size=8 << 20)
    handle = await backend.create(template=template.template_key, confinement=confinement)
    result = await handle.session.run("sh", ["-c", "df -k /tmp | tail -n 1 | awk '{print $2}'"])
    assert result.stdout.split() == ["8192"]
    await handle.delete()


async def test_a_template_session_is_an_overlay_where_the_kernel_allows(backend):
    # The copy fallback is silent by design; where the driver mounts
    # overlays and the kernel has overlayfs (5.11+ mounts it in a user
    # namespace), on a root host or not, it must not have been taken.
    if not backend._driver_class.supports_overlay or not KERNEL_HAS_OVERLAYFS:
        pytest.skip("no overlay workspaces with this driver or kernel")
    template = await backend.prewarm(template="t", files={"a": b"1"})
    handle = await backend.create(template=template.template_key)
    description = json.loads((backend.state_directory / "sessions" / handle.session_id / "session.json").read_text())
    assert description["layout"] == "overlay" and backend._overlay
    await handle.session.run("sh", ["-c", "echo changed > a"])  # a copy-up
    assert await handle.session.read_text_file("a") == "changed\n"
    await handle.delete()
