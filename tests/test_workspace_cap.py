"""The workspace size cap, Confinement(workspace_size=...): a capped session
keeps what it writes on an ext4 image of that size, mounted on the host
while the session is live (see sandboxns._image)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio
from conftest import refused

import sandboxns
from sandboxns import Confinement, ErrorCode
from sandboxns._image import missing_for_workspace_cap

pytestmark = pytest.mark.smoke

CAP = 32 << 20
CAPPED = Confinement(workspace_size=CAP)
MISSING = missing_for_workspace_cap()
capable_host = pytest.mark.skipif(bool(MISSING), reason=f"this host cannot cap a workspace: {'; '.join(MISSING)}")
FILL = "head -c 40M /dev/zero > big; echo $?"


def mounts_at(path: Path) -> list[tuple[str, list[str]]]:
    """The source and mount options of each mount at path, as
    /proc/self/mountinfo lists them."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            found.append((fields[fields.index("-") + 2], fields[5].split(",")))
    return found


def file_system_types(mount_point: str) -> list[str]:
    return [
        line.split()[2] for line in Path("/proc/self/mounts").read_text().splitlines() if line.split()[1] == mount_point
    ]


def loop_devices_backed_by(image: Path) -> list[str]:
    devices = []
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            if Path(backing).read_text().strip() == str(image):
                devices.append(backing)
        except OSError:  # unbound meanwhile (another suite's device, say)
            continue
    return devices


async def loop_devices_left(image: Path) -> list[str]:
    """The loop devices still backed by ``image`` once the kernel has had
    time to free them: it does so asynchronously after the last user (the
    file system, alive until a stopped holder's mount namespace is torn
    down) lets go, so this polls the kernel's state for a while."""
    with trio.move_on_after(10):
        while loop_devices_backed_by(image):
            await trio.sleep(0.01)
    return loop_devices_backed_by(image)


def session_dir(backend, handle) -> Path:
    return backend.state_directory / "sessions" / handle.session_id


async def capped_session(backend, files: dict[str, bytes] | None = None):
    template = await backend.prewarm(template="capped", files=files or {"from-template.txt": b"template"})
    return await backend.create(template=template.template_key, confinement=CAPPED)


@pytest.mark.parametrize("size", [0, (16 << 20) - 1, (8 << 40) + 1, "1G", True, 16.5 * (1 << 20)])
def test_bad_workspace_sizes_are_refused(size):
    with pytest.raises(sandboxns.SandboxError) as caught:
        Confinement(workspace_size=size)
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert "workspace_size" in caught.value.message and repr(size) in caught.value.message


def test_the_cap_is_stored_with_the_confinement():
    assert Confinement.from_dict(CAPPED.to_dict()) == CAPPED
    assert CAPPED.to_dict()["workspace_size"] == CAP
    stored_before_the_option = {key: value for key, value in CAPPED.to_dict().items() if key != "workspace_size"}
    assert Confinement.from_dict(stored_before_the_option).workspace_size is None


@pytest.mark.parametrize(
    "limits, problem",
    [
        ({"workspace_size": 1 << 30}, None),
        ({"workspace_size": 1 << 20}, "from 16 MiB to 8 TiB"),
        ({"workspace_size": "1G"}, "must be an integer"),
        ({"workspace_size": 0}, "must be"),
    ],
)
def test_a_spec_sets_the_cap_under_limits(limits, problem):
    spec = sandboxns.SandboxSpec.from_dict({"id": "capped", "limits": limits})
    if problem is None:
        assert spec.validate() == []
        assert spec.confinement.workspace_size == limits["workspace_size"]
    else:
        [found] = spec.validate()
        assert found.field == "limits.workspace_size" and problem in found.message, found


def test_a_spec_cannot_cap_a_bound_workspace(tmp_path):
    spec = sandboxns.SandboxSpec.from_dict(
        {"id": "capped", "workspace": str(tmp_path), "limits": {"workspace_size": CAP}}
    )
    [found] = spec.validate()
    assert found.field == "limits.workspace_size" and "host directory" in found.message


async def test_a_host_directory_cannot_be_capped(backend, driver_name, workspace):
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(workspace=workspace, confinement=CAPPED))
    assert "host directory" in error.message
    with pytest.raises(sandboxns.SandboxError) as caught:
        async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=CAPPED):
            pass
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT and "host directory" in caught.value.message
    assert os.listdir(backend.state_directory / "sessions") == []


@pytest.mark.skipif(not MISSING, reason="this host can cap a workspace")
async def test_a_host_that_cannot_mount_refuses_the_cap(backend):
    # As an ordinary user, for one: mounting needs CAP_SYS_ADMIN on the host.
    template = await backend.prewarm(template="capped", files={"a": b"1"})
    error = await refused(
        ErrorCode.SANDBOX_UNAVAILABLE, backend.create(template=template.template_key, confinement=CAPPED)
    )
    assert all(missing in error.message for missing in MISSING), error
    assert os.listdir(backend.state_directory / "sessions") == []  # nothing was made


@capable_host
async def test_a_guest_cannot_write_past_the_cap(backend):
    handle = await capped_session(backend)
    storage = session_dir(backend, handle) / "storage"
    result = await handle.session.run("sh", ["-c", f"cat from-template.txt; echo; {FILL}; df -k /workspace | tail -1"])
    template_line, status, df = result.stdout.splitlines()
    assert (template_line, status) == ("template", "1"), result
    assert "No space left on device" in result.stderr
    assert int(df.split()[1]) * 1024 <= CAP
    # On the host: the image is the cap's size, and its file system is full.
    assert (session_dir(backend, handle) / "workspace.img").stat().st_size == CAP
    usage = os.statvfs(storage)
    assert usage.f_blocks * usage.f_frsize <= CAP and usage.f_bavail * usage.f_frsize < 1 << 20
    [(source, options)] = mounts_at(storage)
    assert source.startswith("/dev/loop") and {"nosuid", "nodev"} <= set(options)
    # Removing a file makes room again.
    again = await handle.session.run("sh", ["-c", "rm big; head -c 1M /dev/zero > small; echo $?"])
    assert again.stdout == "0\n", again
    await handle.delete()


@capable_host
async def test_files_survive_stop_and_resume_and_the_cap_still_holds(backend):
    handle = await capped_session(backend)
    directory = session_dir(backend, handle)
    await handle.session.run("sh", ["-c", "echo from the guest > guest.txt"])
    await handle.session.write_file("host.txt", b"from the host")
    state = handle.capture_state()
    await handle.stop()
    # Stopped: nothing mounted, no loop device, the files are in the image.
    assert mounts_at(directory / "storage") == []
    assert await loop_devices_left(directory / "workspace.img") == []
    resumed = await backend.create(template=handle.template_key, state=state)
    assert len(mounts_at(directory / "storage")) == 1
    assert await resumed.session.read_text_file("guest.txt") == "from the guest\n"
    assert await resumed.session.read_text_file("host.txt") == "from the host"
    result = await resumed.session.run("sh", ["-c", FILL])
    assert result.stdout == "1\n" and "No space left on device" in result.stderr, result
    await resumed.delete()


@capable_host
async def test_a_host_write_past_the_cap_is_refused_and_the_old_file_stays(backend):
    handle = await capped_session(backend)
    await handle.session.write_file("keep.txt", b"the old content")
    await handle.session.run("sh", ["-c", FILL])
    error = await refused(ErrorCode.SANDBOX_LIMIT, handle.session.write_file("keep.txt", bytes(1 << 20)))
    assert "/workspace/keep.txt" in error.message and "full" in error.message
    await refused(ErrorCode.SANDBOX_LIMIT, handle.session.write_file("new.txt", bytes(1 << 20)))
    assert await handle.session.read_file("keep.txt") == b"the old content"
    # No temporary file of the failed writes is left behind.
    names = {entry.name for entry in await handle.session.list_dir("/workspace")}
    assert names == {"from-template.txt", "keep.txt", "big"}
    await handle.delete()


@capable_host
async def test_delete_leaves_no_mount_no_loop_device_and_no_image(backend):
    handle = await capped_session(backend)
    directory = session_dir(backend, handle)
    image = directory / "workspace.img"
    await handle.session.run("sh", ["-c", "head -c 1M /dev/urandom > data"])
    assert len(mounts_at(directory / "storage")) == 1 and len(loop_devices_backed_by(image)) == 1
    await handle.delete()
    assert mounts_at(directory / "storage") == []
    assert await loop_devices_left(image) == []
    assert not directory.exists() and os.listdir(backend.state_directory / "sessions") == []
    # Nor under the name a delete moves the session to first.
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert str(backend.state_directory) not in mountinfo


@capable_host
async def test_a_state_directory_whose_path_the_mount_table_escapes(driver_name, tmp_path):
    # /proc/self/mountinfo writes a space as \040.
    state = tmp_path / "state with a space"
    async with sandboxns.open_backend(driver=driver_name, state_directory=state) as backend:
        handle = await capped_session(backend)
        storage = session_dir(backend, handle) / "storage"
        state_of_session = handle.capture_state()
        await handle.stop()
        resumed = await backend.create(template=handle.template_key, state=state_of_session)
        assert await resumed.session.read_text_file("from-template.txt") == "template"
        await resumed.delete()
    assert not storage.exists()
    escaped = str(state).replace(" ", "\\040")  # this test's own: other suites may run beside it
    assert not any(escaped in line for line in Path("/proc/self/mountinfo").read_text().splitlines())


@capable_host
async def test_a_template_session_with_a_cap(backend):
    files = {"a.txt": b"1", "dir/b.txt": b"2"}
    handle = await capped_session(backend, files)
    directory = session_dir(backend, handle)
    layout = json.loads((directory / "session.json").read_text())["layout"]
    # The native driver overlays the template (its upper and work
    # directories both on the image); bwrap's sessions copy it there.
    assert layout == ("overlay" if backend._driver_class.supports_overlay else "copy")
    result = await handle.session.run("sh", ["-c", "cat a.txt dir/b.txt; echo 3 > a.txt; echo 4 > c.txt"])
    assert result.stdout == "12", result
    on_image = directory / "storage" / "workspace"
    assert (on_image / "a.txt").read_text() == "3\n" and (on_image / "c.txt").read_text() == "4\n"
    if layout == "overlay":
        assert (directory / "storage" / "overlay-work").is_dir()
        assert not (on_image / "dir").exists()  # untouched: only in the template
    await handle.delete()


@capable_host
async def test_a_template_larger_than_the_cap(backend):
    # An overlay's lower layer is the template, outside the cap; a copy of
    # it must fit, or the session is refused and nothing of it is left.
    template = {"large": bytes(CAP)}
    if backend._driver_class.supports_overlay:
        handle = await capped_session(backend, template)
        result = await handle.session.run("sh", ["-c", "wc -c < large"])
        assert result.stdout == f"{CAP}\n", result
        await handle.delete()
    else:
        error = await refused(ErrorCode.SANDBOX_LIMIT, capped_session(backend, template))
        assert "does not fit" in error.message
    assert os.listdir(backend.state_directory / "sessions") == []
    sessions = str(backend.state_directory / "sessions")  # this test's own: other suites may run beside it
    assert not any(sessions in line for line in Path("/proc/self/mountinfo").read_text().splitlines())


@capable_host
@pytest.mark.skipif(file_system_types("/dev/shm")[-1:] != ["tmpfs"], reason="/dev/shm is not a tmpfs")
async def test_a_template_is_copied_from_another_kind_of_file_system(driver_name):
    # copy_file_range refuses to copy from a tmpfs to an ext4 (EXDEV).
    state = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        async with sandboxns.open_backend(driver=driver_name, state_directory=state) as backend:
            backend._overlay = False  # as with the bwrap driver
            handle = await capped_session(backend, {"a.txt": b"from tmpfs"})
            assert await handle.session.read_file("a.txt") == b"from tmpfs"
            await handle.delete()
    finally:
        shutil.rmtree(state)


@capable_host
async def test_a_mount_still_in_use_on_the_host_is_detached_and_not_mounted_twice(backend):
    handle = await capped_session(backend)
    directory = session_dir(backend, handle)
    await handle.session.write_file("open.txt", b"held open by the host")
    held = os.open(directory / "storage" / "workspace" / "open.txt", os.O_RDONLY)
    try:
        state = handle.capture_state()
        await handle.stop()
        # Detached from the host's tree; the file system lives on for the fd.
        assert mounts_at(directory / "storage") == []
        assert len(loop_devices_backed_by(directory / "workspace.img")) == 1
        # Two ext4 instances over one image would corrupt it.
        error = await refused(ErrorCode.SANDBOX_BUSY, backend.create(template=handle.template_key, state=state))
        assert "in use" in error.message
    finally:
        os.close(held)
    assert await loop_devices_left(directory / "workspace.img") == []
    resumed = await backend.create(template=handle.template_key, state=state)
    assert await resumed.session.read_file("open.txt") == b"held open by the host"
    await resumed.delete()


@capable_host
async def test_the_workspace_keeps_its_owner_and_is_the_guests(backend):
    # As for any workspace (see test_host_user): on disk the files are the
    # workspace owner's (this process's user), to the guest its own.
    handle = await capped_session(backend)
    on_image = session_dir(backend, handle) / "storage"
    await handle.session.write_file("from-host", b"host")
    result = await handle.session.run("sh", ["-c", "echo x > made; mkdir dir; stat -c '%u:%g' . made dir from-host"])
    assert result.stdout.split() == ["1000:1000"] * 4, result
    owner = (os.geteuid(), os.getegid())
    for path in (on_image, on_image / "workspace", *(on_image / "workspace" / name for name in ("made", "dir"))):
        assert (path.stat().st_uid, path.stat().st_gid) == owner, path
    await handle.delete()


@capable_host
async def test_a_spec_caps_its_sessions(backend):
    spec = sandboxns.SandboxSpec.from_dict(
        {"id": "capped", "driver": backend.name, "template": {"files": {"a": "1"}}, "limits": {"workspace_size": CAP}}
    )
    handle = await spec.create_session(backend)
    result = await handle.session.run("sh", ["-c", FILL])
    assert result.stdout == "1\n" and "No space left on device" in result.stderr, result
    await handle.delete()


CRASHING_OWNER = f"""
import json, sys, trio, sandboxns

async def main(driver, state_directory):
    async with sandboxns.open_backend(driver=driver, state_directory=state_directory) as backend:
        template = await backend.prewarm(template="capped", files={{}})
        confinement = sandboxns.Confinement(workspace_size={CAP})
        handle = await backend.create(template=template.template_key, confinement=confinement)
        await handle.session.write_file("written.txt", b"before the crash")
        print(json.dumps(handle.capture_state()), flush=True)
        await trio.sleep_forever()

trio.run(main, *sys.argv[1:])
"""


@capable_host
async def test_a_crashed_owners_mount_is_taken_over(driver_name, state_dir):
    owner = await trio.lowlevel.open_process(
        [sys.executable, "-P", "-c", CRASHING_OWNER, driver_name, str(state_dir)], stdout=subprocess.PIPE
    )
    output = b""
    with trio.fail_after(30):
        while not output.endswith(b"\n"):
            chunk = await owner.stdout.receive_some(4096)
            assert chunk, f"the owner exited early: {output!r}"
            output += chunk
    state = json.loads(output)
    owner.send_signal(signal.SIGKILL)
    await owner.wait()
    storage = state_dir / "sessions" / state["session"] / "storage"
    assert len(mounts_at(storage)) == 1  # the kernel keeps the mount
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="capped", files={})
        handle = await backend.create(template=template.template_key, state=state)
        assert len(mounts_at(storage)) == 1  # taken over, not mounted again
        assert await handle.session.read_text_file("written.txt") == "before the crash"
        result = await handle.session.run("sh", ["-c", FILL])
        assert result.stdout == "1\n", result
        await handle.delete()
    assert mounts_at(storage) == []


@capable_host
async def test_each_fork_of_a_capped_session_has_the_cap_on_its_own_layer(backend):
    # Native: the snapshot's layer is moved off the origin's image (copied:
    # another file system) and shared; each fork writes on an image of its
    # own, which the layer below does not fill. bwrap: each fork's workspace
    # is a whole copy, on its own image, which the copy fills.
    template = await backend.prewarm(template="capped-fork", files={"a": b"1"})
    async with await backend.create(template=template.template_key, confinement=CAPPED) as origin:
        assert (await origin.session.run("sh", ["-c", "head -c 20M /dev/zero > half; echo $?"])).stdout == "0\n"
        forks = await origin.fork(2)
        try:
            for fork in forks:
                assert fork._image is not None and fork._image.path != origin._image.path
                more = await fork.session.run("sh", ["-c", "head -c 20M /dev/zero > more; echo $?"])
                if backend.name == "native":  # the 20 MiB below do not count: 20 more fit, 40 do not
                    assert more.stdout == "0\n", more
                    filled = await fork.session.run("sh", ["-c", FILL])
                else:  # the copy's 20 MiB count
                    filled = more
                assert filled.stdout.strip() != "0" and "No space left" in filled.stderr, filled
                assert (await fork.session.run("sh", ["-c", "wc -c < half"])).stdout == f"{20 << 20}\n"
        finally:
            for fork in forks:
                await fork.delete()
        assert (await origin.session.run("sh", ["-c", "ls"])).stdout.split() == ["a", "half"]


@capable_host
async def test_a_capped_sessions_snapshot_keeps_its_deletions(backend):
    # Its upper layer is copied off the image into the store, whiteouts and
    # opaque directories with it: what was deleted stays deleted.
    template = await backend.prewarm(template="capped-deletes", files={"a": b"1", "d/old": b"2", "keep": b"3"})
    async with await backend.create(template=template.template_key, confinement=CAPPED) as origin:
        await origin.session.run("sh", ["-c", "rm a; rm -r d; mkdir d; echo new > d/new"])
        [fork] = await origin.fork(1)
        try:
            for handle in (origin, fork):
                shown = await handle.session.run("sh", ["-c", "ls -R"])
                assert shown.stdout.split() == [".:", "d", "keep", "./d:", "new"], shown
        finally:
            await fork.delete()
