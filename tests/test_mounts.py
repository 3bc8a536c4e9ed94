"""Extra host paths bound into a session (sandboxns.Mount)."""

from __future__ import annotations

import pytest
from conftest import refused

from sandboxns import ErrorCode, Mount

pytestmark = pytest.mark.smoke


@pytest.fixture
def shared(tmp_path):
    path = tmp_path / "shared"
    (path / "sub").mkdir(parents=True)
    (path / "data.txt").write_text("host data")
    return path


async def test_read_only_and_writable_mounts(backend, shared, tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "marker").write_text("workspace's own")
    (tmp_path / "cover").write_text("covered")
    handle = await backend.create(
        workspace=tmp_path / "project",
        mounts=[
            Mount(shared, "/run/shared"),
            Mount(shared / "sub", "/run/shared/sub", writable=True),
            Mount(tmp_path / "cover", "/workspace/marker"),
        ],
    )
    async with handle:
        run = handle.session.run
        assert (await run("cat", ["/run/shared/data.txt"])).stdout == "host data"
        refused_write = await run("sh", ["-c", "echo x > /run/shared/data.txt"])
        assert refused_write.exit_code != 0 and "Read-only" in refused_write.stderr
        assert (await run("sh", ["-c", "echo guest > /run/shared/sub/new.txt"])).exit_code == 0
        assert (await run("cat", ["marker"])).stdout == "covered"
        assert (await run("sh", ["-c", "echo x > marker"])).exit_code != 0
        state = handle.capture_state()
    assert (shared / "sub" / "new.txt").read_text() == "guest\n"
    assert (shared / "data.txt").read_text() == "host data"
    assert (tmp_path / "project" / "marker").read_text() == "workspace's own"
    # Stored with the session: a resumed session has them again.
    async with await backend.create(state=state) as resumed:
        assert (await resumed.session.run("cat", ["/run/shared/data.txt"])).stdout == "host data"


@pytest.mark.parametrize(
    ("guest", "code"),
    [
        ("/etc/passwd", ErrorCode.SANDBOX_PATH_REFUSED),
        ("/run", ErrorCode.SANDBOX_PATH_REFUSED),
        ("/run/../etc", ErrorCode.SANDBOX_PATH_REFUSED),
        ("/run/a:b", ErrorCode.SANDBOX_PATH_REFUSED),
        ("/workspace", ErrorCode.SANDBOX_PATH_REFUSED),
        ("/run/sandboxns-network.sock", ErrorCode.SANDBOX_PATH_REFUSED),
        ("run/x", ErrorCode.SANDBOX_PATH_REFUSED),
    ],
)
async def test_bad_guest_paths_are_refused(backend, shared, tmp_path, guest, code):
    await refused(code, backend.create(workspace=shared, mounts=[Mount(tmp_path, guest)]))
    assert not list((backend.state_directory / "sessions").iterdir())


async def test_bad_host_paths_are_refused(backend, shared, tmp_path):
    await refused(
        ErrorCode.SANDBOX_NOT_FOUND, backend.create(workspace=shared, mounts=[Mount(tmp_path / "no", "/run/x")])
    )
    await refused(
        ErrorCode.SANDBOX_PATH_REFUSED,
        backend.create(workspace=shared, mounts=[Mount(backend.state_directory, "/run/x")]),
    )
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(workspace=shared, mounts=["/tmp"]))


async def test_a_guest_symlink_cannot_redirect_a_mount_point_on_resume(backend, shared, tmp_path):
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    handle = await backend.create(workspace=project, mounts=[Mount(shared / "data.txt", "/workspace/sub/settings.txt")])
    # A directory holding a mount point can be renamed: the guest swaps in a
    # symlink to a host directory for the next session's holder to follow.
    swap = await handle.session.run("sh", ["-c", f"mv sub sub.old && ln -s {victim} sub"])
    assert swap.exit_code == 0, swap.stderr
    state = handle.capture_state()
    await handle.stop()
    await refused(ErrorCode.SANDBOX_UNAVAILABLE, backend.create(state=state))
    assert list(victim.iterdir()) == []


async def test_a_mount_source_that_now_leads_elsewhere_is_refused(backend, shared, tmp_path):
    (tmp_path / "link-target").mkdir()
    source = tmp_path / "source"
    source.mkdir()
    handle = await backend.create(workspace=shared, mounts=[Mount(source, "/run/source")])
    state = handle.capture_state()
    await handle.stop()
    source.rmdir()
    source.symlink_to(tmp_path / "link-target")
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(state=state))


@pytest.mark.parametrize("target", ["directory", "file", "nothing"])
async def test_a_bound_workspace_that_now_leads_elsewhere_is_not_resumed(backend, tmp_path, target):
    bound, elsewhere = tmp_path / "bound", tmp_path / "elsewhere"
    bound.mkdir()
    if target == "directory":
        elsewhere.mkdir()
    elif target == "file":
        elsewhere.write_text("x")
    handle = await backend.create(workspace=bound)
    state = handle.capture_state()
    await handle.stop()
    bound.rename(tmp_path / "moved")
    bound.symlink_to(elsewhere)
    error = await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(state=state))
    assert "now leads to" in error.message
