"""A session handle: one session a backend started for this process, with
its lifetime (stop, shutdown, delete, idle timeout) and the snapshots and
forks taken from it. The backend (see _backend) starts sessions and takes
snapshots; the handle writes its own record's retention and removes its
own directory when deleted."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Self

import trio

from ._confinement import Confinement
from ._driver import Mount, SandboxDriver
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._gateway import SessionNetwork
from ._image import WorkspaceImage
from ._lease import Lease, is_locked
from ._network import check_network_policy
from ._pool import MAX_POOL_SIZE
from ._session import Session, check_seconds
from ._snapshots import Snapshot, check_snapshot_name
from ._state import STATE_FORMAT, discard_session, write_description

if TYPE_CHECKING:
    from ._backend import Backend

logger = logging.getLogger("sandboxns")

# How many of a fork's sessions start at once.
FORK_CONCURRENCY = max(2, os.cpu_count() or 1)


async def unmount_image(image: WorkspaceImage) -> None:
    with trio.CancelScope(shield=True):  # a cancelled caller must not leave the image mounted
        await trio.to_thread.run_sync(image.unmount)


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """What create() and fork() take about a new session's end."""

    idle_timeout: float | None
    destroy_on_close: bool
    destroy_on_idle: bool
    retention: float | None

    @classmethod
    def checked(
        cls, idle_timeout: object, destroy_on_close: object, destroy_on_idle: object, retention: object
    ) -> Lifetime:
        if idle_timeout is not None:
            idle_timeout = check_seconds(idle_timeout, "idle_timeout")
        for name, flag in (("destroy_on_close", destroy_on_close), ("destroy_on_idle", destroy_on_idle)):
            if not isinstance(flag, bool):
                raise invalid_argument(f"{name} must be True or False, not {flag!r}")
        if destroy_on_idle and idle_timeout is None:
            raise invalid_argument("destroy_on_idle needs an idle_timeout")
        if retention is not None:
            retention = check_seconds(retention, "retention")
        return cls(idle_timeout, destroy_on_close, destroy_on_idle, retention)


class SessionHandle:
    """A session owned by this process: its :class:`Session`, its state
    descriptor, and its lifetime (stop, shutdown, delete)."""

    def __init__(
        self,
        backend: Backend,
        session_dir: Path,
        description: dict,
        *,
        session: Session,
        lease: Lease,
        network: SessionNetwork,
        workspace_image: WorkspaceImage | None,
    ) -> None:
        """A session the backend has just started (see Backend._attach),
        over ``session``'s driver, holding ``lease``; ``network`` keeps its
        gateway, ``workspace_image`` is a capped session's mounted image."""
        self._backend = backend
        self._dir = session_dir
        self._description = description
        self.session_id: str = description["session"]
        self.template_key: str | None = description["template"]
        # The digest of the image the session runs on, or None for the host's trees.
        self.image: str | None = description.get("image")
        # Seconds a stopped session is kept, or None for ever (session.json).
        self.retention: float | None = description.get("retention")
        self.session = session
        self._driver: SandboxDriver | None = session.driver
        self._lease: Lease | None = lease
        self._network: SessionNetwork | None = network
        self._image = workspace_image
        self._deleted = False
        self._lifecycle = trio.Lock()
        self.destroy_on_close = False
        self.destroy_on_idle = False
        self._idle_watch: trio.CancelScope | None = None
        self._closed = trio.Event()

    def capture_state(self) -> dict:
        """A small JSON-serialisable descriptor to store and later pass to
        ``Backend.create(state=...)``. It holds no policy and no secret."""
        if self._deleted:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, f"session {self.session_id} was deleted")
        return {
            "format": STATE_FORMAT,
            "backend": self._backend.name,
            "template": self.template_key,
            "session": self.session_id,
        }

    @property
    def live(self) -> bool:
        return self._driver is not None

    async def _close(self) -> None:
        """Kill everything in the session; keeps the lease. The caller holds
        the lifecycle lock, so concurrent stops wait for this one."""
        if self._idle_watch is not None:
            self._idle_watch.cancel()
            self._idle_watch = None
        if self._driver is not None:
            self._backend._live.discard(self)
            await self._driver.aclose()
            self._driver = None
        if self._network is not None:
            await self._network.aclose()
            self._network = None
        if self._image is not None and self._lease is not None and self._lease.is_current():
            await unmount_image(self._image)

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    async def _stop_unsettled(self) -> None:
        """Stop the session and release it, from an operation that holds
        the lifecycle lock and left the session's files other than its
        holder sees them; its next attach settles what its record says."""
        await self._close()
        self._release()
        self._closed.set()

    def _taken_over(self) -> bool:
        try:
            return is_locked(self._dir)
        except SandboxError:  # the session no longer exists
            return False

    @contextlib.asynccontextmanager
    async def _closing(self) -> AsyncIterator[None]:
        """A stop, shutdown or delete: shielded, one at a time, and once the
        session no longer runs, :meth:`wait_closed` returns."""
        with trio.CancelScope(shield=True):
            async with self._lifecycle:
                try:
                    yield
                finally:
                    if not self.live:
                        self._closed.set()

    async def stop(self) -> None:
        """Kill the session's commands and release it; its files stay.
        Idempotent, but SANDBOX_BUSY once another handle has taken the
        session over."""
        async with self._closing():
            if self.live:
                await self._close()
                self._release()
            elif not self._deleted and self._lease is None and self._taken_over():
                raise SandboxError(ErrorCode.SANDBOX_BUSY, f"session {self.session_id} now belongs to another handle")

    async def shutdown(self) -> None:
        """Like :meth:`stop`, but never refuses: for ``finally`` blocks. It
        only ever affects what this handle still holds."""
        async with self._closing():
            await self._close()
            self._release()

    async def aclose(self) -> None:
        """Close the handle: :meth:`stop` (the session's files stay and it
        can be resumed), or :meth:`delete` for a session created with
        ``destroy_on_close``. ``async with handle:`` does this at the end."""
        if self.destroy_on_close:
            await self.delete()
        else:
            await self.shutdown()

    async def wait_closed(self) -> None:
        """Return once this handle's session has been stopped, shut down or
        deleted, by the caller or by its idle timeout."""
        await self._closed.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _watch_idleness(self, timeout: float, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Close the session (delete it, with ``destroy_on_idle``) once it
        has been idle for ``timeout`` seconds: no command running, no file
        operation or gateway request. A command running, however long,
        keeps it alive."""
        session = self.session
        with trio.CancelScope() as scope:
            self._idle_watch = scope
            task_status.started()
            while True:
                await session.wait_quiet()
                deadline = session.last_activity + timeout
                if trio.current_time() >= deadline and not session.running:
                    break
                await trio.sleep_until(deadline)
            self._idle_watch = None
            logger.info("session %s idle for %gs: closing it", self.session_id, timeout)
            try:
                await (self.delete() if self.destroy_on_idle else self.aclose())
            except Exception:  # runs in the backend's nursery, which must not die of it
                logger.exception("closing idle session %s failed", self.session_id)

    def _retain(self, retention: float) -> None:
        """Store the session's retention in its session.json. Only while
        its lease is held, so no one else writes there meanwhile."""
        self._description["retention"] = retention
        write_description(self._dir, self._description)
        self.retention = retention

    async def snapshot(self, name: str | None = None, *, copy: bool = False) -> Snapshot:
        """Freeze the session's workspace as it is now: a :class:`Snapshot`
        that ``Backend.create(snapshot=...)`` starts new sessions from,
        durable in the state directory. The session goes on over it, on an
        empty layer of its own. With an overlay (the native driver) nothing
        is copied, whatever the workspace holds; otherwise (and for a stack
        of more than MAX_STACK_DEPTH layers, once) the snapshot is a copy.

        Only while no command or file operation runs (SANDBOX_BUSY
        otherwise, like a policy change). A session bound to a host
        directory is refused (SANDBOX_INVALID_ARGUMENT) unless ``copy`` says
        to copy that directory's files."""
        return await self._snapshot(name, copy)

    async def _snapshot(
        self, name: str | None, copy: bool, meanwhile: Callable[[Snapshot], Awaitable[None]] | None = None
    ) -> Snapshot:
        """:meth:`snapshot`; ``meanwhile`` as Backend._take_snapshot takes it."""
        name = check_snapshot_name(name)
        if not isinstance(copy, bool):
            raise invalid_argument(f"copy must be True or False, not {copy!r}")
        async with self._lifecycle:
            if not self.live:
                raise SandboxError(ErrorCode.SANDBOX_STOPPED, f"session {self.session_id} is not running")
            with self.session.exclusive("a snapshot"):
                return await self._backend._take_snapshot(self, name, copy, meanwhile)

    async def fork(
        self,
        n: int,
        *,
        network: object = "deny-all",
        name: str | None = None,
        copy: bool = False,
        idle_timeout: float | None = None,
        destroy_on_close: bool = False,
        destroy_on_idle: bool = False,
        retention: float | None = None,
    ) -> list[SessionHandle]:
        """:meth:`snapshot` (``name``, ``copy``), then ``n`` new sessions over it, with
        ``network`` and the other options as ``Backend.create`` takes them,
        and this session's mounts and confinement (a workspace size cap
        bounds each fork's own layer). The forks never see each other's
        writes, nor this session's later ones. If one cannot be made, those
        made are deleted; the snapshot stays (this session stands on it)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_POOL_SIZE:
            raise invalid_argument(f"n must be an integer from 1 to {MAX_POOL_SIZE}, not {n!r}")
        policy = check_network_policy(network)
        lifetime = Lifetime.checked(idle_timeout, destroy_on_close, destroy_on_idle, retention)
        backend = self._backend
        mounts = [Mount(**mount) for mount in self._description.get("mounts", [])]
        confinement = Confinement.from_dict(self._description.get("confinement", {}))
        pooled: list[SessionHandle] = []
        started: list[SessionHandle] = []

        async def hand_out(snapshot: Snapshot) -> None:
            # Sessions of the fork pool take the snapshot's layers while
            # this one's holder goes over to it.
            pooled.extend(await backend._hand_out_forks(snapshot, n, policy, mounts, confinement))

        failures: list[Exception] = []
        try:
            snapshot = await self._snapshot(name, copy, hand_out)
            for fork in pooled:
                await backend._hand_over(fork, lifetime)
            create = functools.partial(
                backend.create,
                snapshot=snapshot,
                network=policy,
                mounts=mounts,
                confinement=confinement,
                **dataclasses.asdict(lifetime),
            )
            # A session start is mostly the kernel making namespaces and
            # mounts for a holder process: several overlap on the host's cores.
            starting = trio.CapacityLimiter(FORK_CONCURRENCY)

            async def start() -> None:
                try:
                    async with starting:
                        started.append(await create())
                except Exception as exc:  # noqa: BLE001 - the first is the fork's failure; the others stop
                    failures.append(exc)
                    nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                for _ in range(n - len(pooled)):
                    nursery.start_soon(start)
            if failures:
                raise failures[0]
        except BaseException:  # a failure, or the caller cancelled: no fork stays
            with trio.CancelScope(shield=True):
                for fork in pooled + started:
                    await fork.delete()
            raise
        return pooled + started

    async def delete(self) -> None:
        """Stop the session and remove its state and workspace (never a
        template, nor a host directory it was bound to). Idempotent;
        SANDBOX_BUSY if another handle holds the session."""
        async with self._closing():
            if self._deleted:
                return
            await self._close()
            if self._lease is None or not self._lease.is_current():
                self._release()
                if not self._dir.exists():
                    self._deleted = True
                    return
                self._lease = await Lease.acquire(self._dir, self._backend.state_directory)
            try:
                if self._image is not None:  # an owner that crashed left it mounted
                    await unmount_image(self._image)
                await trio.to_thread.run_sync(discard_session, self._dir)
            finally:
                self._release()
            self._deleted = True
