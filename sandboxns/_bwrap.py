"""The bubblewrap driver: the native driver's contract, one ``bwrap`` per
command.

For hosts that cannot build, or do not trust, our C helper. Each command is a
bwrap invocation with the native driver's mount plan (see ``_plan``). What
bwrap itself does not give, this module adds:

* Setup failures are told apart from the command's own exit by bwrap's
  ``--json-status-fd``: an ``exit-code`` record is written only once the
  command was exec'd. Without it, everything on stderr is bwrap's own
  message, and it becomes a SandboxError (``execvp`` ENOENT is
  SANDBOX_NOT_FOUND as with the native driver; anything else in setup is
  SANDBOX_UNAVAILABLE), never an exit code.
* pid 1 of each command's pid namespace, the *init*, is ours
  (``sandboxns-holder --init``, which bwrap execs with ``--as-pid-1``), not
  bwrap's reaper: that one runs as the guest's user and dumpable, so the
  guest could take it over through /proc/1/mem. Ours is non-dumpable before
  the command exists, forks it, and exits with its status; the kernel kills
  what the command left behind before bwrap's outer process (the
  *monitor*) sees the init go. A command counts as finished only once the
  init's pidfd says it is gone; pid 1 of a pid namespace exits only after
  every other process in it.
* bwrap does not forward signals. A signal for the command goes to the init's
  first child (the command) directly; SIGKILL goes to the init, which takes
  the whole pid namespace with it.
* The arguments travel in a memfd (``--args``), so the caller's environment
  never shows in a host process list.

bwrap reports a command killed by signal N as exit status 128+N, so this
driver reports exit statuses 129-192 as that signal; a command that itself
exits with such a status is indistinguishable from one killed by it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import trio

from . import _ffi
from ._cgroup import SessionCgroup
from ._confinement import ResourceLimits
from ._driver import (
    GUEST_INIT,
    HOLDER_PATH,
    ExitStatus,
    GatewayEndpoint,
    Mount,
    OverlayUnavailable,
    StartPlan,
    received_fds,
)
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._files import HostWorkspaceIO, WorkspaceFiles
from ._hostids import guest_host_ids
from ._lease import ProcessId
from ._network import GATEWAY_SOCKET_NAME, GUEST_GATEWAY_DIR, GUEST_SOCKET, PROXY_PORT, NetworkPolicy
from ._paths import WORKSPACE
from ._pump import CommandPipes, OutputCollector, OutputSink

RUNTIME_DIRS = ("usr", "bin", "sbin", "lib", "lib64")
HOST_ETC = ("/etc/alternatives", "/etc/ssl/certs", "/etc/ld.so.cache")
# What the session makes at the top of an image's root itself.
IMAGE_ROOT_OWN = frozenset({"etc", "proc", "dev", "tmp", "run", WORKSPACE.lstrip("/")})
# The most entries of an image's top and /etc the bwrap driver mounts: each
# is a mount and three arguments for every command, whose cost grows with
# their square (about 40 ms a command at 100 entries on the 2-core machine).
MAX_IMAGE_ENTRIES = 400
MAX_SIGNAL = 64
# Starting a session runs one command to see that bwrap works here.
PROBE_TIMEOUT = 10.0


def private_root() -> Path:
    """Where this user's bwrap sessions keep their own files (a synthesized
    /etc; a root host's mount points). In the temporary directory, not the
    state directory: a root host's bwrap runs as the guest's ids, which
    must reach it, and root's home is closed to them."""
    return Path(tempfile.gettempdir()) / f"sandboxns-bwrap-{os.getuid()}"


def _make_private_directory() -> Path:
    """A new private directory for a session, named after this process
    (pid and start time, which never name two processes). Those of
    processes that have died (killed before they could remove theirs) are
    removed first."""
    root = private_root()
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o711)
    # A shared temporary directory: the name may have been taken by
    # someone else first, or be a link.
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE, f"{root} is not a directory that only this user can write; remove it"
        )
    for entry in root.iterdir():
        pid, _, start = entry.name.partition("-")[0].partition(".")
        if pid.isdigit() and start.isdigit() and not ProcessId(int(pid), int(start)).alive():
            shutil.rmtree(entry, ignore_errors=True)
    us = ProcessId.of(os.getpid())
    return Path(tempfile.mkdtemp(prefix=f"{us.pid}.{us.start}-", dir=root))


def find_bwrap() -> str | None:
    return shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


_feature_cache: dict[str, bool] = {}


def _supports(bwrap: str, option: str) -> bool:
    """Whether this bwrap knows ``option`` (``--disable-userns`` came in 0.8)."""
    key = f"{bwrap} {option}"
    if key not in _feature_cache:
        result = subprocess.run([bwrap, "--help"], check=False, capture_output=True, text=True, timeout=10)
        _feature_cache[key] = option in result.stdout
    return _feature_cache[key]


def _etc_files(uid: int, gid: int, share_network: bool) -> dict[str, str]:
    """The synthesized /etc, the same the native holder writes."""
    if uid == 0:
        passwd = f"root:x:0:{gid}:root:/workspace:/bin/sh\n"
    else:
        passwd = f"root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{gid}:sandbox:/workspace:/bin/sh\n"
    group = "root:x:0:\n" if gid == 0 else f"root:x:0:\nsandbox:x:{gid}:\n"
    files = {
        "passwd": passwd,
        "group": group,
        "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n",
        "hostname": "sandbox",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    }
    if share_network:
        with contextlib.suppress(OSError):
            files["resolv.conf"] = Path("/etc/resolv.conf").read_text()
    return files


def _host_root() -> list[str]:
    """The guest's root from the host's runtime trees, read-only."""
    plan = []
    for name in RUNTIME_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            plan += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            plan += ["--ro-bind", path, path]
    plan += ["--perms", "0755", "--dir", "/etc"]  # bwrap would make it 0700
    for path in HOST_ETC:
        plan += ["--ro-bind-try", path, path]
    return plan


# An entry of an image's top or /etc: its name, and a link's target (None
# for a directory or a regular file, which are bound).
_Entry = tuple[str, str | None]


def _list_image(root: Path) -> tuple[list[_Entry], list[_Entry]]:
    """The entries at an image's top and in its /etc (none if that is no
    directory: a link or a file there is hidden by the session's /etc, as
    with the native driver), once per session: bwrap 0.8 has no overlay,
    so each is a mount of every command. More than MAX_IMAGE_ENTRIES is
    SANDBOX_LIMIT (the native driver's one overlay has no such bound)."""
    top = _entries_of(root, IMAGE_ROOT_OWN)
    etc = root / "etc"
    listed = (top, _entries_of(etc, frozenset()) if etc.is_dir() and not etc.is_symlink() else [])
    count = sum(map(len, listed))
    if count > MAX_IMAGE_ENTRIES:
        raise SandboxError(
            ErrorCode.SANDBOX_LIMIT,
            f"the image has {count} entries at its top and in its /etc; the bwrap driver mounts each for every "
            f"command and takes at most {MAX_IMAGE_ENTRIES} (the native driver mounts an image whole)",
        )
    return listed


def _entries_of(directory: Path, own: frozenset[str]) -> list[_Entry]:
    entries = []
    for name in sorted(os.listdir(directory)):
        mode = os.lstat(directory / name).st_mode
        if name in own:
            continue
        if stat.S_ISLNK(mode):
            entries.append((name, os.readlink(directory / name)))
        elif stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            entries.append((name, None))
    return entries


def _image_root(listed: tuple[list[_Entry], list[_Entry]], source: Path, etc_files: Iterable[str]) -> list[str]:
    """The guest's root from an image's tree, listed by _list_image (bwrap
    finds it at ``source``): each entry at its top and in its /etc but
    those the session makes itself, bound read-only or made again as a
    link."""
    top, etc = listed
    own_etc = frozenset(etc_files)
    plan = []
    for guest, entries in (("/", top), ("/etc/", [entry for entry in etc if entry[0] not in own_etc])):
        if guest == "/etc/":
            plan += ["--perms", "0755", "--dir", "/etc"]
        for name, link in entries:
            if link is None:
                plan += ["--ro-bind", str(source / guest.lstrip("/") / name), guest + name]
            else:
                plan += ["--symlink", link, guest + name]
    return plan


def _plan(
    bwrap: str,
    root: list[str],
    workspace: Path,
    etc_dir: Path,
    ids: tuple[int, int],
    share_network: bool,
    gateway_dir: Path | None,
    mounts: tuple[Mount, ...],
    tmp_size: int,
    userns_fd: int | None,
) -> list[str]:
    """The per-session part of every command's bwrap arguments, ``root``
    the guest's system trees (_host_root or _image_root). With
    ``userns_fd`` (a root host's, see _RootHostNamespaces) bwrap enters that
    user namespace, which already forbids nesting, instead of making one."""
    if userns_fd is None:
        plan = ["--unshare-all", "--unshare-user"]
        if _supports(bwrap, "--disable-userns"):
            plan.append("--disable-userns")
        if share_network:
            plan.append("--share-net")
    else:
        plan = ["--userns", str(userns_fd), "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if not share_network:
            plan.append("--unshare-net")
    uid, gid = ids
    plan += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--uid", str(uid), "--gid", str(gid)]
    plan += ["--hostname", "sandbox", "--clearenv", *root]
    for name in sorted(os.listdir(etc_dir)):
        plan += ["--ro-bind", str(etc_dir / name), f"/etc/{name}"]
    plan += [
        "--bind", str(workspace), WORKSPACE,
        "--proc", "/proc",
        # bwrap covers /proc/sys only when the directory itself is writable;
        # the sysctls of the guest's own namespaces inside it are.
        "--ro-bind", "/proc/sys", "/proc/sys",
        "--dev", "/dev",
        "--perms", "1777", "--size", str(_ffi.SHM_BYTES), "--tmpfs", "/dev/shm",
        "--perms", "1777", "--size", str(tmp_size), "--tmpfs", "/tmp",
        "--dir", "/run",
        # pid 1 inside, instead of bwrap's reaper (see csrc/bwrap_init.c):
        # out of the guest's reach; it sets the command's rlimits and
        # starts it.
        "--as-pid-1", "--ro-bind", str(HOLDER_PATH), GUEST_INIT,
        "--remount-ro", "/dev",  # bwrap's /dev is a tmpfs the guest could write to
    ]  # fmt: skip
    for mount in mounts:
        plan += ["--bind" if mount.writable else "--ro-bind", str(mount.host), mount.guest]
    if gateway_dir is not None:
        plan += ["--ro-bind", str(gateway_dir), GUEST_GATEWAY_DIR]
        plan += ["--symlink", f"{GUEST_GATEWAY_DIR.removeprefix('/run/')}/{GATEWAY_SOCKET_NAME}", GUEST_SOCKET]
    return plan + ["--remount-ro", "/"]


class _RootHostNamespaces:
    """What a root host prepares so that its guests run as the unprivileged
    host user ``host_ids`` (see sandboxns._hostids and csrc/idmap.c): a user
    namespace mapping the guest's ids there, owned by that user, for bwrap
    to enter, and a mount namespace, for bwrap to start in, where the
    workspace and extra mounts show their owner's files as the guest's.
    bwrap itself then runs as that user, unprivileged, like any user's."""

    def __init__(
        self,
        workspace: Path,
        mounts: tuple[Mount, ...],
        guest: tuple[int, int],
        host_ids: tuple[int, int],
        private: Path,
        image_root: Path | None,
    ) -> None:
        self.guest_ids = host_ids
        owner = workspace.stat()
        self.owner_ids = (owner.st_uid, owner.st_gid)
        # bwrap resolves its bind sources as the guest's host user, who may
        # not pass through the directories above them: they are attached
        # under the session's private directory instead, in the namespace.
        # So is an image's root, which lies in the state directory.
        targets = [private / "workspace", *(private / f"mount-{index}" for index in range(len(mounts)))]
        sources = [workspace, *(Path(mount.host) for mount in mounts)]
        read_only = [False, *(not mount.writable for mount in mounts)]
        if image_root is not None:
            targets.append(private / "image")
            sources.append(image_root)
            read_only.append(True)
        for target, source in zip(targets, sources, strict=True):
            if source.is_dir():
                target.mkdir()
            else:
                target.touch()
        mount_targets = targets[1 : 1 + len(mounts)]
        self.sources = (targets[0], tuple(replace(m, host=str(t)) for m, t in zip(mounts, mount_targets, strict=True)))
        self.image_root = None if image_root is None else targets[-1]
        # Each tree's owner's files are the guest's: the workspace's owner
        # for it and the mounts, the importer for an image's (as on a host
        # that is not root, where both are the one user sandboxns runs as).
        owners = [(owner.st_uid, owner.st_gid)] * len(sources)
        if image_root is not None:
            image_owner = image_root.stat()
            owners[-1] = (image_owner.st_uid, image_owner.st_gid)
        idmaps: dict[tuple[int, int], int] = {}
        try:
            self.userns = _ffi.make_userns(
                f"{guest[0]} {host_ids[0]} 1\n", f"{guest[1]} {host_ids[1]} 1\n", owner=host_ids
            )
            for uid, gid in set(owners):
                idmaps[uid, gid] = _ffi.make_userns(f"{uid} {host_ids[0]} 1\n", f"{gid} {host_ids[1]} 1\n")
            self.mount_ns = _ffi.idmapped_mount_ns(
                [str(source) for source in sources],
                [str(target) for target in targets],
                read_only,
                [idmaps[tree_owner] for tree_owner in owners],
            )
        except OSError as exc:
            if hasattr(self, "userns"):
                os.close(self.userns)
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, str(exc)) from None
        finally:
            for idmap in idmaps.values():
                os.close(idmap)

    def close(self) -> None:
        os.close(self.userns)
        os.close(self.mount_ns)


def _error_from_message(message: str) -> SandboxError:
    """Turn bwrap's complaint about a command it could not start into the
    error the native driver gives for the same failure."""
    text = message.strip() or "bwrap exited without starting the command"
    detail = f"bwrap could not start the command: {text}"
    if "execvp" in text or "chdir" in text:
        if text.endswith((os.strerror(errno.ENOENT), os.strerror(errno.ENOTDIR))):
            return SandboxError(ErrorCode.SANDBOX_NOT_FOUND, detail)
        if text.endswith((os.strerror(errno.EACCES), os.strerror(errno.ENOEXEC))):
            return SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, detail)
    return SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, detail)


def _status_from_exit_code(code: int) -> ExitStatus:
    if 128 < code <= 128 + MAX_SIGNAL:
        return ExitStatus(exit_code=None, signal=code - 128)
    return ExitStatus(exit_code=code, signal=None)


class _Monitor:
    """bwrap's outer process, started from trio's own thread (see spawn) and
    waited for through a pidfd."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.pidfd = os.pidfd_open(popen.pid)
        self.returncode: int | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            await trio.lowlevel.wait_readable(self.pidfd)
            self.returncode = self.popen.wait()
        return self.returncode

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class BwrapProcess:
    """One command: a bwrap monitor, its init, and the command under it."""

    def __init__(
        self, driver: BwrapDriver, monitor: _Monitor, status: int, exec_report: int, pipes: CommandPipes
    ) -> None:
        self._driver = driver
        self._monitor = monitor
        self._status = trio.lowlevel.FdStream(status)
        # Where `sandboxns-holder --init` says why it could not start the
        # command; its end closes (empty) when the command is exec'd.
        self._exec_report = exec_report
        self._status_lock = trio.Lock()
        self._status_text = b""
        self._status_done = False
        self._pipes = pipes
        self._init: ProcessId | None = None
        self._init_pidfd: int | None = None
        self._command: ProcessId | None = None
        self._exit_code: int | None = None
        self._gone_lock = trio.Lock()
        self._gone = False
        self._killed_by: int | None = None
        self._stopped = False
        self._result: ExitStatus | None = None
        self.tracked: list[ProcessId | None] = [ProcessId.of(monitor.pid)]
        # Serving the proxy in the command's network namespace, if any.
        self.proxy: trio.CancelScope | None = None

    async def _read_status(self, until_init: bool = False) -> None:
        """Read bwrap's JSON status records: all of them, or until the init's
        pid is known (bwrap writes it right after cloning the init, before
        letting it run)."""
        async with self._status_lock:
            while not self._status_done and not (until_init and self._init is not None):
                chunk = await self._status.receive_some(4096)
                if not chunk:
                    self._status_done = True
                self._status_text += chunk
                while b"\n" in self._status_text:
                    line, self._status_text = self._status_text.split(b"\n", 1)
                    self._record(json.loads(line))

    def _record(self, record: dict) -> None:
        if "child-pid" in record:
            self._init_pidfd = _open_init(record["child-pid"], record.get("pid-namespace"))
            if self._init_pidfd is not None:
                self._init = ProcessId.of(record["child-pid"])
                self.tracked.append(self._init)
                self._driver._track()
        elif "exit-code" in record:
            self._exit_code = record["exit-code"]

    def _command_pid(self) -> int | None:
        """The command: the init's first child, once it has forked it."""
        if self._command is None and self._init is not None and self._init.alive():
            pid = self._init.pid
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/task/{pid}/children") as f:
                self._command = ProcessId.of(int(f.read().split()[0]))
        if self._command is None or not self._command.alive():
            return None
        return self._command.pid

    async def _wait_gone(self) -> None:
        """Return once the monitor, the init and so everything under them
        are gone. Safe to call from several tasks, and again after a
        cancellation."""
        async with self._gone_lock:
            if self._gone:
                return
            await self._monitor.wait()
            await self._read_status()
            if self._init_pidfd is not None:
                # The monitor is gone, so the command is: whatever it left
                # goes too. bwrap's init would otherwise wait for them all,
                # and its die-with-parent does not survive the uid change
                # bwrap makes inside a given user namespace (a root host's).
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
                await trio.lowlevel.wait_readable(self._init_pidfd)
                # Orphaned when the monitor exited; if that made it our
                # child (we are a subreaper), reap it.
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitid(os.P_PIDFD, self._init_pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - WNOHANG
            self._gone = True

    async def wait(self) -> ExitStatus:
        if self._result is not None:
            return self._result
        # The monitor exits after the init, and so after everything in the
        # command's pid namespace: until then its output must keep moving.
        while not self._gone and self._monitor.returncode is None:
            await self._pipes.until_readable(self._monitor.pidfd)
            if not self._pipes.take_kill_request():
                break
            await self.send_signal(signal.SIGKILL)
        await self._wait_gone()
        self._pipes.finish()
        if self._stopped:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the session stopped while the command was running")
        # Everything is gone, so every writer of the report is too.
        exec_failure = os.read(self._exec_report, 4096)
        if exec_failure:
            raise _error_from_message(exec_failure.decode("utf-8", "replace"))
        if self._exit_code is not None:
            self._result = _status_from_exit_code(self._exit_code)
        elif self._killed_by is not None:
            self._result = ExitStatus(exit_code=None, signal=self._killed_by)
        elif self._monitor.returncode is not None and self._monitor.returncode < 0:
            # Something outside killed bwrap itself; stderr may be the
            # command's, so it says nothing about why.
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"bwrap was killed by signal {-self._monitor.returncode}")
        else:
            # Never exec'd: all of stderr is bwrap's own message.
            raise _error_from_message(self._pipes.stderr_head.decode("utf-8", "replace"))
        return self._result

    async def send_signal(self, signum: int) -> None:
        if self._gone or self._monitor.returncode is not None:
            return
        await self._read_status(until_init=True)
        pid = self._command_pid() if signum != signal.SIGKILL else None
        if pid is None:
            # SIGKILL, or a signal for a command bwrap has not started yet
            # (so nothing could handle it): kill the init, pid 1 of the
            # command's pid namespace, which takes everything in it along;
            # then the monitor.
            self._killed_by = signum
            if self._init_pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            self._monitor.kill()
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            pidfd = os.pidfd_open(pid)
            try:
                signal.pidfd_send_signal(pidfd, signum)
            finally:
                os.close(pidfd)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            try:
                if not self._gone:
                    await self.send_signal(signal.SIGKILL)
                    await self._wait_gone()
            finally:
                if self.proxy is not None:
                    self.proxy.cancel()
                if self._init_pidfd is not None:
                    os.close(self._init_pidfd)
                    self._init_pidfd = None
                self._monitor.close()
                await self._status.aclose()
                if self._exec_report >= 0:
                    os.close(self._exec_report)
                    self._exec_report = -1
                self._pipes.close()
                self._driver._forget(self)


async def _proxy_listeners(channel: socket.socket) -> list[socket.socket]:
    """The listeners a command's init sends on ``channel`` (none if it
    ended first, failing: its report says why)."""
    with trio.socket.from_stdlib_socket(channel) as receiver:
        _, ancillary, _, _ = await receiver.recvmsg(1, socket.CMSG_SPACE(4 * 2), socket.MSG_CMSG_CLOEXEC)
    return [socket.socket(fileno=fd) for fd in received_fds(ancillary)]


def _open_init(pid: int, pid_namespace: object) -> int | None:
    """A pidfd for bwrap's init, checked to be that process: pid 1 of the
    pid namespace bwrap reported. None if it is already gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        same = os.stat(f"/proc/{pid}/ns/pid").st_ino == pid_namespace
        signal.pidfd_send_signal(pidfd, 0)  # still the process we checked
    except OSError:
        same = False
    if not same:
        os.close(pidfd)
        return None
    return pidfd


class BwrapDriver(HostWorkspaceIO):
    """A sandbox session made of bwrap invocations, one per command."""

    name = "bwrap"
    supports_overlay = False

    def __init__(self) -> None:
        raise TypeError("use 'await BwrapDriver.start(...)'")

    @classmethod
    async def start(cls, plan: StartPlan) -> BwrapDriver:
        """Start a session as ``plan`` says (see :class:`StartPlan`); an
        overlay workspace is OverlayUnavailable."""
        if not isinstance(plan, StartPlan):
            raise invalid_argument(f"start takes a sandboxns.StartPlan, not {plan!r}")
        if plan.overlay is not None:
            raise OverlayUnavailable("the bwrap driver does not mount template overlays")
        root = plan.image_root
        listed = None if root is None else await trio.to_thread.run_sync(_list_image, root)
        bwrap = find_bwrap()
        if bwrap is None:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                "the bwrap driver needs bubblewrap, which is not installed (apt-get install bubblewrap)",
            )
        self = object.__new__(cls)
        self.workspace = plan.workspace
        self._bwrap = bwrap
        self._ids = (plan.uid, plan.gid)
        self._mounts = plan.mounts
        self.confinement = plan.confinement
        self._seccomp_program = plan.confinement.seccomp.program()
        self._default_rlimits = plan.confinement.limits.init_argument()
        self._lease = plan.lease
        self._processes: set[BwrapProcess] = set()
        self._closed = False
        self._stopped = trio.Event()
        # The session's own files: a synthesized /etc and, for a root host,
        # where bwrap finds the workspace and mounts (see _RootHostNamespaces).
        self._private = _make_private_directory()
        self._etc = self._private / "etc"
        self._sources = (self.workspace, plan.mounts)
        # An image's root: its listing, and where bwrap finds it.
        self._image_root = (listed, root)
        self._cgroup = None
        self._root_host = None
        # Each bwrap starts through `sandboxns-holder --enter` (this command
        # line's start) with these fds when the session has a cgroup or a
        # root host.
        self._enter: list[str] = []
        self._enter_fds: list[int] = []
        try:
            if plan.confinement.cgroup is not None:
                self._cgroup = SessionCgroup.create(plan.confinement.cgroup)
                self._enter.append(f"--cgroup-procs={self._cgroup.procs_fd}")
                self._enter_fds.append(self._cgroup.procs_fd)
            self._private.chmod(0o755)
            self._etc.mkdir(mode=0o755)
            host_ids = guest_host_ids()
            if host_ids is not None:
                self._root_host = _RootHostNamespaces(
                    self.workspace, plan.mounts, self._ids, host_ids, self._private, root
                )
                self._sources = self._root_host.sources
                self._image_root = (listed, self._root_host.image_root)
                # Host-side file operations act as the workspace's owner, so
                # what they create is the guest's too.
                self._fs_ids = self._root_host.owner_ids
                self._enter += [f"--mount-ns={self._root_host.mount_ns}", "--user={}:{}".format(*host_ids)]
                self._enter_fds += [self._root_host.mount_ns, self._root_host.userns]
            if self._enter:
                self._enter = [str(HOLDER_PATH), "--enter", *self._enter, "--"]
            self._configure(plan.network, plan.gateway)
            self._files = WorkspaceFiles.of_directory(self.workspace)
        except BaseException:
            self._release()
            raise
        # Fail now, like the native driver, if bwrap cannot make a sandbox here.
        try:
            await self._probe()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _probe(self) -> None:
        """Run the init's own program, which every guest has whatever its
        root, and want it to succeed: any failure says this host cannot make
        bwrap sandboxes (SANDBOX_UNAVAILABLE)."""
        output = OutputCollector(limit=4096)  # what it says, if it fails
        try:
            status = await self._run_probe(output)
        except SandboxError as exc:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, exc.message) from None
        except OSError as exc:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"cannot start bwrap's test command: {exc}") from None
        if status is None:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"bwrap's test command took over {PROBE_TIMEOUT} s")
        if status.exit_code != 0:
            how = f"exit {status.exit_code}" if status.signal is None else f"signal {status.signal}"
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"bwrap's test command failed ({how}): {output.output('stderr').decode(errors='replace').strip()}",
            )

    async def _run_probe(self, output: OutputCollector) -> ExitStatus | None:
        """The probe's status, or None if it ran out of time (then it is
        killed); its whole tree is gone either way."""
        process = await self.spawn([GUEST_INIT, "--version"], env={}, cwd=WORKSPACE, output=output)
        status = None
        try:
            with trio.move_on_after(PROBE_TIMEOUT):
                status = await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                if status is None:
                    with contextlib.suppress(SandboxError):
                        await process.send_signal(signal.SIGKILL)
                        await process.wait()
                await process.aclose()
        return status

    def _release(self) -> None:
        """Give back what the session holds besides its processes."""
        shutil.rmtree(self._private, ignore_errors=True)
        if self._cgroup is not None:
            self._cgroup.close()
        if self._root_host is not None:
            self._root_host.close()

    def _configure(self, policy: NetworkPolicy, gateway: GatewayEndpoint | None) -> None:
        """Write the synthesized /etc and the plan for this network."""
        gateway_dir = None if gateway is None else gateway.directory
        uid, gid = self._ids
        files = _etc_files(uid, gid, policy.shares_host_network)
        for stale in set(os.listdir(self._etc)) - set(files):
            (self._etc / stale).unlink()
        for name, content in files.items():
            (self._etc / name).write_text(content)
            (self._etc / name).chmod(0o644)
        workspace, mounts = self._sources
        listed, source = self._image_root
        self._plan = _plan(
            self._bwrap,
            _host_root() if listed is None else _image_root(listed, source, files),
            workspace,
            self._etc,
            self._ids,
            policy.shares_host_network,
            gateway_dir,
            mounts,
            self.confinement.tmp_size,
            None if self._root_host is None else self._root_host.userns,
        )
        if gateway is not None and self._root_host is not None:
            # bwrap reaches bind sources as the guest's host user, and the
            # gateway's socket is its owner's alone (0600): that owner must
            # be the guest's user, and its directory open to the guest (it
            # holds nothing secret: the socket, a CA's public certificate).
            os.chown(gateway.socket_path, *self._root_host.guest_ids)
            gateway.directory.chmod(0o755)
        self.network = policy
        self._gateway = gateway

    async def set_network(self, policy: NetworkPolicy, gateway: GatewayEndpoint | None) -> None:
        """Every command is its own bwrap, so the next one simply gets the
        new plan."""
        self.check_usable()
        self._configure(policy, gateway)

    def _track(self) -> None:
        # Once closed, nothing runs any more and the lease is its owner's again.
        if self._lease is not None and not self._closed:
            self._lease.track(p for process in self._processes for p in process.tracked)

    def _forget(self, process: BwrapProcess) -> None:
        if process in self._processes:
            self._processes.discard(process)
            self._track()

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        output: OutputSink,
        stdin: int | bytes | None = None,
        limits: ResourceLimits | None = None,
    ) -> BwrapProcess:
        self.check_usable()
        rlimits = self._default_rlimits if limits is None else limits.init_argument()
        arguments = [*self._plan, "--chdir", cwd]
        for key, value in env.items():
            arguments += ["--setenv", key, value]
        with contextlib.ExitStack() as cleanup:
            # bwrap installs the seccomp program (read from this fd) right
            # before it execs the command, like the native driver.
            seccomp_fd = os.memfd_create("sandboxns-seccomp", os.MFD_CLOEXEC)
            cleanup.callback(os.close, seccomp_fd)
            os.write(seccomp_fd, self._seccomp_program)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            arguments += ["--seccomp", str(seccomp_fd)]
            args_fd = os.memfd_create("sandboxns-bwrap-args", os.MFD_CLOEXEC)
            cleanup.callback(os.close, args_fd)
            os.write(args_fd, b"".join(os.fsencode(arg) + b"\0" for arg in arguments))
            os.lseek(args_fd, 0, os.SEEK_SET)
            status_read, status_write = os.pipe2(os.O_CLOEXEC)
            cleanup.callback(os.close, status_write)
            exec_read, exec_write = os.pipe2(os.O_CLOEXEC)
            cleanup.callback(os.close, exec_write)
            on_failure = cleanup.enter_context(contextlib.ExitStack())
            on_failure.callback(os.close, status_read)
            on_failure.callback(os.close, exec_read)
            pipes = CommandPipes(output, stdin)
            on_failure.callback(pipes.close)
            cleanup.callback(pipes.close_child_ends)
            stdin_fd, stdout_fd, stderr_fd = pipes.child_fds
            # Each command has a network namespace of its own: its init
            # listens there for the gateway's proxy, and sends the listeners
            # back on this socket pair (see csrc/bwrap_init.c).
            proxy, proxy_fds, proxy_end = "-", (), None
            if self._gateway is not None:
                proxy_end, init_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                on_failure.callback(proxy_end.close)
                cleanup.callback(init_end.close)
                proxy, proxy_fds = f"{PROXY_PORT}:{init_end.fileno()}", (init_end.fileno(),)
            try:
                # Popen from trio's own thread, not a worker: bwrap's
                # --die-with-parent fires when the *thread* that started it
                # ends, and idle worker threads end after seconds.
                popen = subprocess.Popen(  # noqa: ASYNC220 - on purpose, see above
                    [*self._enter, self._bwrap, "--args", str(args_fd), "--json-status-fd", str(status_write), "--"]
                    + [GUEST_INIT, "--init", str(exec_write), rlimits, proxy, "--", *argv],
                    stdin=subprocess.DEVNULL if stdin_fd is None else stdin_fd,
                    stdout=stdout_fd,
                    stderr=stderr_fd,
                    pass_fds=(args_fd, status_write, seccomp_fd, exec_write, *proxy_fds, *self._enter_fds),
                    env={},
                )
            except OSError as exc:
                raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"cannot run {self._bwrap}: {exc}") from None
            on_failure.pop_all()
        process = BwrapProcess(self, _Monitor(popen), status_read, exec_read, pipes)
        self._processes.add(process)
        self._track()
        try:
            # Know the init before anyone can want to signal it.
            await process._read_status(until_init=True)
            if proxy_end is not None:
                process.proxy = self._gateway.serve_proxy(await _proxy_listeners(proxy_end))
        except BaseException:
            if proxy_end is not None:
                proxy_end.close()
            await process.aclose()
            raise
        return process

    async def aclose(self) -> None:
        """Kill every running command; returns once all are gone."""
        if self._closed:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            running = list(self._processes)
            if self._cgroup is not None:
                self._cgroup.kill()
            for process in running:
                process._stopped = True
                await process.send_signal(signal.SIGKILL)
            # Their owners close them; here only wait until they are gone.
            for process in running:
                await process._wait_gone()
            await self._close_files()
            self._release()
            self._stopped.set()
