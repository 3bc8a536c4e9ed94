"""The host's side of the file API, and the state a backend keeps, against
a hostile guest. While guest commands reshape the workspace (symlink and
rename races, FIFOs, a 1 TiB sparse file, hard links, 10,000 nested
directories), the session's read/write/list/remove/mkdir, which run on the
host, touch nothing outside the workspace, never block, stay within bounded
memory and fds, and fail only with SandboxError. What a backend stores for a
session is out of the guest's reach and checked before it is used. Every case
asserts what the kernel shows afterwards: the bytes read, the files that
exist and where, their content, inodes and mtimes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import trio
from conftest import refused
from upstream import start_upstream

import sandboxns
from sandboxns import ErrorCode, Mount, SandboxError

pytestmark = pytest.mark.smoke

# What a raced host operation may fail with: the path is missing or not what
# the operation needs at that moment, or it leads through a symlink.
RACE_CODES = {ErrorCode.SANDBOX_PATH_REFUSED, ErrorCode.SANDBOX_NOT_FOUND, ErrorCode.SANDBOX_INVALID_ARGUMENT}
# Each race runs at least this many rounds of host operations, and on until
# every outcome it waits for has been seen, but never past MAX_ROUNDS.
MIN_ROUNDS = 200
MAX_ROUNDS = 5000
CANARY = b"CANARY root:x:0:0:host secret"

# Every guest program starts with this. ``ready()`` tells the host, through
# the FIFO named by argv[1], that the guest is set up and about to race;
# ``exchange`` swaps two names atomically (renameat2 RENAME_EXCHANGE), so a
# path flips between two kinds of file with no moment of being absent.
PRELUDE = """
import contextlib, ctypes, os, shutil, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
def exchange(a, b):
    return libc.renameat2(-100, a.encode(), -100, b.encode(), 2) == 0
def ready():
    open(sys.argv[1], "w").close()
def clear(name):
    if os.path.isdir(name) and not os.path.islink(name):
        shutil.rmtree(name, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
os.chdir("/workspace")
"""


async def start_guest(session, workspace: Path, nursery, program: str, *args: str) -> None:
    """Run ``program`` (after PRELUDE) in the guest and return once it has
    called ``ready()``. A guest that ends before that fails the test instead
    of leaving it waiting."""
    ready = workspace / f".ready-{secrets.token_hex(4)}"
    os.mkfifo(ready)

    async def run_guest() -> None:
        result = await session.run("python3", ["-c", PRELUDE + program, f"/workspace/{ready.name}", *args], timeout=120)
        with contextlib.suppress(OSError):  # release the host's read below
            os.close(os.open(ready, os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError(f"the guest ended early: {result}")

    nursery.start_soon(run_guest)
    await trio.to_thread.run_sync(ready.read_bytes)
    ready.unlink()


def release_fifos(workspace: Path) -> None:
    """Open every FIFO in the workspace at both ends once: any open of one
    that waits for the other end returns."""
    for directory, _, names in os.walk(workspace):
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


@contextlib.asynccontextmanager
async def never_blocked(workspace: Path, seconds: float = 10):
    """Fail, rather than hang, if the host blocks opening a guest's FIFO:
    ``seconds`` after the block began, or after the last call of the
    function it yields (a long loop calls it as it goes), the block is
    cancelled and, until it has ended, the workspace's FIFOs are released
    over and over (a host thread blocked in open() cannot be cancelled
    otherwise). A deadline, not synchronisation: the block must end long
    before it."""
    stuck, done = [], trio.Event()
    message = f"a host file operation blocked for {seconds}s on a FIFO the guest made"
    last_progress = [trio.current_time()]

    def progressed() -> None:
        last_progress[0] = trio.current_time()

    async def watchdog(body: trio.CancelScope) -> None:
        while (idle := trio.current_time() - last_progress[0]) < seconds:
            await trio.sleep(seconds - idle)
        stuck.append(True)
        body.cancel()
        with trio.CancelScope(shield=True):
            while not done.is_set():
                release_fifos(workspace)
                with trio.move_on_after(0.1):
                    await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog, nursery.cancel_scope)
        try:
            yield progressed
        except Exception as exc:  # what a released operation then did is beside the point
            if stuck:
                raise AssertionError(message) from exc
            raise
        finally:
            done.set()
            nursery.cancel_scope.cancel()
    assert not stuck, message


async def attempt(outcomes: Counter, label: str, operation):
    """Await a host file operation racing the guest: its result, or None if
    it failed, which it may only do with a SandboxError of RACE_CODES (any
    other exception fails the test). Counts what happened under label."""
    try:
        result = await operation
    except SandboxError as exc:
        assert exc.code in RACE_CODES, exc
        outcomes[label, exc.code] += 1
        return None
    outcomes[label, "done"] += 1
    return result


def snapshot(directory: Path) -> dict:
    """A host directory as the kernel reports it: each entry's inode, mtime
    and content, and the directory's own mtime."""
    entries = {".": directory.stat().st_mtime_ns}
    for entry in directory.iterdir():
        info = entry.lstat()
        entries[entry.name] = (info.st_ino, info.st_mtime_ns, entry.read_bytes() if entry.is_file() else None)
    return entries


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A host directory beside the workspace, with a canary file in it."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "passwd").write_bytes(CANARY)
    (path / "f").write_bytes(CANARY)
    return path


# 1. The guest flips t between a file and a symlink to the host canary, and
# d between a directory and a symlink to the host directory holding it.
SYMLINK_SWAPPER = """
canary = sys.argv[2]
def reset_t():
    for name in ("t", "t~"):
        clear(name)
    with open("t", "w") as f:
        f.write("inside")
    os.symlink(canary, "t~")
def reset_d():
    for name in ("d", "d~"):
        clear(name)
    os.mkdir("d")
    with open("d/f", "w") as f:
        f.write("inside")
    os.symlink("../outside", "d~")
reset_t()
reset_d()
ready()
while True:
    with contextlib.suppress(OSError):  # the host changed something meanwhile: mend it next time
        if not exchange("t", "t~") or os.path.islink("t") == os.path.islink("t~"):
            reset_t()
        if not exchange("d", "d~") or os.path.islink("d") == os.path.islink("d~"):
            reset_d()
"""


async def test_symlink_races_never_lead_the_host_outside(session, workspace, outside, tmp_path):
    before, fds = snapshot(outside), open_fds()
    outcomes: Counter = Counter()
    async with trio.open_nursery() as nursery:
        await start_guest(session, workspace, nursery, SYMLINK_SWAPPER, str(outside / "passwd"))
        for turn in range(MAX_ROUNDS):
            if turn >= MIN_ROUNDS and all(
                outcomes[label, outcome]
                for label in ("read t", "read d/f")
                for outcome in ("done", ErrorCode.SANDBOX_PATH_REFUSED)
            ):
                break
            for label, path in (("read t", "t"), ("read d/f", "d/f")):
                data = await attempt(outcomes, label, session.read_file(path))
                # b"": the guest's own new file, before it has written it.
                assert data in (None, b"", b"inside", b"from host"), data
            await attempt(outcomes, "write t", session.write_file("t", b"from host"))
            await attempt(outcomes, "write d/f", session.write_file("d/f", b"from host"))
            listing = await attempt(outcomes, "list d", session.list_dir("d"))
            assert listing is None or {entry.name for entry in listing} <= {"f", "sub"}, listing
            await attempt(outcomes, "mkdir d/sub", session.mkdir("d/sub", parents=True))
            if turn % 4 == 0:
                await attempt(outcomes, "remove t", session.remove("t"))
                await attempt(outcomes, "remove d", session.remove("d", recursive=True))
        nursery.cancel_scope.cancel()
    for label in ("read t", "read d/f"):  # both sides of the race happened
        assert outcomes[label, "done"] and outcomes[label, ErrorCode.SANDBOX_PATH_REFUSED], outcomes
    assert snapshot(outside) == before
    assert sorted(os.listdir(tmp_path)) == ["outside", "workspace"]
    assert open_fds() == fds


# 2. The guest renames the directories of the host's target path round and
# round, and swaps a symlink out of the workspace in for one of them.
RENAMER = """
os.makedirs("a/b/c")
os.symlink("../../outside", "a/l")
try:  # out of the workspace altogether: another mount, so never
    os.rename("a", "/tmp/a")
except OSError as exc:
    with open("moved-out.errno", "w") as f:
        f.write(str(exc.errno))
ready()
while True:
    for source, target in (("a/b", "a/b2"), ("a/b2", "a/b"), ("a", "x"), ("x", "a")):
        os.rename(source, target)
    exchange("a/b", "a/l")
    exchange("a/b", "a/l")
"""


async def test_renames_around_a_host_write_keep_it_inside(session, workspace, outside, tmp_path):
    before = snapshot(outside)
    outcomes: Counter = Counter()
    written = {}
    async with trio.open_nursery() as nursery:
        await start_guest(session, workspace, nursery, RENAMER)
        for turn in range(MAX_ROUNDS):
            if turn >= MIN_ROUNDS and outcomes["write", "done"] and outcomes["write", ErrorCode.SANDBOX_PATH_REFUSED]:
                break
            data, done = f"write {turn}".encode(), outcomes["write", "done"]
            await attempt(outcomes, "write", session.write_file(f"a/b/c/f{turn}", data))
            if outcomes["write", "done"] > done:
                written[f"f{turn}"] = data
        nursery.cancel_scope.cancel()
    assert outcomes["write", "done"] and outcomes["write", ErrorCode.SANDBOX_PATH_REFUSED], outcomes
    assert (workspace / "moved-out.errno").read_text() == str(errno.EXDEV)
    # Every write that succeeded is in the workspace, wherever the guest
    # left its directory; none is anywhere else, and no temporary is left.
    found = {}
    for directory, _, names in os.walk(workspace):
        for name in names:
            assert ".sandboxns-" not in name, name
            if name.startswith("f"):
                found[name] = Path(directory, name).read_bytes()
    assert found == written
    assert snapshot(outside) == before
    assert sorted(os.listdir(tmp_path)) == ["outside", "workspace"]


# 3. FIFOs, sockets and symlinks to them, where the host reads, writes,
# lists and removes.
async def test_special_files_are_never_opened_in_a_way_that_blocks(session, workspace):
    script = (
        "mkfifo pipe && ln pipe pipe2 && ln -s pipe link && mkdir -p dir/sub && mkfifo dir/inner dir/sub/deeper"
        " && python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\""
    )
    made = await session.run("sh", ["-c", script])
    assert made.exit_code == 0, made.stderr
    async with never_blocked(workspace):
        for name in ("pipe", "sock", "link"):
            await refused(ErrorCode.SANDBOX_PATH_REFUSED, session.read_file(name))
        await refused(ErrorCode.SANDBOX_NOT_FOUND, session.read_file("pipe/x"))
        await refused(ErrorCode.SANDBOX_NOT_FOUND, session.list_dir("link"))
        kinds = {entry.name: entry.kind for entry in await session.list_dir(".")}
        assert kinds == {"pipe": "other", "pipe2": "other", "sock": "other", "link": "symlink", "dir": "directory"}
        # A write replaces the FIFO by a file (rename), never writing into it:
        # its other link is still the FIFO.
        await session.write_file("pipe", b"from host")
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, session.mkdir("sock"))
        await session.remove("dir", recursive=True)
        await session.remove("sock")
    assert (workspace / "pipe").read_bytes() == b"from host"
    assert stat.S_ISFIFO((workspace / "pipe2").lstat().st_mode)
    assert sorted(os.listdir(workspace)) == ["link", "pipe", "pipe2"]


# The guest flips d between a directory and a symlink to a FIFO, and e/sub
# between a directory and a FIFO, under the host's recursive removes.
FIFO_SWAPPER = """
os.mkfifo("pipe")
def reset_d():
    for name in ("d", "d~"):
        clear(name)
    os.mkdir("d")
    os.symlink("pipe", "d~")
def reset_e():
    clear("e")
    os.makedirs("e/sub")
    os.mkfifo("e/sub~")
reset_d()
reset_e()
ready()
while True:  # the host removes, never makes: a pair it broke fails to exchange
    with contextlib.suppress(OSError):
        if not exchange("d", "d~"):
            reset_d()
        if not exchange("e/sub", "e/sub~"):
            reset_e()
"""


# Removes that succeeded, and reads that met the symlink (d) and the FIFO
# (e/sub) the guest swapped in.
SEEN_FIFO_RACE = [
    ("remove d", "done"),
    ("remove e", "done"),
    ("read d", ErrorCode.SANDBOX_PATH_REFUSED),
    ("read e/sub", ErrorCode.SANDBOX_PATH_REFUSED),
]


async def until_one_exists(workspace: Path, *names: str, seconds: float = 5) -> None:
    """Yield the CPU until one of the guest's ``names`` exists again (a
    bounded wait: if the guest never makes them, the race assertions say
    so)."""
    with trio.move_on_after(seconds):
        while not any(os.path.lexists(workspace / name) for name in names):
            await trio.sleep(0.001)


async def test_fifos_swapped_in_during_a_recursive_remove_never_block_it(session, workspace):
    outcomes: Counter = Counter()
    fds = open_fds()
    async with trio.open_nursery() as nursery:
        await start_guest(session, workspace, nursery, FIFO_SWAPPER)
        async with never_blocked(workspace) as progressed:
            for turn in range(MAX_ROUNDS):
                progressed()
                if turn >= MIN_ROUNDS and all(outcomes[key] for key in SEEN_FIFO_RACE):
                    break
                for _ in range(3):  # what the race is mostly about
                    await attempt(outcomes, "remove d", session.remove("d", recursive=True))
                    await attempt(outcomes, "remove e", session.remove("e", recursive=True))
                # The guest makes them again when it next runs; on two busy
                # cores a host removing them faster can starve it, and then
                # the race never happens. Let it run until it has.
                await until_one_exists(workspace, "d", "e")
                await attempt(outcomes, "read d", session.read_file("d"))
                await attempt(outcomes, "read e/sub", session.read_file("e/sub"))
                await attempt(outcomes, "list d", session.list_dir("d"))
                await attempt(outcomes, "list e/sub", session.list_dir("e/sub"))
        nursery.cancel_scope.cancel()
    assert all(outcomes[key] for key in SEEN_FIFO_RACE), outcomes
    assert outcomes["read d", "done"] == outcomes["read e/sub", "done"] == 0, outcomes  # never a regular file
    assert stat.S_ISFIFO((workspace / "pipe").lstat().st_mode)
    assert open_fds() == fds


# 4. A 1 TiB sparse file: no read allocates more than the limit.
def peak_memory_since_reset() -> int:
    """This process's peak resident memory (bytes) since the last reset."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_memory() -> int:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak to the current size
        f.write("5")
    return peak_memory_since_reset()


GROWER = """
fd = os.open("grow", os.O_CREAT | os.O_WRONLY)
ready()
while True:
    os.ftruncate(fd, 0)
    os.ftruncate(fd, 1 << 40)
"""


async def test_a_sparse_terabyte_file_is_refused_without_reading_it(session, workspace):
    made = await session.run("sh", ["-c", "truncate -s 1T big && stat -c %s big"])
    assert made.stdout.strip() == str(1 << 40), made
    session.configure(max_file_bytes=sandboxns._session.MAX_FILE_BYTES_LIMIT)  # the largest a caller may allow
    baseline = reset_peak_memory()
    error = await refused(ErrorCode.SANDBOX_LIMIT, session.read_file("big"))
    assert str(1 << 40) in error.message
    [entry] = await session.list_dir(".")
    assert (entry.name, entry.kind, entry.size) == ("big", "file", 1 << 40)
    session.configure(max_file_bytes=sandboxns._session.MAX_FILE_BYTES)
    # The guest flips a file between empty and 1 TiB while the host reads
    # it: each read is what fitted under the limit (zeros), or refused.
    outcomes: Counter = Counter()
    async with trio.open_nursery() as nursery:
        await start_guest(session, workspace, nursery, GROWER)
        for turn in range(MAX_ROUNDS):
            if turn >= MIN_ROUNDS and outcomes["read", "done"] and outcomes["read", ErrorCode.SANDBOX_LIMIT]:
                break
            try:
                data = await session.read_file("grow")
            except SandboxError as exc:
                assert exc.code == ErrorCode.SANDBOX_LIMIT, exc
                outcomes["read", exc.code] += 1
            else:
                assert len(data) <= session.max_file_bytes and not data.strip(b"\0"), len(data)
                outcomes["read", "done"] += 1
        nursery.cancel_scope.cancel()
    assert outcomes["read", "done"] and outcomes["read", ErrorCode.SANDBOX_LIMIT], outcomes
    assert peak_memory_since_reset() - baseline < 64 * 1024**2
    await session.write_file("big", b"small now")
    assert (workspace / "big").stat().st_size == len(b"small now")


# 5. Hard links. A host write replaces the file at the path by rename (see
# WorkspaceFiles.write_bytes): a hard link the guest made from it to another
# workspace file is broken, and the other file keeps its content. No hard
# link can be made to anything outside the workspace's own mount.
LINKER = """
import json, os, sys
open("/tmp/made-here", "w").close()
results = {}
for source in sys.argv[1:]:
    try:
        os.link(source, "/workspace/alias-%d" % len(results))
        results[source] = 0
    except OSError as exc:
        results[source] = exc.errno
print(json.dumps(results))
"""


async def test_hard_links_neither_alias_host_writes_nor_reach_outside(backend, tmp_path):
    project, shared, readonly = tmp_path / "project", tmp_path / "shared", tmp_path / "readonly"
    for directory in (project, shared, readonly):
        directory.mkdir()
    (shared / "data.txt").write_bytes(CANARY)
    (readonly / "data.txt").write_bytes(CANARY)
    handle = await backend.create(
        workspace=project,
        mounts=[Mount(shared, "/workspace/shared", writable=True), Mount(readonly, "/run/readonly")],
    )
    async with handle:
        session = handle.session
        made = await session.run("sh", ["-c", "echo victim > victim && ln victim alias"])
        assert made.exit_code == 0, made.stderr
        assert (project / "victim").stat().st_nlink == 2
        await session.write_file("alias", b"from host")
        sources = ["/workspace/shared/data.txt", "/run/readonly/data.txt", "/etc/passwd", "/usr/bin/env"]
        sources.append("/tmp/made-here")
        linked = await session.run("python3", ["-c", LINKER, *sources])
    assert (project / "victim").read_bytes() == b"victim\n"
    assert (project / "alias").read_bytes() == b"from host"
    assert (project / "victim").stat().st_nlink == (project / "alias").stat().st_nlink == 1
    assert json.loads(linked.stdout) == dict.fromkeys(sources, errno.EXDEV), linked.stderr
    assert sorted(os.listdir(project)) == ["alias", "shared", "victim"]
    for directory in (shared, readonly):
        assert (directory / "data.txt").read_bytes() == CANARY
        assert (directory / "data.txt").stat().st_nlink == 1


async def test_a_host_write_does_not_carry_a_guests_setuid_bit(driver_name, workspace):
    # Guests make no set-id files (seccomp) unless the host lifts that; then
    # a host write still drops the bits.
    relaxed = sandboxns.Confinement(seccomp=sandboxns.SeccompPolicy(allow={"setid_files"}))
    async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=relaxed) as session:
        made = await session.run("sh", ["-c", "echo '#!/bin/sh' > tool && chmod 6755 tool && stat -c %a tool"])
        assert made.stdout.strip() in ("6755", "4755"), made  # the kernel may drop setgid
        await session.write_file("tool", b"#!/bin/sh\necho host\n")
    assert stat.S_IMODE((workspace / "tool").stat().st_mode) == 0o755


# 6. Ten thousand nested directories.
NESTER = """
import os, sys
fd = os.open("/workspace", os.O_DIRECTORY)
name, depth, extras = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "extras"
for _ in range(depth):
    os.mkdir(name, dir_fd=fd)
    parent, fd = fd, os.open(name, os.O_DIRECTORY, dir_fd=fd)
    os.close(parent)
    if extras:
        os.close(os.open("file", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
        os.mkfifo("fifo", dir_fd=fd)
        os.symlink("/", "root", dir_fd=fd)
os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
"""


async def nest(session, name: str, depth: int, extras: bool = False) -> None:
    made = await session.run("python3", ["-c", NESTER, name, str(depth), "extras" if extras else "-"])
    assert made.exit_code == 0, made.stderr


# Counts the levels of a chain of directories named a, from the workspace.
DEPTH = """
import os
fd, depth = os.open("/workspace", os.O_DIRECTORY), 0
while True:
    try:
        parent, fd = fd, os.open("a", os.O_DIRECTORY, dir_fd=fd)
    except FileNotFoundError:
        break
    os.close(parent)
    depth += 1
print(depth)
"""


async def test_ten_thousand_nested_directories(backend):
    template = await backend.prewarm(template="nested", files={"kept": b"1"})
    handle = await backend.create(template=template.template_key)
    session_dir = backend.state_directory / "sessions" / handle.session_id
    session = handle.session
    try:
        await nest(session, "a", 10_000)
        await nest(session, "b", 100, extras=True)
        fds = open_fds()
        assert [(e.name, e.kind) for e in await session.list_dir("a")] == [("a", "directory")]
        assert [e.name for e in await session.list_dir("a/" * 1500)] == ["a"]
        await refused(ErrorCode.SANDBOX_LIMIT, session.read_file("a/" * 3000 + "f"))  # past PATH_MAX
        await session.mkdir("a/" * 1500 + "made/by/host", parents=True)  # a component at a time, not recursing
        error = await refused(ErrorCode.SANDBOX_LIMIT, session.remove("a", recursive=True))
        assert "nested more than" in error.message
        await session.remove("b", recursive=True)  # its FIFOs and symlinks too
        assert open_fds() == fds
        assert sorted(e.name for e in await session.list_dir(".")) == ["a", "kept"]
        depth = await session.run("python3", ["-c", DEPTH])
        assert depth.stdout.strip() == "10000", depth  # the refused remove left the chain whole
    finally:  # also when the test fails: pytest's own clean-up cannot remove a tree this deep
        await handle.delete()
    assert not session_dir.exists()
    assert sorted(os.listdir(backend.state_directory / "sessions")) == []


def test_the_cli_removes_a_throwaway_workspace_nested_past_pythons_recursion(driver_name, tmp_path):
    # `sandboxns run` without --workspace gives the command a new directory
    # and removes it afterwards, however deep the guest nested it.
    scratch = tmp_path / "state" / "sandboxns" / "tmp"
    command = [sys.executable, "-m", "sandboxns", "run", "--driver", driver_name, "--"]
    command += ["python3", "-c", NESTER, "a", "3000", "-"]
    try:
        done = subprocess.run(
            command, cwd=tmp_path, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert (done.returncode, done.stderr) == (0, b"")
        assert not scratch.exists()  # the workspace, and the directory of them, removed
    finally:  # pytest's own clean-up cannot remove a tree this deep
        subprocess.run(["rm", "-rf", "--", str(scratch)], check=False)


# 7. State. The backend keeps a session's record (session.json) and lease in
# state_dir/sessions/<id>/, beside its workspace but outside it: the guest
# sees only the workspace's contents, so what it plants there is only ever
# workspace files. The record is the host's; what it can check, resume
# checks before using any of it.
async def test_state_planted_by_the_guest_is_only_workspace_files(backend, outside):
    template = await backend.prewarm(template="t", files={"kept": b"1"})
    handle = await backend.create(template=template.template_key)
    session_dir = backend.state_directory / "sessions" / handle.session_id
    record = (session_dir / "session.json").read_bytes()
    planted = {
        "format": 1, "backend": backend.name, "template": None, "session": handle.session_id, "layout": "bound",
        "workspace": str(outside), "mounts": [{"host": str(outside), "guest": "/run/planted", "writable": True}],
        "network": "allow-all",
    }  # fmt: skip
    script = (
        f"printf '%s' '{json.dumps(planted)}' > session.json && ln -s {outside / 'passwd'} lease"
        " && mkdir -p sessions/x overlay-work && cp session.json sessions/x/"
    )
    made = await handle.session.run("sh", ["-c", script])
    assert made.exit_code == 0, made.stderr
    state = handle.capture_state()
    await handle.stop()
    assert (session_dir / "session.json").read_bytes() == record
    assert stat.S_ISREG((session_dir / "lease").lstat().st_mode)
    resumed = await backend.create(template=template.template_key, state=state)
    async with resumed:
        seen = await resumed.session.run("sh", ["-c", "ls -A /run; echo ---; ls -A /workspace"])
    run_entries, workspace_entries = (part.split() for part in seen.stdout.split("---"))
    assert "planted" not in run_entries
    assert sorted(workspace_entries) == ["kept", "lease", "overlay-work", "session.json", "sessions"]
    assert (outside / "passwd").read_bytes() == CANARY


def edited(record: dict, **changes) -> bytes:
    return json.dumps({**record, **changes}).encode()


async def test_a_damaged_or_edited_session_record_is_refused_whole(backend, tmp_path):
    template = await backend.prewarm(template="t", files={"kept": b"1"})
    handle = await backend.create(template=template.template_key)
    await handle.session.write_file("work", b"done")
    state = handle.capture_state()
    await handle.stop()
    path = backend.state_directory / "sessions" / handle.session_id / "session.json"
    original = path.read_bytes()
    record = json.loads(original)
    (tmp_path / "copy.json").write_bytes(original)
    damaged = [
        b"{not json",
        b"[]",
        b" " * 70_000 + original,
        edited(record, format=2),
        edited(record, session="0" * 32),
        edited(record, layout="elsewhere"),
        edited(record, layout="bound", workspace="/"),
        edited(record, template="../../../../../../etc"),
        edited(record, mounts="/etc"),
        edited(record, mounts=[{"host": "/etc", "guest": "/run/etc", "writable": "yes"}]),
    ]
    async with never_blocked(tmp_path):
        for content in damaged:
            path.write_bytes(content)
            await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(template=template.template_key, state=state))
            with pytest.raises(SandboxError) as error:
                sandboxns._state.stored_session_state(backend.state_directory, handle.session_id)
            assert error.value.code == ErrorCode.SANDBOX_STATE_MISMATCH, content[:80]
        for replace in (lambda: path.symlink_to(tmp_path / "copy.json"), lambda: os.mkfifo(path)):
            path.unlink()
            replace()
            await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(template=template.template_key, state=state))
        path.unlink()
    # None of the refusals changed anything: with its record back, the
    # session resumes with its files.
    path.write_bytes(original)
    async with await backend.create(template=template.template_key, state=state) as resumed:
        assert await resumed.session.read_file("work") == b"done"


async def test_a_stored_mount_redirected_to_the_state_directory_is_refused(backend, tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "data").mkdir()
    handle = await backend.create(workspace=tmp_path / "project", mounts=[Mount(tmp_path / "data", "/run/data")])
    state = handle.capture_state()
    await handle.stop()
    path = backend.state_directory / "sessions" / handle.session_id / "session.json"
    record = json.loads(path.read_text())
    record["mounts"][0]["host"] = str(backend.state_directory.resolve())
    path.write_text(json.dumps(record))
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(state=state))


async def test_a_bound_workspace_swapped_for_a_symlink_is_not_followed(backend, tmp_path):
    # The guest of a session bound to a directory replaces the directory
    # another session is bound to (inside its own) by a symlink to a host
    # directory, for that session to bind when it is resumed.
    parent, victim = tmp_path / "parent", tmp_path / "victim"
    (parent / "child").mkdir(parents=True)
    victim.mkdir()
    (victim / "secret").write_bytes(CANARY)
    child = await backend.create(workspace=parent / "child")
    state = child.capture_state()
    await child.stop()
    async with await backend.create(workspace=parent) as outer:
        swap = await outer.session.run("sh", ["-c", f"mv child child.old && ln -s {victim} child"])
    assert swap.exit_code == 0, swap.stderr
    before = snapshot(victim)
    await refused(ErrorCode.SANDBOX_PATH_REFUSED, backend.create(state=state))
    assert snapshot(victim) == before


async def test_a_lease_swapped_for_a_symlink_is_not_followed(backend, outside):
    template = await backend.prewarm(template="t", files={})
    handle = await backend.create(template=template.template_key)
    state = handle.capture_state()
    await handle.stop()
    lease = backend.state_directory / "sessions" / handle.session_id / "lease"
    lease.unlink()
    lease.symlink_to(outside / "passwd")
    before = snapshot(outside)
    error = await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(template=template.template_key, state=state))
    assert str(lease) in error.message
    assert snapshot(outside) == before


async def test_a_network_policy_written_into_the_record_is_not_applied(backend):
    template = await backend.prewarm(template="t", files={})
    handle = await backend.create(template=template.template_key)
    state = handle.capture_state()
    await handle.stop()
    path = backend.state_directory / "sessions" / handle.session_id / "session.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "network": "allow-all", "policy": "allow-all"}))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        async with await backend.create(template=template.template_key, state=state) as resumed:
            result = await resumed.session.run("bash", ["-c", f"echo > /dev/tcp/127.0.0.1/{port} && echo connected"])
            assert resumed.session.network.shares_host_network is False
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "connected" not in result.stdout and result.exit_code != 0, result


# 8. Two sessions' gateways: each guest reaches only its own socket, and
# its requests carry only its own policy's credentials.
CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("refused", exc.errno)
    sys.exit()
s.sendall(sys.stdin.buffer.read())
print(s.recv(65536).split(b" ")[1].decode())
"""


async def test_sessions_reach_only_their_own_gateway_and_credentials(backend, nursery):
    upstreams = [await start_upstream(nursery, "http") for _ in range(2)]
    secrets_of = [f"Bearer session-{i}-{secrets.token_hex(8)}" for i in range(2)]
    template = await backend.prewarm(template="t", files={})
    handles = [
        await backend.create(
            template=template.template_key,
            network={"allow": [{"origin": upstream.origin, "headers": {"authorization": secret}}]},
        )
        for upstream, secret in zip(upstreams, secrets_of, strict=True)
    ]
    sockets = [handle._network.gateway.socket_path for handle in handles]
    assert sockets[0] != sockets[1]
    for mine, other in ((0, 1), (1, 0)):
        session = handles[mine].session

        async def request(socket_path: str, upstream, session=session) -> str:
            raw = f"GET / HTTP/1.1\r\nHost: {upstream.host}\r\nConnection: close\r\n\r\n".encode()
            result = await session.run("python3", ["-c", CLIENT, socket_path], stdin=raw, timeout=20)
            assert result.exit_code == 0, result.stderr
            return result.stdout.strip()

        assert await request("/run/sandboxns-network.sock", upstreams[other]) == "403"
        assert await request(str(sockets[other]), upstreams[other]) == f"refused {errno.ENOENT}"
        assert await request("/run/sandboxns-network.sock", upstreams[mine]) == "200"
        listing = await session.run(
            "sh", ["-c", "ls -A /run /run/sandboxns; echo ---; env; cat /proc/[0-9]*/environ 2>/dev/null"]
        )
        # Only its own gateway (and, under bwrap, the program that starts
        # each command, the same for every session).
        shown = set(listing.stdout.split("---")[0].split()) - {"sandboxns-init", "/run:", "/run/sandboxns:"}
        assert shown == {"sandboxns-network.sock", "sandboxns", "network.sock"}, listing
        assert not any(secret in listing.stdout for secret in secrets_of)
    for upstream, secret in zip(upstreams, secrets_of, strict=True):
        assert [request.headers.get("authorization") for request in upstream.requests] == [secret]
    for handle in handles:
        await handle.delete()
