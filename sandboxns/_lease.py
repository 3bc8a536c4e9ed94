"""Exclusive session leases: an flock on ``sessions/<id>/lease``.

The kernel drops an flock when the last descriptor of its open file goes away,
so a crashed owner never leaves a lock behind. Its session's processes may
outlive it by a moment, though, so the lease file also records them: the
owner, and the processes whose exit proves that nothing of the session is left
(the native driver's holder launcher and holder; the bwrap driver's monitor
and init of each running command). Each is recorded as pid + start time, so a
reused pid is never mistaken for the original. The native launcher also
shares the lock itself and exits only after the whole session is reaped.

When the lock is

* held by a live owner: a second attach is refused (SANDBOX_BUSY);
* held, or free, while recorded processes still run: the owner died and its
  session is being torn down; wait a moment for that;
* still not free of processes after that: safety cannot be proven, so the
  attach is refused, pointing at the operator commands (``sandboxns lease
  list|clear``).

An operator's ``clear --force`` kills what remains and replaces the lease
file, so a still-running former owner loses its claim (see ``is_current``).

The lease file's modification time is the last time its owner was known to
be alive: the owner writes the file when it attaches and when it stops (its
release), and a running backend stamps it again now and then (``refresh``).
For a stopped session that is when it stopped; for one whose owner died, at
most one stamp's interval before the death. A stopped session's retention
counts from it (see ``unowned``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trio

from ._errors import ErrorCode, SandboxError

LEASE_NAME = "lease"
# How long an attach waits for a dead owner's session to finish tearing down.
TEARDOWN_WAIT = 5.0


@dataclass(frozen=True)
class ProcessId:
    """A process as the host sees it: pid plus start time (in clock ticks
    since boot), which together never name two different processes."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        start = _start_time(pid)
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def as_json(self) -> dict:
        return {"pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, value: object) -> ProcessId | None:
        if isinstance(value, dict) and isinstance(value.get("pid"), int) and isinstance(value.get("start"), int):
            return cls(value["pid"], value["start"])
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; the
    # fields after its closing parenthesis are plain: the state is field 3,
    # starttime field 22.
    fields = stat[stat.rindex(b")") + 2 :].split()
    # A zombie (exited, not yet reaped by whoever inherited it) holds
    # nothing of the session any more, as its pidfd says (see _wait_gone).
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class LeaseRecord:
    owner: ProcessId | None = None
    processes: tuple[ProcessId, ...] = ()

    def as_json(self) -> dict:
        value: dict = {"processes": [process.as_json() for process in self.processes]}
        if self.owner is not None:
            value["owner"] = self.owner.as_json()
        return value

    @classmethod
    def parse(cls, data: bytes) -> LeaseRecord:
        try:
            value = json.loads(data or b"{}")
        except ValueError:
            return cls()
        if not isinstance(value, dict):
            return cls()
        processes = value.get("processes")
        listed = [ProcessId.from_json(item) for item in processes] if isinstance(processes, list) else []
        return cls(ProcessId.from_json(value.get("owner")), tuple(p for p in listed if p is not None))

    def remaining(self) -> list[ProcessId]:
        return [process for process in self.processes if process.alive()]


def _read_record(fd: int) -> LeaseRecord:
    return LeaseRecord.parse(os.pread(fd, 65536, 0))


def read_record(path: Path) -> LeaseRecord:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return LeaseRecord()
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def _unusable(path: Path, problem: str) -> SandboxError:
    return SandboxError(
        ErrorCode.SANDBOX_STATE_MISMATCH,
        f"the lease of session {path.parent.name} is not usable ({problem}); once nothing of the session runs,"
        f" remove {path}",
    )


def _try_lock(path: Path) -> int | None:
    """An fd of the lease file holding its lock, or None if it is held. The
    fd is checked to still be the file at ``path`` (an operator may have
    replaced it)."""
    while True:
        try:
            # A symlink in the lease's place is refused, not followed: the
            # lease is truncated and rewritten, which would happen to
            # whatever it points at. O_NONBLOCK: nor is a FIFO waited on.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the session directory itself is gone
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"session {path.parent.name} does not exist") from None
        except OSError as exc:
            raise _unusable(path, exc.strerror) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _unusable(path, "it is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)  # replaced under us: lock the new file instead


async def _wait_gone(process: ProcessId, deadline: float) -> bool:
    """Wait until ``deadline`` (trio time) for a process to exit; True once
    it has."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return True
    try:
        if not process.alive():  # the pid was reused after all
            return True
        with trio.move_on_at(deadline):
            await trio.lowlevel.wait_readable(pidfd)
            return True
        return False
    finally:
        os.close(pidfd)


async def wait_all_gone(processes: Iterable[ProcessId], timeout: float) -> list[ProcessId]:
    """Wait up to ``timeout`` for all of ``processes`` to exit; returns those
    still running."""
    deadline = trio.current_time() + timeout
    return [process for process in processes if not await _wait_gone(process, deadline)]


def operator_hint(state_directory: Path, session_id: str) -> str:
    return (
        f"inspect it with 'sandboxns lease list --state-dir {state_directory}' and, once you know it is safe,"
        f" 'sandboxns lease clear --state-dir {state_directory} {session_id}'"
    )


class Lease:
    """A held lease. ``release`` (or the owner's death) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    async def acquire(cls, session_dir: Path, state_directory: Path) -> Lease:
        path = session_dir / LEASE_NAME
        session_id = session_dir.name
        fd = _try_lock(path)
        if fd is None:
            record = read_record(path)
            if record.owner is not None and record.owner.alive():
                who = "this process" if record.owner.pid == os.getpid() else f"process {record.owner.pid}"
                raise SandboxError(ErrorCode.SANDBOX_BUSY, f"session {session_id} is in use by {who}")
            # The owner is gone but its session is still being torn down.
            await wait_all_gone(record.processes, TEARDOWN_WAIT)
            fd = _try_lock(path)
            if fd is None:
                raise SandboxError(
                    ErrorCode.SANDBOX_BUSY,
                    f"session {session_id} is locked by a process that is not its recorded owner; "
                    + operator_hint(state_directory, session_id),
                )
        try:
            remaining = await wait_all_gone(_read_record(fd).processes, TEARDOWN_WAIT)
            if remaining:
                raise SandboxError(
                    ErrorCode.SANDBOX_BUSY,
                    f"session {session_id} still has processes ({_pids(remaining)}) although nobody holds its "
                    "lease; " + operator_hint(state_directory, session_id),
                )
            lease = cls(path, fd)
            lease.track(())
            return lease
        except BaseException:
            os.close(fd)
            raise

    def track(self, processes: Iterable[ProcessId | None]) -> None:
        """Record the processes whose exit proves the session is gone (see
        the module docstring; None, a process already gone, is skipped); the
        owner is this process."""
        self.record(LeaseRecord(ProcessId.of(os.getpid()), tuple(p for p in processes if p is not None)))

    def record(self, record: LeaseRecord) -> None:
        data = json.dumps(record.as_json()).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def is_current(self) -> bool:
        """Whether this lease is still the session's (an operator's forced
        clear replaces the file) and not released."""
        if self.fd < 0:
            return False
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(self.fd)
        return (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino)

    def refresh(self) -> None:
        """Stamp the lease file: proof that its owner is alive now (see the
        module docstring)."""
        if self.is_current():
            os.utime(self.fd)

    def release(self) -> None:
        """Unlock. Recorded processes that are somehow still alive (a guest
        stuck in uninterruptible sleep outlasting a stop) stay in the
        record, so the next attach waits for them or refuses."""
        if self.fd >= 0:
            if self.is_current():
                with contextlib.suppress(OSError):
                    self.record(LeaseRecord(None, tuple(_read_record(self.fd).remaining())))
            os.close(self.fd)
            self.fd = -1


def is_locked(session_dir: Path) -> bool:
    """Whether someone holds the session's lease right now."""
    fd = _try_lock(session_dir / LEASE_NAME)
    if fd is None:
        return True
    os.close(fd)
    return False


def last_written(session_dir: Path) -> float:
    """When the session's lease was last written (seconds since the epoch):
    its owner's last sign of life. Never locks it."""
    return os.stat(session_dir / LEASE_NAME).st_mtime


@contextlib.contextmanager
def unowned(session_dir: Path) -> Iterator[float | None]:
    """For the block, hold the lease of a stopped session: one nobody holds
    and none of whose recorded processes remain. Gives :func:`last_written`
    as it is under the lock, or None (and holds nothing) for a session in
    use or still being torn down."""
    fd = _try_lock(session_dir / LEASE_NAME)
    if fd is None:
        yield None
        return
    try:
        yield None if _read_record(fd).remaining() else os.fstat(fd).st_mtime
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LeaseStatus:
    session_id: str
    locked: bool
    record: LeaseRecord

    def describe(self) -> str:
        owner, remaining = self.record.owner, self.record.remaining()
        if self.locked:
            if owner is not None and owner.alive():
                return f"held by process {owner.pid}"
            return "held by a process that is not its recorded owner (tearing down?)"
        if remaining:
            return f"free, but processes remain ({_pids(remaining)})"
        return "free"


def _pids(processes: Iterable[ProcessId]) -> str:
    return "pid " + ", ".join(str(process.pid) for process in processes)


def lease_status(session_dir: Path) -> LeaseStatus:
    locked = is_locked(session_dir)
    return LeaseStatus(session_dir.name, locked, read_record(session_dir / LEASE_NAME))


def _kill(process: ProcessId | None) -> None:
    if process is None:
        return
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return
    try:
        if process.alive():
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


async def clear_lease(session_dir: Path, force: bool) -> str:
    """The operator's ``lease clear``: make the session attachable again.

    Refuses while any process of the session may remain or a live owner
    holds it, unless ``force``: then the session's processes are killed and
    the lease file replaced, so a live former owner loses its claim."""
    status = lease_status(session_dir)
    owner, remaining = status.record.owner, status.record.remaining()
    owner_alive = status.locked and owner is not None and owner.alive()
    if not force:
        if owner_alive:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"session {status.session_id} is held by live process {owner.pid}; "
                "use --force to kill its processes and take the lease away",
            )
        if remaining or status.locked:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"session {status.session_id} still has processes "
                f"({_pids(remaining) if remaining else 'unknown, the lease is locked'}); "
                "use --force to kill them first",
            )
    for process in remaining:
        _kill(process)
    await wait_all_gone(remaining, TEARDOWN_WAIT)
    # Replace the file while holding its lock where it is free, so nobody
    # can lock the old file in between and believe they hold the lease.
    # (Only --force gets here with the old file locked by someone else:
    # then whoever holds it loses the lease, which is the point.)
    path = session_dir / LEASE_NAME
    old = _try_lock(path)
    try:
        if old is not None and not force and _read_record(old).remaining():
            raise SandboxError(ErrorCode.SANDBOX_BUSY, f"session {status.session_id} has processes again")
        fresh = session_dir / f".{LEASE_NAME}-{secrets.token_hex(6)}"
        fresh.write_bytes(b"")
        fresh.chmod(0o600)
        owner_of_session = session_dir.stat()
        with contextlib.suppress(PermissionError):  # root clearing a user's session
            os.chown(fresh, owner_of_session.st_uid, owner_of_session.st_gid)
        os.rename(fresh, path)
    finally:
        if old is not None:
            os.close(old)
    if status.locked or remaining:
        return f"session {status.session_id}: killed {len(remaining)} process(es) and replaced the lease"
    return f"session {status.session_id}: the lease was already free; record reset"


def session_ids(state_directory: Path) -> list[str]:
    try:
        return sorted(
            entry.name
            for entry in os.scandir(state_directory / "sessions")
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith(".")
        )
    except FileNotFoundError:
        return []
