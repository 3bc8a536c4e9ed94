"""Contained file I/O through the session: the same workspace the guest
sees, and never a byte outside it."""

from __future__ import annotations

import os
import stat

import pytest
import trio
from conftest import refused

from sandboxns import ErrorCode

pytestmark = pytest.mark.smoke


async def test_files_round_trip_with_the_guest(session, workspace):
    await session.mkdir("src/pkg", parents=True)
    await session.write_text_file("src/pkg/mod.py", "print('héllo')\n")
    assert (workspace / "src/pkg/mod.py").read_text() == "print('héllo')\n"
    result = await session.run("/bin/cat", ["/workspace/src/pkg/mod.py"])
    assert result.stdout == "print('héllo')\n"
    await session.run("/bin/sh", ["-c", "printf 'from guest' > src/out.bin; ln -s pkg src/link"])
    assert await session.read_file("/workspace/src/out.bin") == b"from guest"
    entries = {entry.name: entry.kind for entry in await session.list_dir("src")}
    assert entries == {"pkg": "directory", "out.bin": "file", "link": "symlink"}
    assert await session.read_text_file("src/link/mod.py") == "print('héllo')\n"  # stays inside


async def test_replacing_a_file_is_atomic_and_keeps_its_mode(session, workspace):
    target = workspace / "run.sh"
    target.write_text("old")
    target.chmod(0o755)
    await session.write_file("run.sh", b"new")
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o755
    assert sorted(os.listdir(workspace)) == ["run.sh"]  # no temporary left behind


async def test_symlinks_out_of_the_workspace_are_refused(session, workspace, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    await session.run(
        "/bin/sh",
        ["-c", f"ln -s /etc/passwd abs; ln -s .. up; ln -s ../../outside.txt rel; ln -s {outside} host"],
    )
    for name in ("abs", "rel", "host", "up/outside.txt"):
        await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.read_file(name))
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.write_file("up/planted", b"x"))
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.list_dir("up"))
    assert not (tmp_path / "planted").exists()
    assert outside.read_text() == "secret"


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "/workspace/../etc", "a/../../b"])
async def test_paths_outside_the_workspace_are_refused(session, path):
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.read_file(path))
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.write_file(path, b"x"))


async def test_size_limits_and_nothing_lost_on_refusal(session, workspace):
    await session.write_file("keep.txt", b"original")
    await refused(ErrorCode.SANDBOX_LIMIT, session.write_file("keep.txt", b"x" * (1024 * 1024 + 1)))
    assert (workspace / "keep.txt").read_bytes() == b"original"
    await session.run("/bin/sh", ["-c", "head -c 2097152 /dev/zero > big"])
    await refused(ErrorCode.SANDBOX_LIMIT, session.read_file("big"))
    await session.write_file("exact", b"y" * (1024 * 1024))
    assert len(await session.read_file("exact")) == 1024 * 1024


async def test_missing_paths_and_removal(session, workspace):
    await refused(ErrorCode.SANDBOX_NOT_FOUND, session.read_file("nope.txt"))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, session.write_file("no/dir/file", b"x"))
    await session.mkdir("tree/sub", parents=True)
    await session.write_file("tree/sub/f", b"1")
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.remove("tree"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.read_file("tree"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.mkdir("tree"))
    await session.remove("tree", recursive=True)
    assert not (workspace / "tree").exists()
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.remove("."))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, session.remove("tree"))


async def test_bad_arguments(session):
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.write_file("x", "text, not bytes"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.write_text_file("x", b"bytes"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.read_file(3))


async def test_special_files_are_refused_at_once(session, workspace):
    await session.run(
        "/bin/sh", ["-c", "mkfifo pipe; python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""]
    )
    assert (workspace / "pipe").is_fifo() and (workspace / "sock").is_socket()
    names = ["pipe", "sock"]
    if os.geteuid() == 0:  # only host root can make a device node (here, like /dev/null)
        os.mknod(workspace / "device", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        names.append("device")
    with trio.fail_after(5):  # a FIFO without a writer must not block the read
        for name in names:
            await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.read_file(name))


async def test_a_write_replaces_a_hard_link_instead_of_writing_through_it(session, workspace, tmp_path):
    (workspace / "victim").write_text("untouched")
    os.link(workspace / "victim", workspace / "alias")
    await session.write_file("alias", b"new")
    assert (workspace / "victim").read_text() == "untouched"
    assert (workspace / "alias").read_text() == "new"


async def test_text_must_be_utf8(session, workspace):
    (workspace / "latin1.txt").write_bytes("café".encode("latin-1"))
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.read_text_file("latin1.txt"))
    assert "not UTF-8" in error.message and "offset 3" in error.message
    assert await session.read_file("latin1.txt") == "café".encode("latin-1")
