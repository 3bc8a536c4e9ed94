"""Nothing of one command reaches the next in the same session but its
workspace: a command plants state of every kind it can make, and the next
looks for it (processes, SysV and POSIX IPC objects, files and modes of
its scratch places, mounts, open fds, environment)."""

from __future__ import annotations

import json
import os

import pytest
import trio

import sandboxns

pytestmark = pytest.mark.smoke

# Runs as the guest; prints what it planted, as JSON.
PLANT = r"""
import ctypes, errno, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT = 0o1000
planted = {
    "shm": libc.shmget(0x5B5, 4096, IPC_CREAT | 0o666),
    "sem": libc.semget(0x5B6, 1, IPC_CREAT | 0o666),
    "msg": libc.msgget(0x5B7, IPC_CREAT | 0o666),
    "mq": libc.mq_open(b"/sandboxns-residue", os.O_CREAT | os.O_RDWR, 0o600, None),
}
for place in ("/tmp", "/dev/shm"):
    with open(f"{place}/residue", "w") as f:
        f.write("left behind")
    os.mkdir(f"{place}/residue-dir")
    os.chmod(place, 0o700)
leaked = os.open("/workspace", os.O_RDONLY)  # inheritable
os.set_inheritable(leaked, True)
# A process that leaves the command's session and process group, twice
# over; it says it runs by opening a FIFO for writing.
os.mkfifo("/tmp/running")
subprocess.Popen(
    ["sh", "-c", "setsid sh -c 'exec 3>/tmp/running; exec sleep 1001' </dev/null >/dev/null 2>&1 &"], close_fds=False
).wait()
open("/tmp/running").close()
planted["sleeping"] = sorted(
    int(pid) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) not in (1, os.getpid())
)
print(json.dumps(planted))
"""

# Runs as the guest; prints what it finds, as JSON.
LOOK = r"""
import ctypes, json, os, stat
libc = ctypes.CDLL(None, use_errno=True)
found = {
    "sysvipc": {kind: open(f"/proc/sysvipc/{kind}").read().splitlines()[1:] for kind in ("shm", "sem", "msg")},
    "mq": libc.mq_open(b"/sandboxns-residue", os.O_RDONLY, 0, None),
    "mq_errno": ctypes.get_errno(),
    "scratch": {place: (sorted(os.listdir(place)), oct(stat.S_IMODE(os.stat(place).st_mode))) for place in ("/tmp", "/dev/shm")},
    "processes": sorted(
        open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()
        for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()
    ),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "mounts": sorted(line.split()[4] for line in open("/proc/self/mountinfo")),
    "environment": dict(os.environ),
}
print(json.dumps(found))
"""

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "MARK": "given"}


async def look(session) -> dict:
    result = await session.run("python3", ["-c", LOOK], env=ENV)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


async def test_nothing_a_command_plants_reaches_the_next(session):
    await plant_and_look(session)


async def test_nothing_a_command_plants_reaches_the_next_with_the_hosts_network(driver_name, workspace):
    # The native driver's inits serve one command each there (see csrc/serve.c).
    async with sandboxns.open_sandbox(workspace, driver=driver_name, network="allow-all") as session:
        await plant_and_look(session)


async def plant_and_look(session) -> None:
    before = await look(session)
    planting = await session.run("python3", ["-c", PLANT], env=ENV)
    assert planting.exit_code == 0, planting
    planted = json.loads(planting.stdout)
    # Every kind was made for real: otherwise the look below proves nothing.
    assert all(planted[kind] >= 0 for kind in ("shm", "sem", "msg", "mq")), planted
    assert planted["sleeping"], planted  # the escaped process was running
    after = await look(session)
    assert after["sysvipc"] == {"shm": [], "sem": [], "msg": []}, after
    assert after["mq"] == -1 and after["mq_errno"] == 2, after  # ENOENT
    assert after["scratch"] == {"/tmp": [[], "0o1777"], "/dev/shm": [[], "0o1777"]}, after
    # Only the looking command's own process tree: its init, itself.
    assert after["processes"] == before["processes"], after
    assert after["fds"] == before["fds"] and after["mounts"] == before["mounts"], after
    assert after["environment"] == before["environment"] == {**ENV, "PWD": "/workspace"}, after


# Leaves /tmp and /dev/shm empty, but not as they were: old times, an
# extended attribute where the kernel keeps them on tmpfs.
MARK_ONLY = r"""
import errno, os
for place in ("/tmp", "/dev/shm"):
    os.utime(place, (978307200, 978307200))
    try:
        os.setxattr(place, "user.residue", b"1")
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            raise
"""

LOOK_AT_PLACES = r"""
import json, os
print(json.dumps({place: [os.stat(place).st_mtime, os.listxattr(place)] for place in ("/tmp", "/dev/shm")}))
"""


async def test_an_empty_scratch_place_a_command_marked_is_a_new_one_for_the_next(session):
    marking = await session.run("python3", ["-c", MARK_ONLY], env=ENV)
    assert marking.exit_code == 0, marking
    looked = await session.run("python3", ["-c", LOOK_AT_PLACES], env=ENV)
    for place, (mtime, xattrs) in json.loads(looked.stdout).items():
        assert mtime > 978307200 and xattrs == [], (place, mtime, xattrs)


@pytest.mark.parametrize(
    "planting",
    [
        # Deeper than an init clears (it then goes, and a new one serves).
        "cd /tmp && for i in $(seq 100); do mkdir d && cd d; done && echo deep > leaf",
        # What its owner made unreadable, and odd kinds of file.
        (
            "mkdir -p /tmp/locked/in && echo x > /tmp/locked/in/f && ln /tmp/locked/in/f /tmp/hard"
            " && chmod 0 /tmp/locked/in /tmp/locked && mkfifo /dev/shm/fifo && ln -s /workspace /dev/shm/link"
            " && chmod 0 /tmp"
        ),
    ],
    ids=["deep", "locked"],
)
async def test_whatever_a_command_leaves_in_scratch_places_is_gone_for_the_next(session, planting):
    planted = await session.run("sh", ["-c", planting], env=ENV)
    assert planted.exit_code == 0, planted
    for _ in range(2):  # whichever init serves next
        looked = await session.run("sh", ["-c", "ls -A /tmp /dev/shm; stat -c %a /tmp /dev/shm"], env=ENV)
        assert looked.stdout.split() == ["/dev/shm:", "/tmp:", "1777", "1777"], looked


# Command B: takes the fds command A sends, then, while command C runs,
# looks through them for C (its processes' environments, its /tmp files).
HOLDER_OF_FDS = r"""
import array, json, os, socket, sys
name = sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(f"/workspace/{name}")
server.listen(1)
open("/workspace/b-listening", "w").close()
connection, _ = server.accept()
fds = array.array("i")
_, ancillary, _, _ = connection.recvmsg(1, socket.CMSG_SPACE(2 * fds.itemsize))
fds.frombytes(ancillary[0][2])
proc_fd, tmp_fd = fds
connection.sendall(b"k")
open("/workspace/c-ready").close()  # C runs now
environments = []
for pid in os.listdir(proc_fd):
    if pid.isdigit():
        try:
            fd = os.open(f"{pid}/environ", os.O_RDONLY, dir_fd=proc_fd)
            environments.append(os.read(fd, 65536).decode(errors="replace"))
            os.close(fd)
        except OSError:
            pass
print(json.dumps({"environments": environments, "tmp": os.listdir(tmp_fd)}))
open("/workspace/c-release", "w").close()
"""

# Command A: hands its /proc and /tmp to B, and ends.
HANDER_OF_FDS = r"""
import array, os, socket, sys
open("/workspace/b-listening").close()
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(f"/workspace/{sys.argv[1]}")
fds = [os.open("/proc", os.O_RDONLY | os.O_DIRECTORY), os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)]
client.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
client.recv(1)
"""

# Command C: runs with a secret, makes a file, and waits for B to have looked.
LATER_COMMAND = (
    "echo mine > /tmp/c-file && exec 3>/workspace/c-ready && exec 4</workspace/c-release && cat <&4 >/dev/null"
)


async def test_a_command_running_beside_another_never_reaches_the_commands_after_it(session, workspace):
    for fifo in ("b-listening", "c-ready", "c-release"):
        os.mkfifo(workspace / fifo)
    name = "fd-socket"  # in the workspace, which every command of the session shares
    found = {}

    async def holder_of_fds() -> None:
        result = await session.run("python3", ["-c", HOLDER_OF_FDS, name], env=ENV)
        assert result.exit_code == 0, result
        found.update(json.loads(result.stdout))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder_of_fds)
        handed = await session.run("python3", ["-c", HANDER_OF_FDS, name], env=ENV)
        assert handed.exit_code == 0, handed
        later = await session.run("sh", ["-c", LATER_COMMAND], env={**ENV, "SECRET": "s3cret-of-c"})
        assert later.exit_code == 0, later
    assert not any("s3cret-of-c" in environment for environment in found["environments"]), found
    assert "c-file" not in found["tmp"], found


async def test_a_command_that_lowers_its_inits_limits_leaves_the_next_its_own(session):
    lowered = await session.run(
        "python3",
        [
            "-c",
            "import resource as r; [r.prlimit(1, k, (8, 8)) for k in (r.RLIMIT_NOFILE, r.RLIMIT_NPROC, r.RLIMIT_FSIZE)]",
        ],
        env=ENV,
    )
    assert lowered.exit_code == 0, lowered
    for _ in range(3):
        looked = await session.run("sh", ["-c", "ulimit -n; ulimit -f; echo ok"], env=ENV)
        assert looked.exit_code == 0 and looked.stdout.split()[-1] == "ok", looked
        assert looked.stdout.split()[:2] != ["8", "4"], looked


async def test_inode_flags_a_command_sets_on_scratch_places_are_gone_for_the_next(session):
    # FS_IOC_SETFLAGS / GETFLAGS with noatime and nodump, which an owner may set on tmpfs.
    set_flags = (
        "import fcntl, os, struct\n"
        "for place in ('/tmp', '/dev/shm'):\n"
        "    fd = os.open(place, os.O_RDONLY)\n"
        "    fcntl.ioctl(fd, 0x40086602, struct.pack('l', 0x80 | 0x40))\n"
    )
    get_flags = (
        "import fcntl, os, struct\n"
        "print([struct.unpack('l', fcntl.ioctl(os.open(p, os.O_RDONLY), 0x80086601, bytes(8)))[0]"
        " for p in ('/tmp', '/dev/shm')])\n"
    )
    before = await session.run("python3", ["-c", get_flags], env=ENV)
    marked = await session.run("python3", ["-c", set_flags], env=ENV)
    assert marked.exit_code == 0, marked
    after = await session.run("python3", ["-c", get_flags], env=ENV)
    assert after.stdout == before.stdout, (before, after)
