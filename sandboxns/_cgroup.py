"""A session's own cgroup v2, under a directory the host delegated to us.

cgroup v2 bounds what rlimits cannot: the memory of the whole session, its
processes wherever they run, and its share of the CPUs. The drivers start
every session process inside the session's cgroup (the holder joins it
before its execve; each bwrap through ``sandboxns-holder --enter``), so
nothing escapes it, and stopping a session writes ``cgroup.kill``, which
kills everything in it in one step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from ._errors import ErrorCode, SandboxError, invalid_argument

# cpu.max's period: the quota is CPUs x this many microseconds.
CPU_PERIOD_US = 100_000


def _unavailable(message: str) -> SandboxError:
    return SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, message)


@dataclass(frozen=True)
class CgroupLimits:
    """Put each session in a child cgroup of ``parent``, a cgroup v2
    directory delegated to this process (writable, with the controllers the
    limits need enabled or enableable there), with ``memory_max`` bytes
    (``memory.max``), ``pids_max`` processes (``pids.max``) and
    ``cpu_max`` CPUs (``cpu.max``, e.g. 1.5). ``None`` sets no limit."""

    parent: str
    memory_max: int | None = None
    pids_max: int | None = None
    cpu_max: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.parent, (str, os.PathLike)) or not os.path.isabs(self.parent):
            raise invalid_argument(f"cgroup parent must be an absolute path, not {self.parent!r}")
        object.__setattr__(self, "parent", os.fspath(self.parent))
        for name in ("memory_max", "pids_max"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise invalid_argument(f"{name} must be a positive integer or None, not {value!r}")
        cpus = self.cpu_max
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0.01 <= cpus):
            raise invalid_argument(f"cpu_max must be a number of CPUs of at least 0.01, not {cpus!r}")

    def settings(self) -> dict[str, str]:
        """The files to write in a session's cgroup, by controller file."""
        values = {}
        if self.memory_max is not None:
            values["memory.max"] = str(self.memory_max)
            values["memory.swap.max"] = "0"  # or the bound leaks into swap
        if self.pids_max is not None:
            values["pids.max"] = str(self.pids_max)
        if self.cpu_max is not None:
            values["cpu.max"] = f"{round(self.cpu_max * CPU_PERIOD_US)} {CPU_PERIOD_US}"
        return values

    def to_dict(self) -> dict[str, object]:
        return {
            "parent": self.parent,
            "memory_max": self.memory_max,
            "pids_max": self.pids_max,
            "cpu_max": self.cpu_max,
        }


class SessionCgroup:
    """One session's cgroup: made by :meth:`create`, removed by :meth:`close`
    (which kills whatever is still in it)."""

    def __init__(self, path: Path, procs_fd: int) -> None:
        self.path = path
        # cgroup.procs, open for writing: a process that writes "0" to it
        # moves itself in (see csrc/ffi_spawn.c and csrc/enter.c).
        self.procs_fd = procs_fd

    @classmethod
    def create(cls, limits: CgroupLimits) -> SessionCgroup:
        parent = Path(limits.parent)
        if not (parent / "cgroup.controllers").is_file():
            raise _unavailable(
                f"{parent} is not a cgroup v2 directory (this host may have only cgroup v1, or none delegated); "
                "the cgroup option needs one delegated to this process"
            )
        settings = limits.settings()
        _enable_controllers(parent, {name.split(".")[0] for name in settings})
        path = parent / f"sandboxns-{secrets.token_hex(8)}"
        try:
            path.mkdir(mode=0o755)
        except OSError as exc:
            raise _unavailable(f"cannot create a cgroup in {parent}: {exc.strerror}") from None
        try:
            for name, value in settings.items():
                if name == "memory.swap.max" and not (path / name).exists():
                    continue  # no swap accounting on this kernel: nothing to leak into
                (path / name).write_text(value)
            procs_fd = os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise _unavailable(f"cannot set up the session's cgroup {path}: {exc.strerror}") from None
        return cls(path, procs_fd)

    def kill(self) -> None:
        """Kill every process in the cgroup (cgroup.kill, Linux 5.14)."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / "cgroup.kill").write_text("1")

    def close(self) -> None:
        """Remove the cgroup, once the driver has waited for every process
        of the session to be gone. Idempotent. Should something still be in
        it (a driver gave up waiting), it is killed first; the kernel
        empties a cgroup asynchronously, so removal is retried briefly and
        then left to the host."""
        if self.procs_fd < 0:
            return
        os.close(self.procs_fd)
        self.procs_fd = -1
        self.kill()
        for delay in (0, 0.001, 0.01, 0.1, 0.5):
            time.sleep(delay)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    return


def _enable_controllers(parent: Path, needed: set[str]) -> None:
    """Make sure the parent hands ``needed`` controllers to its children."""
    available = set((parent / "cgroup.controllers").read_text().split())
    missing = needed - available
    if missing:
        raise _unavailable(
            f"the cgroup controllers {', '.join(sorted(missing))} are not available in {parent} "
            f"(it has: {', '.join(sorted(available)) or 'none'})"
        )
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    for controller in sorted(needed - enabled):
        try:
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        except OSError as exc:
            hint = " (a cgroup with processes of its own cannot delegate)" if exc.errno == errno.EBUSY else ""
            raise _unavailable(f"cannot enable the {controller} controller in {parent}: {exc.strerror}{hint}") from None
