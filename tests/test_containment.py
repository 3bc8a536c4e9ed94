"""Host-side path resolution under attack: whatever the guest does to the
tree, the host never reads or writes outside the workspace. Both resolvers
are tested: openat2 and the O_NOFOLLOW walk used where openat2 is missing."""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

import pytest
import trio
from conftest import FirstLine

from sandboxns import ErrorCode, SandboxError
from sandboxns._files import WorkspaceFiles, open_beneath, walk_beneath

pytestmark = pytest.mark.smoke

RESOLVERS = {"openat2": open_beneath, "walk": walk_beneath}


@pytest.fixture(params=sorted(RESOLVERS))
def resolver(request):
    return RESOLVERS[request.param]


@pytest.fixture
def outside(tmp_path):
    """A host directory next to the workspace, holding a secret."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "f").write_text("SECRET")
    return path


def refused_code(operation, *args) -> ErrorCode:
    with pytest.raises(SandboxError) as error:
        operation(*args)
    return error.value.code


def test_symlinks_of_every_shape_are_not_followed_out(workspace, outside, resolver):
    (workspace / "dir").mkdir()
    (workspace / "dir/inner").write_text("inside")
    links = {
        "leaf_abs": str(outside / "f"),
        "leaf_rel": "../outside/f",
        "dangling": "does-not-exist",
        "mid_abs": str(outside),
        "mid_rel": "../outside",
        "mid_dotdot": "dir/../..",
    }
    for name, target in links.items():
        os.symlink(target, workspace / name)
    files = WorkspaceFiles.of_directory(workspace, resolver)
    try:
        for path in ("leaf_abs", "leaf_rel", "dangling", "mid_abs/f", "mid_rel/f", "mid_dotdot/outside/f"):
            assert refused_code(files.read_bytes, f"/workspace/{path}", 100) == ErrorCode.SANDBOX_PATH_REFUSED
        for path in ("mid_abs/new", "mid_rel/new", "mid_rel/f"):
            assert refused_code(files.write_bytes, f"/workspace/{path}", b"x") == ErrorCode.SANDBOX_PATH_REFUSED
            assert refused_code(files.list_dir, f"/workspace/{path.split('/')[0]}") == ErrorCode.SANDBOX_PATH_REFUSED
        # Writing over a leaf symlink replaces the link; its target is untouched.
        files.write_bytes("/workspace/leaf_rel", b"replaced")
        assert not os.path.islink(workspace / "leaf_rel")
    finally:
        files.close()
    assert sorted(os.listdir(outside)) == ["f"]
    assert (outside / "f").read_text() == "SECRET"


def test_a_symlink_inside_the_workspace_is_followed_only_by_openat2(workspace):
    (workspace / "dir").mkdir()
    (workspace / "dir/inner").write_text("inside")
    os.symlink("dir", workspace / "alias")
    files = WorkspaceFiles.of_directory(workspace, open_beneath)
    walk = WorkspaceFiles.of_directory(workspace, walk_beneath)
    try:
        assert files.read_bytes("/workspace/alias/inner", 100) == b"inside"
        assert refused_code(walk.read_bytes, "/workspace/alias/inner", 100) == ErrorCode.SANDBOX_PATH_REFUSED
        assert walk.read_bytes("/workspace/dir/inner", 100) == b"inside"
    finally:
        files.close()
        walk.close()


# The guest flips /workspace/d between a real directory and symlinks that
# escape (relative and absolute host paths) as fast as it can.
SWAPPER = """
import os, sys
os.chdir("/workspace")
os.mkdir("real")
with open("real/f", "w") as f:
    f.write("inside")
targets = ["../outside", sys.argv[1]]
print("ready", flush=True)
i = 0
while True:
    os.rename("real", "d")
    os.rename("d", "real")
    os.symlink(targets[i % 2], "d")
    os.unlink("d")
    i += 1
"""


def hammer(files: WorkspaceFiles, minimum: int, most: int = 500_000) -> Counter:
    """Read and write through the swapping path at least ``minimum`` times,
    and on until both sides of the race have been seen (the guest may be
    scheduled late), but never more than ``most`` times."""
    outcomes: Counter = Counter()
    for i in range(most):
        if i >= minimum and outcomes["done"] and outcomes[ErrorCode.SANDBOX_PATH_REFUSED]:
            break
        try:
            if i % 2:
                files.write_bytes("/workspace/d/f", b"inside-%d" % i)
            else:
                data = files.read_bytes("/workspace/d/f", 100)
                assert data.startswith(b"inside"), data
            outcomes["done"] += 1
        except SandboxError as exc:
            assert exc.code in (ErrorCode.SANDBOX_PATH_REFUSED, ErrorCode.SANDBOX_NOT_FOUND), exc
            outcomes[exc.code] += 1
    return outcomes


def hammer_beneath(root: int, resolver) -> Counter:
    files = WorkspaceFiles(os.dup(root), resolver)
    try:
        return hammer(files, 10_000)
    finally:
        files.close()


async def test_a_guest_swapping_symlinks_never_leads_the_host_outside(session, workspace, outside, resolver):
    swapper = FirstLine()
    process = await session.driver.spawn(
        ["python3", "-c", SWAPPER, str(outside)],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/workspace",
        output=swapper,
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.wait)
            with trio.fail_after(10):
                await swapper.arrived.wait()
            assert swapper.stdout == b"ready\n"
            # The driver's own handle on the workspace, as the session uses
            # it (and as the user it acts as there).
            try:
                outcomes = await session.driver.workspace_call(hammer_beneath, resolver)
            finally:
                await process.send_signal(signal.SIGKILL)
    finally:
        await process.aclose()
    # Both sides of the race happened, and the outside never changed.
    assert outcomes["done"] > 0 and outcomes[ErrorCode.SANDBOX_PATH_REFUSED] > 0, outcomes
    assert sorted(os.listdir(outside)) == ["f"]
    assert (outside / "f").read_text() == "SECRET"


def test_the_walk_is_used_when_openat2_is_missing(workspace, monkeypatch):
    from sandboxns import _ffi, _files

    def no_openat2(*args):
        raise OSError(errno.ENOSYS, "openat2")

    monkeypatch.setattr(_ffi, "open_beneath", no_openat2)
    monkeypatch.setattr(_files, "_openat2_missing", False)
    (workspace / "dir").mkdir()
    (workspace / "dir/f").write_text("x")
    os.symlink("dir", workspace / "alias")
    files = WorkspaceFiles.of_directory(workspace)
    try:
        assert files.read_bytes("/workspace/dir/f", 10) == b"x"
        assert refused_code(files.read_bytes, "/workspace/alias/f", 10) == ErrorCode.SANDBOX_PATH_REFUSED
    finally:
        files.close()
    assert _files._openat2_missing
