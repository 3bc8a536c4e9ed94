"""What a sandbox driver must provide, and the values drivers share.

A driver owns one sandbox session's isolation: it spawns commands inside it
and enforces its network policy. :class:`~sandboxns.Session` builds the
public conveniences (text, paths, run-once with deadlines and output caps) on
top of it, so every driver gets them identically.
"""

from __future__ import annotations

import array
import os
import posixpath
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import trio

from ._confinement import DEFAULT_CONFINEMENT, Confinement, ResourceLimits, check_confinement
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._files import DirEntry
from ._lease import Lease
from ._network import DENY_ALL, GUEST_GATEWAY_DIR, GUEST_SOCKET, NetworkPolicy, check_network_policy
from ._paths import WORKSPACE
from ._pump import OutputSink

# The program each native session execs, which is also the init of every
# bwrap sandbox (`sandboxns-holder --init`).
HOLDER_PATH = Path(__file__).with_name("sandboxns-holder")
# A command's cwd, arguments and environment together (as NUL-terminated
# strings): what every driver must take (the native holder's request size),
# far below ARG_MAX.
MAX_COMMAND_BYTES = 128 * 1024


class OverlayUnavailable(SandboxError):
    """A driver could not mount a template overlay as the workspace (an old
    or restricted kernel); the backend then copies the template instead."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.SANDBOX_UNAVAILABLE, message)


# Where the bwrap driver binds its init, pid 1 of each command (csrc/bwrap_init.c).
GUEST_INIT = "/run/sandboxns-init"
MAX_MOUNTS = 8
_MOUNT_ROOTS = ("/run/", WORKSPACE + "/")


@dataclass(frozen=True)
class Mount:
    """A host file or directory bound into the guest at ``guest``: a path
    under ``/run/``, or inside ``/workspace`` (over what is there; later
    mounts may lie inside earlier ones). Read-only (and not executable)
    unless ``writable``."""

    host: str | os.PathLike[str]
    guest: str
    writable: bool = False


def check_mounts(mounts: object) -> tuple[Mount, ...]:
    """Validate extra mounts; returns them with resolved host paths."""
    if isinstance(mounts, (str, bytes)) or not isinstance(mounts, Sequence):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "mounts must be a sequence of sandboxns.Mount")
    if len(mounts) > MAX_MOUNTS:
        raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"at most {MAX_MOUNTS} mounts, not {len(mounts)}")
    checked = []
    for mount in mounts:
        if not isinstance(mount, Mount) or not isinstance(mount.writable, bool):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"not a sandboxns.Mount: {mount!r}")
        guest = mount.guest
        if (
            not isinstance(guest, str)
            or posixpath.normpath(guest) != guest
            or any(c in guest for c in ":\0")
            or not guest.startswith(_MOUNT_ROOTS)
            or guest in (GUEST_SOCKET, GUEST_INIT, GUEST_GATEWAY_DIR)
            or guest.startswith(GUEST_GATEWAY_DIR + "/")
        ):
            raise SandboxError(
                ErrorCode.SANDBOX_PATH_REFUSED,
                f"a mount's guest path must be a normal path under /run/ or inside /workspace, not {guest!r}",
            )
        if not isinstance(mount.host, (str, os.PathLike)) or "\0" in str(mount.host):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"a mount's host path must be a path: {mount!r}")
        host = Path(mount.host)
        if not host.is_absolute() or not (host.is_dir() or host.is_file()):
            raise SandboxError(
                ErrorCode.SANDBOX_NOT_FOUND,
                f"a mount's host path must be an existing absolute file or directory: {host}",
            )
        checked.append(Mount(str(host.resolve()), guest, mount.writable))
    return tuple(checked)


@dataclass(frozen=True)
class Overlay:
    """An overlay workspace: the plan's ``workspace`` is its writable upper
    layer, over the read-only ``lowers`` (topmost first: snapshots, then a
    template); ``scratch`` is overlayfs's work directory. With
    ``layer_stores`` (the state directory's templates and snapshots) the
    native holder keeps a read-only handle on both, so that its workspace
    can later be stood on any of their layers (a session started ahead,
    for forks)."""

    lowers: tuple[Path, ...]
    scratch: Path
    layer_stores: tuple[Path, Path] | None = None


@dataclass(frozen=True)
class StartPlan:
    """Everything a driver's ``start`` needs, checked once, here: building
    a plan raises SandboxError for anything wrong, and holds the checked
    values (a resolved workspace and mounts, a parsed
    :class:`~sandboxns.NetworkPolicy`, a :class:`~sandboxns.Confinement`).

    ``workspace`` is the host directory that is the guest's /workspace (or
    the upper layer of ``overlay``); ``uid``/``gid`` the guest's ids;
    ``mounts`` extra host paths to bind (see :class:`Mount`);
    ``confinement`` the session's kernel bounds, without a workspace size
    cap (a backend makes that mount before any driver starts);
    ``image_root``, an imported image's root filesystem, is the guest's
    root instead of the host's runtime trees; ``gateway`` is the session's
    egress gateway, for a policy that has one (see
    :meth:`SandboxDriver.set_network`); ``lease``, a held session lease,
    tracks the session's processes, and the native driver shares it with
    its holder's launcher so it stays locked until every process of the
    session is gone, even if this process dies first."""

    workspace: Path
    network: NetworkPolicy = DENY_ALL
    uid: int = 1000
    gid: int = 1000
    mounts: tuple[Mount, ...] = ()
    confinement: Confinement = DEFAULT_CONFINEMENT
    image_root: Path | None = None
    overlay: Overlay | None = None
    gateway: GatewayEndpoint | None = None
    lease: Lease | None = None

    def __post_init__(self) -> None:
        # Each field is given as callers have it and kept as checked.
        for label in ("uid", "gid"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32 - 1:
                raise invalid_argument(f"{label} must be an integer id, not {value!r}")
        confinement = check_confinement(self.confinement)
        if confinement.workspace_size is not None:
            raise invalid_argument(
                "workspace_size caps the workspace of a backend session made from a template (Backend.create); "
                "a sandbox over a host directory cannot be capped"
            )
        if self.overlay is not None and not isinstance(self.overlay, Overlay):
            raise invalid_argument(f"overlay must be a sandboxns._driver.Overlay, not {self.overlay!r}")
        if self.lease is not None and not isinstance(self.lease, Lease):
            raise invalid_argument(f"lease must be a held session lease, not {self.lease!r}")
        object.__setattr__(self, "network", check_network_policy(self.network))
        object.__setattr__(self, "confinement", confinement)
        object.__setattr__(self, "mounts", check_mounts(self.mounts))
        object.__setattr__(self, "image_root", _checked_image_root(self.image_root))
        object.__setattr__(self, "workspace", _checked_workspace(self.workspace))


def _checked_workspace(workspace: object) -> Path:
    if not isinstance(workspace, (str, os.PathLike)) or "\0" in str(workspace):
        raise invalid_argument(f"workspace must be a path, not {workspace!r}")
    path = Path(workspace)
    if not path.is_dir():
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"workspace {path} is not a directory")
    return path.resolve()


def _checked_image_root(image_root: object) -> Path | None:
    """None (the guest's root is made of the host's runtime trees), or the
    directory of an imported image's root filesystem (see
    sandboxns._rootfs_images), resolved."""
    if image_root is None:
        return None
    if not isinstance(image_root, (str, os.PathLike)) or "\0" in str(image_root):
        raise invalid_argument(f"image_root must be a directory, not {image_root!r}")
    root = Path(image_root)
    if not root.is_absolute() or not root.is_dir():
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"image root {root} is not an absolute directory")
    return root.resolve()


class GatewayEndpoint(Protocol):
    """What a driver connects a gateway session to (a
    :class:`~sandboxns._gateway.Gateway`): its directory, bound read-only
    into the guest at /run/sandboxns (its Unix socket, ``network.sock``,
    also at /run/sandboxns-network.sock), and the server of the session's
    proxy port, to which the driver hands the listening sockets a sandbox
    process made in the guest's network namespace."""

    directory: Path
    socket_path: Path

    def serve_proxy(self, listeners: list[socket.socket]) -> trio.CancelScope:
        """Serve the listeners until the returned scope is cancelled."""
        ...


def received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds an SCM_RIGHTS message carried (recvmsg's ancillary data)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


@dataclass(frozen=True)
class ExitStatus:
    """How a command ended: ``exit_code`` if it exited, ``signal`` if a
    signal killed it (then ``exit_code`` is None)."""

    exit_code: int | None
    signal: int | None


@runtime_checkable
class SandboxProcess(Protocol):
    """A running command."""

    async def wait(self) -> ExitStatus:
        """Wait until the command and every descendant are gone, meanwhile
        feeding its output to the sink given to ``spawn`` (and its input
        to it); output moves only while someone waits. Killing the
        command when the sink asks is part of waiting. May be called again
        after a cancelled wait."""
        ...

    async def send_signal(self, signum: int) -> None:
        """Deliver a signal to the command; SIGKILL kills its whole tree."""
        ...

    async def aclose(self) -> None:
        """Release the process; a command still running is killed."""
        ...


@runtime_checkable
class SandboxDriver(Protocol):
    """One sandbox session's isolation mechanism: spawning inside it, byte
    file I/O on its workspace, and its network policy.

    Paths given to a driver are canonical guest paths (``/workspace/...``);
    the session has already refused anything else. A driver must still
    refuse, with SANDBOX_PATH_REFUSED, a path that *resolves* outside the
    workspace (through symlinks the guest made)."""

    name: str
    network: NetworkPolicy  # the policy in force

    async def read_bytes(self, path: str, max_bytes: int) -> bytes:
        """A regular file's content; SANDBOX_LIMIT if longer than max_bytes."""
        ...

    async def write_bytes(self, path: str, data: bytes) -> None:
        """Create or atomically replace a file; its directory must exist."""
        ...

    async def list_dir(self, path: str) -> list[DirEntry]: ...

    async def remove(self, path: str, recursive: bool = False) -> None: ...

    async def mkdir(self, path: str, parents: bool = False) -> None: ...

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        output: OutputSink,
        stdin: int | bytes | None = None,
        limits: ResourceLimits | None = None,
    ) -> SandboxProcess:
        """Start ``argv`` inside the sandbox with exactly ``env``, in ``cwd``
        (an absolute guest path), its stdout and stderr going to ``output``.
        ``stdin`` is bytes to feed the command, a host fd to copy its input
        from (never the fd itself: see sandboxns._pump), or None (an empty
        input); ``limits`` replace the session's default
        rlimits for this command. Raises SandboxError(SANDBOX_STOPPED) once
        the driver is closed."""
        ...

    async def set_network(self, policy: NetworkPolicy, gateway: GatewayEndpoint | None) -> None:
        """Apply a network policy while no command runs. ``gateway`` is the
        session's egress gateway for a policy that has one: its socket
        appears in the guest at /run/sandboxns-network.sock, and its proxy
        at 127.0.0.1:PROXY_PORT (and [::1]) in the guest's own network."""
        ...

    async def aclose(self) -> None:
        """Kill everything in the session and release it. Idempotent."""
        ...
