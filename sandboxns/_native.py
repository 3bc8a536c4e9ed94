"""The native driver: one C holder process per session.

Creating namespaces is the expensive part of sandboxing, so a session's
namespaces are made once, by ``sandboxns-holder``, and each command is forked
inside them with its own fresh mount and pid namespace (see csrc/). This
module starts the holder, talks to it over a SOCK_SEQPACKET control socket,
and turns its structured reports into Python values and SandboxErrors.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from . import _ffi
from ._cgroup import SessionCgroup
from ._confinement import ResourceLimits
from ._driver import (
    HOLDER_PATH,
    MAX_COMMAND_BYTES,
    ExitStatus,
    GatewayEndpoint,
    OverlayUnavailable,
    StartPlan,
    received_fds,
)
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._files import HostWorkspaceIO, WorkspaceFiles
from ._hostids import guest_host_ids
from ._lease import ProcessId
from ._network import PROXY_PORT, NetworkPolicy
from ._pump import CommandPipes, OutputSink

assert _ffi.MAX_REQUEST_STRINGS >= MAX_COMMAND_BYTES, "the holder must take any command the session accepts"
# Session setup is a few milliseconds; this only bounds a wedged holder.
HOLDER_READY_TIMEOUT = 10.0
# How long a stopping session's holder gets to tear down before SIGKILL.
HOLDER_EXIT_GRACE = 5.0


def _error_from_report(report: _ffi.Report, what: str) -> SandboxError:
    """Map a failed setup step to an error code: a command that cannot be
    found or entered is the caller's to fix; anything else means the sandbox
    itself could not be established."""
    detail = f"{what} failed at step {report.step!r}: {report.message}"
    if report.step in ("execve", "chdir") and report.errno in (errno.ENOENT, errno.ENOTDIR):
        return SandboxError(ErrorCode.SANDBOX_NOT_FOUND, detail)
    if report.step in ("execve", "chdir") and report.errno in (errno.EACCES, errno.ENOEXEC):
        return SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, detail)
    return SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, detail)


def _seqpacket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class NativeProcess:
    """A command running under a holder. Talks to the holder over the
    command's own socket: reports come in, signal requests go out, and
    closing it kills the command's tree."""

    def __init__(self, driver: NativeDriver, reply: socket.socket, pipes: CommandPipes) -> None:
        reply.setblocking(False)
        self._driver = driver
        self._reply = reply
        self._pipes = pipes
        self._status: ExitStatus | None = None
        self._setup_error: SandboxError | None = None

    def _receive(self) -> bytes | None:
        """The next report, b"" once the holder is gone, None if none is there yet."""
        try:
            return self._reply.recv(_ffi.REPORT_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""  # closed under us: as good as the holder gone

    def _take_report(self, data: bytes) -> None:
        report = _ffi.decode_report(data)
        if report.kind == _ffi.REPORT_ERROR and self._setup_error is None:
            self._setup_error = _error_from_report(report, "starting the command")
        elif report.kind == _ffi.REPORT_EXITED:
            signum = report.signal or None
            self._status = ExitStatus(exit_code=None if signum else report.exit_code, signal=signum)

    async def wait(self) -> ExitStatus:
        # EXITED comes once the init has reaped the whole tree: the output
        # is complete in the pipes by then.
        while self._status is None:
            data = self._receive()
            if data:
                self._take_report(data)
            elif data is not None:
                raise await self._driver._holder_gone("while the command was running")
            else:
                await self._pipes.until_readable(self._reply.fileno())
                if self._pipes.take_kill_request():
                    await self.send_signal(signal.SIGKILL)
        self._pipes.finish()
        if self._setup_error is not None:
            raise self._setup_error
        return self._status

    async def send_signal(self, signum: int) -> None:
        if self._status is not None or self._reply.fileno() < 0:
            return
        # A few bytes on a socket the holder drains as they come: this
        # never waits in practice, but may, so it is a checkpoint.
        with contextlib.suppress(OSError):
            while True:
                try:
                    self._reply.send(_ffi.encode_signal(signum))
                    break
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self._reply)
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._pipes.close()
        if self._reply.fileno() >= 0:
            trio.lowlevel.notify_closing(self._reply)
            self._reply.close()
        await trio.lowlevel.checkpoint()


class NativeDriver(HostWorkspaceIO):
    """A sandbox session backed by one ``sandboxns-holder`` process.

    Use :meth:`start`; :meth:`aclose` kills everything in the session.
    """

    name = "native"
    supports_overlay = True

    def __init__(self) -> None:
        raise TypeError("use 'await NativeDriver.start(...)'")

    @classmethod
    async def start(cls, plan: StartPlan) -> NativeDriver:
        """Start a session as ``plan`` says (see :class:`StartPlan`). An
        overlay's ``layer_stores`` let :meth:`take_layers` later stand the
        workspace on any of their layers; an image root is the guest's root
        instead of the host's runtime trees (see csrc/rootfs.c)."""
        if not isinstance(plan, StartPlan):
            raise invalid_argument(f"start takes a sandboxns.StartPlan, not {plan!r}")
        if not HOLDER_PATH.exists():
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"the holder program {HOLDER_PATH} is missing; reinstall sandboxns with 'pip install .'",
            )
        self = object.__new__(cls)
        self.workspace = plan.workspace
        self.confinement = plan.confinement
        self._default_rlimits = plan.confinement.limits.slots()
        self._base_argv = [
            str(HOLDER_PATH),
            f"--uid={plan.uid}",
            f"--gid={plan.gid}",
            *self.confinement.holder_arguments(),
        ]
        host_ids = guest_host_ids()
        if host_ids is not None:
            self._base_argv.append("--host-ids={}:{}".format(*host_ids))
            self._fs_ids = host_ids
        # The workspace's layers, which a snapshot changes: see _launch.
        self._overlay_lowers: list[Path] = []
        self._overlay_work: Path | None = None
        if plan.overlay is not None:
            self._overlay_work = plan.overlay.scratch.resolve()
            self._overlay_lowers = list(plan.overlay.lowers)
            if plan.overlay.layer_stores is not None:
                templates, snapshots = plan.overlay.layer_stores
                self._base_argv += [
                    f"--template-store={templates.resolve()}",
                    f"--snapshot-store={snapshots.resolve()}",
                ]
        self._base_argv += [f"--bind={'rw' if m.writable else 'ro'}:{m.guest}:{m.host}" for m in plan.mounts]
        if plan.image_root is not None:
            self._base_argv.append(f"--image-root={plan.image_root}")
        self._lease = plan.lease
        self._closed = False
        self._holder_died = False
        self._restackable = True  # until its holder says it cannot (see restack)
        self._stopped = trio.Event()
        self._send_lock = trio.Lock()
        self._holder_lock = trio.Lock()
        self._cgroup = None if self.confinement.cgroup is None else SessionCgroup.create(self.confinement.cgroup)
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._proxy: trio.CancelScope | None = None
        try:
            await self._launch(plan.network, plan.gateway)
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        """Give back what the session holds besides its holder (gone by now)."""
        os.close(self._devnull)
        if self._cgroup is not None:
            self._cgroup.close()

    async def _launch(self, policy: NetworkPolicy, gateway: GatewayEndpoint | None) -> None:
        """Start a holder for this session's workspace with this network."""
        argv = [*self._base_argv, f"--workspace={self.workspace}"]
        if self._overlay_work is not None:
            argv.append(f"--overlay-work={self._overlay_work}")
            argv += [f"--overlay-lower={lower.resolve()}" for lower in self._overlay_lowers]
        if policy.shares_host_network:
            argv.append("--share-network")
        if gateway is not None:
            argv += [f"--gateway-dir={gateway.directory}", f"--proxy-port={PROXY_PORT}"]
        self.holder_pid = None
        with contextlib.ExitStack() as cleanup:
            host_end, holder_end = _seqpacket_pair()
            cleanup.callback(host_end.close)
            with holder_end:
                # Synchronously, in this (trio's) thread: see spawn_holder.
                try:
                    self._pid = _ffi.spawn_holder(
                        str(HOLDER_PATH),
                        argv,
                        holder_end.fileno(),
                        -1 if self._lease is None else self._lease.fd,
                        -1 if self._cgroup is None else self._cgroup.procs_fd,
                    )
                except OSError as exc:
                    raise SandboxError(
                        ErrorCode.SANDBOX_UNAVAILABLE, f"cannot start the sandbox holder: {exc}"
                    ) from exc
            self._pidfd = os.pidfd_open(self._pid)
            cleanup.callback(self._reap_holder_now)
            self._control = trio.socket.from_stdlib_socket(host_end)
            workspace_fd, listeners = await self._await_ready()
            cleanup.callback(os.close, workspace_fd)
            for listener in listeners:
                cleanup.callback(listener.close)
            if self._lease is not None:
                self._lease.track(ProcessId.of(pid) for pid in (self._pid, self.holder_pid))
            cleanup.pop_all()
        self._files = WorkspaceFiles(workspace_fd)
        self.network = policy
        self._gateway = gateway
        # The holder's network namespace lives as long as the holder: so
        # does the serving of the proxy's listeners in it.
        self._proxy = None if gateway is None else gateway.serve_proxy(listeners)

    async def _stop_holder(self) -> None:
        """Close the control socket and wait for the holder, and with it
        everything in the session, to be gone."""
        # Closing the control socket makes the holder (pid 1 of the session)
        # exit; the kernel then kills and reaps everything in the session
        # before the launcher we track exits. So once the pidfd is readable,
        # nothing of the session is left.
        with trio.CancelScope(shield=True):
            if self._proxy is not None:
                self._proxy.cancel()
            self._control.close()
            await self._close_files()
            with trio.move_on_after(HOLDER_EXIT_GRACE):
                await trio.lowlevel.wait_readable(self._pidfd)
            self._reap_holder_now()

    async def set_network(self, policy: NetworkPolicy, gateway: GatewayEndpoint | None) -> None:
        """Apply a new network policy; no command may be running. Namespaces
        cannot be swapped under a live holder, so a change of network
        namespace or gateway starts a new holder (about as costly as
        a session start); a new allow-list for the same gateway costs
        nothing here."""
        self.check_usable()
        if policy.shares_host_network == self.network.shares_host_network and gateway is self._gateway:
            self.network = policy
            return
        # aclose() waits for this: both would wait on the holder's pidfd.
        async with self._holder_lock:
            self.check_usable()
            await self._stop_holder()
            try:
                await self._launch(policy, gateway)
            except BaseException:
                self._close_stopped()
                raise

    async def restack(self, names: tuple[str, str] | None, layers: Sequence[Path]) -> None:
        """Put the overlay workspace on new read-only layers, ``layers``
        (topmost first, on the host), for a snapshot, while no command or
        file operation runs. The host has moved the upper layer into the
        store and put a new upper and work directory in its place, ``names``
        (beside it): the holder mounts a new overlay over /workspace on them,
        whose topmost read-only layer is the old upper directory (see
        csrc/overlay.c). Without ``names`` (a stack replaced whole), or with
        a holder that cannot (a kernel before 6.13, a mount inside
        /workspace), a new holder starts over the layers instead."""
        self.check_usable()
        if self._overlay_work is None:
            raise invalid_argument("the session's workspace is no overlay")
        with trio.CancelScope(shield=True):  # a session without its holder is no session
            async with self._holder_lock:
                self.check_usable()
                self._overlay_lowers = [Path(lower) for lower in layers]
                if names is not None and self._restackable and await self._restack_in_place(_ffi.encode_restack(names)):
                    return
                await self._stop_holder()
                try:
                    await self._launch(self.network, self._gateway)
                except BaseException:
                    self._close_stopped()
                    raise

    async def take_layers(self, names: Sequence[str], lowers: Sequence[Path]) -> bool:
        """For a session started ahead with layer stores (see start): mount
        a new overlay over /workspace whose read-only layers are ``names[2:]``
        of those stores ("t/<template key>", "s/<snapshot id>", topmost
        first; on the host, ``lowers``), under the upper and work
        directories ``names[0:2]``, beside the current ones; a holder
        started later (a change of network namespace) stands on them too.
        False if the holder cannot (nothing changed)."""
        self.check_usable()
        with trio.CancelScope(shield=True):
            async with self._holder_lock:
                self.check_usable()
                if not self._restackable or not await self._restack_in_place(_ffi.encode_restack(names, True)):
                    return False
                self.workspace, self._overlay_work = (self.workspace.parent / name for name in names[:2])
                self._overlay_lowers = [Path(lower) for lower in lowers]
                return True

    async def _restack_in_place(self, request: bytes) -> bool:
        """Ask the holder for a new overlay over /workspace; False if it
        cannot (then nothing changed). On any other failure the session is
        closed: its workspace may be gone from under the holder, which may
        also be wedged (it has HOLDER_READY_TIMEOUT to answer)."""
        host_end, holder_end = _seqpacket_pair()
        with host_end:
            try:
                with holder_end:
                    await self._control.sendmsg(
                        [request],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [holder_end.fileno()]))],
                    )
                reply = trio.socket.from_stdlib_socket(host_end)
                with trio.fail_after(HOLDER_READY_TIMEOUT):
                    data, ancillary, _, _ = await reply.recvmsg(
                        _ffi.REPORT_SIZE, socket.CMSG_SPACE(4 * _ffi.MAX_PASSED_FDS), socket.MSG_CMSG_CLOEXEC
                    )
            except (OSError, trio.TooSlowError) as exc:
                await self._close_broken()
                raise SandboxError(
                    ErrorCode.SANDBOX_UNAVAILABLE, "the session's holder died while the workspace took new layers"
                ) from exc
        fds = received_fds(ancillary)
        report = _ffi.decode_report(data) if data else None
        if report is not None and report.kind == _ffi.REPORT_READY and len(fds) == 1:
            await self._close_files()  # nothing uses it: the session is busy with the snapshot
            self._files = WorkspaceFiles(fds[0])
            return True
        for fd in fds:
            os.close(fd)
        if report is not None and report.kind == _ffi.REPORT_ERROR and report.step == "restack":
            # Nothing changed: a new holder will do.
            self._restackable = report.errno != errno.EOPNOTSUPP
            return False
        await self._close_broken()
        if report is None:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE, "the holder went away while the workspace took new layers"
            )
        raise _error_from_report(report, "putting new layers under the workspace")

    async def _close_broken(self) -> None:
        """Stop a session whose workspace is not what its record says (a
        restack failed half way); its files on disk are whole."""
        await self._stop_holder()
        self._close_stopped()

    def _close_stopped(self) -> None:
        self._closed = True
        self._release()
        self._stopped.set()

    def check_usable(self) -> None:
        if self._holder_died:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the session is stopped: its holder died")
        super().check_usable()

    async def _holder_gone(self, when: str) -> SandboxError:
        """The error for a request or command the holder went away under.
        If no stop did that, the holder died (killed from the host, or it
        crashed): the session closes itself, so it is all gone and every
        later call is refused, and this says the sandbox failed."""
        if self._closed and not self._holder_died:
            return SandboxError(ErrorCode.SANDBOX_STOPPED, f"the session stopped {when}")
        self._holder_died = True
        await self.aclose()
        return SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the session's holder died {when}")

    def _reap_holder_now(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        os.waitpid(self._pid, 0)
        os.close(self._pidfd)

    async def _await_ready(self) -> tuple[int, list[socket.socket]]:
        """Wait for READY and STARTED (in either order: the launcher and the
        holder send them independently); returns the workspace fd READY
        carries, and the proxy's listeners after it, if any."""
        workspace_fd = None
        listeners: list[socket.socket] = []
        try:
            with trio.move_on_after(HOLDER_READY_TIMEOUT):
                while workspace_fd is None or self.holder_pid is None:
                    data, ancillary, _, _ = await self._control.recvmsg(
                        _ffi.REPORT_SIZE, socket.CMSG_SPACE(4 * _ffi.MAX_PASSED_FDS), socket.MSG_CMSG_CLOEXEC
                    )
                    fds = received_fds(ancillary)
                    if not data:
                        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the sandbox holder exited during setup")
                    report = _ffi.decode_report(data)
                    if report.kind == _ffi.REPORT_STARTED:
                        self.holder_pid = report.pid
                    elif report.kind == _ffi.REPORT_READY and fds:
                        workspace_fd = fds.pop(0)
                        listeners = [socket.socket(fileno=fd) for fd in fds]
                        fds = []
                    elif report.kind == _ffi.REPORT_READY:
                        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the holder sent no workspace handle")
                    elif report.step == "overlay":
                        raise OverlayUnavailable(f"cannot mount the workspace overlay: {report.message}")
                    else:
                        raise _error_from_report(report, "setting up the sandbox")
                    for fd in fds:  # anything unexpected
                        os.close(fd)
                return workspace_fd, listeners
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the sandbox holder did not become ready")
        except BaseException:
            if workspace_fd is not None:
                os.close(workspace_fd)
            for listener in listeners:
                listener.close()
            raise

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        output: OutputSink,
        stdin: int | bytes | None = None,
        limits: ResourceLimits | None = None,
    ) -> NativeProcess:
        self.check_usable()
        try:
            request = _ffi.encode_request(cwd, argv, env, self._default_rlimits if limits is None else limits.slots())
        except ValueError as exc:
            raise SandboxError(ErrorCode.SANDBOX_LIMIT, str(exc)) from None
        pipes = CommandPipes(output, stdin)
        host_end, holder_end = _seqpacket_pair()
        stdin_fd, stdout_fd, stderr_fd = pipes.child_fds
        passed = [holder_end.fileno(), self._devnull if stdin_fd is None else stdin_fd, stdout_fd, stderr_fd]
        try:
            async with self._send_lock:
                await self._control.sendmsg(
                    [request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))]
                )
        except BaseException as exc:
            host_end.close()
            pipes.close()
            if isinstance(exc, (OSError, trio.ClosedResourceError)):
                raise await self._holder_gone("before the command started") from exc
            raise
        finally:
            # The holder has its own copies of everything passed.
            holder_end.close()
            pipes.close_child_ends()
        return NativeProcess(self, host_end, pipes)

    async def aclose(self) -> None:
        """Kill everything in the session; returns once it is all gone (also
        when another task is already closing it)."""
        if self._closed:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()
            return
        with trio.CancelScope(shield=True):
            async with self._holder_lock:
                if self._closed:  # a failed network change closed it meanwhile
                    await self._stopped.wait()
                    return
                self._closed = True
                await self._stop_holder()
                self._release()
                self._stopped.set()
