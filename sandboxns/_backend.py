"""The backend: templates, durable sessions, leases and command admission
(the state directory it keeps them in is described in _state)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import ssl
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from ._confinement import DEFAULT_CONFINEMENT, Confinement, check_confinement
from ._driver import GatewayEndpoint, Mount, Overlay, OverlayUnavailable, StartPlan, check_mounts
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._gateway import GatewayHub, SessionNetwork, service_nursery
from ._handle import Lifetime, SessionHandle, unmount_image
from ._image import WorkspaceImage, require_workspace_cap_support
from ._layers import copy_tree, merge_layers, move_tree, remove_tree
from ._lease import Lease
from ._network import DENY_ALL, GATEWAY_ENVIRONMENT, NetworkPolicy, check_network_policy
from ._pool import FORK_POOL, SessionPools
from ._registry import driver_class
from ._rootfs_images import Image, ImageStore, check_digest, session_environment
from ._session import DEFAULT_ENV, Session
from ._snapshots import (
    MAX_STACK_DEPTH,
    Snapshot,
    SnapshotStore,
    new_snapshot_id,
    snapshot_id_of,
)
from ._state import (
    SESSION_ID_PATTERN,
    STATE_FORMAT,
    delete_expired_sessions,
    delete_image,
    delete_snapshot,
    new_description,
    read_description,
    stack_of,
    storage_root,
    sweep_snapshot_store,
    write_description,
)
from ._templates import Template, TemplateStore, check_key, check_template_files

logger = logging.getLogger("sandboxns")

DEFAULT_MAX_CONCURRENT_COMMANDS = 8
MAX_CONCURRENT_COMMANDS_LIMIT = 4096
# Beside an overlay workspace's upper layer during a snapshot: the upper and
# work directories it goes on with (see Backend._freeze), and the work
# directory of the overlay it leaves, which the next snapshot removes.
NEXT_UPPER = "workspace.next"
NEXT_WORK = "overlay-work.next"
OLD_WORK = "overlay-work.old"
# How often a running backend deletes stopped sessions past their retention
# (and stamps the leases of its own, see _lease): retentions are minutes to
# days, and each look reads every session's record.
RETENTION_SWEEP_INTERVAL = 60.0


class CommandSlots:
    """The admission limit: at most ``limit`` commands at once across all of
    a backend's sessions. Refuses instead of queueing, so a caller learns at
    once that the host is saturated. Trio is single-threaded, so a counter
    is exact."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def check(self) -> None:
        if self.active >= self.limit:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"all {self.limit} command slots are in use (max_concurrent_commands); try again when one finishes",
            )

    def acquire(self) -> None:
        self.check()
        self.active += 1

    def release(self) -> None:
        self.active -= 1


def _check_snapshot_image(snapshot: Snapshot, image: str | None) -> None:
    """A session over ``snapshot`` runs on its image: ``image``, if given
    to create(), must be that one."""
    if image is not None and image != snapshot.image:
        raise invalid_argument(f"snapshot {snapshot.id} runs on {snapshot.image or 'the host'}, not {image}")


def _empty_upper(upper: Path, layer: Path) -> None:
    """Give an overlay workspace a new, empty upper layer whose top has the
    mode of the layer it now stands on (the workspace's own, as the guest
    left it)."""
    remove_tree(upper)
    upper.mkdir(mode=0o755)
    os.chmod(upper, stat.S_IMODE(os.stat(layer).st_mode))


@dataclasses.dataclass
class _Freezing:
    """How far the host's half of a snapshot got (see Backend._freeze)."""

    upper_changed: bool = False  # the upper layer began to leave the workspace
    renamed: bool = False  # it went into the store in one rename


async def _together(*jobs: Callable[[], Awaitable[object]] | None) -> list[object]:
    """Run the ``jobs`` given at once, each to its end, and return their
    results in order; the first to fail is raised as itself once all have
    ended, where a nursery would raise an ExceptionGroup."""
    results: list[object] = [None] * len(jobs)
    failures: list[Exception] = []

    async def run(index: int, job: Callable[[], Awaitable[object]]) -> None:
        try:
            results[index] = await job()
        except Exception as exc:  # noqa: BLE001 - each job's failure is collected, the first raised
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for index, job in enumerate(jobs):
            if job is not None:
                nursery.start_soon(run, index, job)
    if failures:
        raise failures[0]
    return results


class Backend:
    """Owns a state directory: templates, sessions and their leases, and the
    admission limit shared by all its sessions. Use :func:`open_backend`."""

    def __init__(
        self,
        driver: str,
        state_directory: Path,
        max_concurrent_commands: int,
        hub: GatewayHub,
        nursery: trio.Nursery,
    ) -> None:
        self.name = driver
        self._driver_class = driver_class(driver)
        self.state_directory = state_directory
        self._hub = hub
        self._nursery = nursery
        self._slots = CommandSlots(max_concurrent_commands)
        self._templates = TemplateStore(state_directory / "templates")
        self._images = ImageStore(state_directory / "images")
        self._snapshots = SnapshotStore(state_directory / "snapshots")
        self._sessions = state_directory / "sessions"
        self._overlay = self._driver_class.supports_overlay
        self._live: set[SessionHandle] = set()
        self._pools: SessionPools[SessionHandle] = SessionPools(nursery)
        self._closed = False
        self._sweeping = trio.CancelScope()  # the retention sweep's, see open_backend

    @property
    def max_concurrent_commands(self) -> int:
        return self._slots.limit

    @property
    def active_commands(self) -> int:
        """How many admission slots are taken right now."""
        return self._slots.active

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the backend is closed")

    async def import_image(self, path: str | os.PathLike[str]) -> Image:
        """Import a root filesystem image (an OCI image layout, as a
        directory or a tar, or a plain root filesystem directory or tar)
        into the state directory, and return it; see _rootfs_images. The
        same image again is the same digest, imported once."""
        self._check_open()
        if not isinstance(path, (str, os.PathLike)):
            raise invalid_argument(f"path must be a path, not {path!r}")
        return await trio.to_thread.run_sync(self._images.import_path, path)

    async def images(self) -> list[Image]:
        """The images imported here."""
        self._check_open()
        return await trio.to_thread.run_sync(self._images.list)

    async def delete_image(self, digest: str) -> None:
        """Remove an imported image: SANDBOX_NOT_FOUND if there is none,
        SANDBOX_BUSY (naming them) while a session or snapshot runs on it.
        Templates prewarmed with it start no session until it is imported
        again."""
        self._check_open()
        check_digest(digest)
        await trio.to_thread.run_sync(delete_image, self.state_directory, digest)

    def _session_image(self, description: dict) -> Image:
        """The image a stored session runs on (SANDBOX_STATE_MISMATCH if
        it is gone)."""
        try:
            return self._images.get(description["image"])
        except SandboxError as exc:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"session {description['session']} runs on image {description['image']}: {exc.message}",
            ) from None

    async def prewarm(self, *, template: str, files: Mapping[str, bytes], image: str | None = None) -> Template:
        """Snapshot ``files`` (workspace path -> bytes) as a template. The
        same name and files always give the same key; doing it again is
        cheap. With ``image`` (a digest from :meth:`import_image`), the
        template's sessions run on that image's root filesystem, and its
        key is another than without."""
        self._check_open()
        name, checked = check_template_files(template, files)
        if image is None:
            return await trio.to_thread.run_sync(self._templates.store, self.name, name, checked)
        check_digest(image)

        def store() -> Template:
            with self._images.locked(exclusive=False):
                self._images.get(image)
                return self._templates.store(self.name, name, checked, image)

        return await trio.to_thread.run_sync(store)

    async def create(
        self,
        *,
        template: str | None = None,
        state: Mapping | None = None,
        workspace: str | os.PathLike[str] | None = None,
        snapshot: Snapshot | Mapping | str | None = None,
        network: object = "deny-all",
        idle_timeout: float | None = None,
        destroy_on_close: bool = False,
        destroy_on_idle: bool = False,
        retention: float | None = None,
        mounts: Sequence[Mount] = (),
        confinement: Confinement | None = None,
        image: str | None = None,
    ) -> SessionHandle:
        """Start a session: a new one from ``template`` (a key from
        :meth:`prewarm`), a new one over the host directory ``workspace``, a
        new one whose workspace starts as ``snapshot`` (see
        :meth:`SessionHandle.snapshot`), or a stopped one again from its
        ``state`` (with the same template). The network policy is given
        every time; it is never stored.

        After ``idle_timeout`` seconds without activity (a command starting
        or ending, a file operation, a gateway request; a running command
        keeps it alive however long it runs) the session is closed like
        :meth:`SessionHandle.aclose`: stopped and resumable, or deleted with
        ``destroy_on_close``; ``destroy_on_idle`` deletes it then in any case.

        ``retention`` (seconds) is how long a new session is kept once it is
        stopped: by its handle, or because its owner died. After that a
        backend over this state directory deletes it (see
        :meth:`Backend.collect_expired`). It is stored with the session; the
        default keeps a stopped session for ever.

        ``mounts`` binds extra host paths into a new session (see
        :class:`~sandboxns.Mount`); they are stored with it and bound again
        when it is resumed. So is ``confinement``, the session's rlimits,
        /tmp size, seccomp filter and workspace size cap (see
        :class:`~sandboxns.Confinement`); a session over a host directory
        cannot have a workspace size cap.

        ``image`` (a digest from :meth:`import_image`) makes a new session
        over ``workspace`` run on that image's root filesystem instead of
        the host's runtime trees, with the image's Env as its default
        environment. A session from a template or snapshot runs on theirs
        (see :meth:`prewarm`), and a resumed one on its own: ``image``, if
        given there, must name the same."""
        self._check_open()
        if image is not None:
            check_digest(image)
        policy = check_network_policy(network)
        extra = check_mounts(mounts)
        if confinement is not None and state is not None:
            raise invalid_argument("confinement is given when a session is created; a resumed session keeps its own")
        confinement = check_confinement(confinement)
        if confinement.workspace_size is not None:
            if workspace is not None:
                raise invalid_argument(
                    "workspace_size caps the storage a backend makes for a session from a template; a host "
                    "directory given as workspace= is never resized, so it cannot be capped"
                )
            require_workspace_cap_support()
        for mount in extra:
            self._refuse_state_overlap(Path(mount.host), "mount")
        if extra and state is not None:
            raise invalid_argument("mounts are given when a session is created; a resumed session keeps its own")
        if retention is not None and state is not None:
            raise invalid_argument("retention is given when a session is created; a resumed session keeps its own")
        lifetime = Lifetime.checked(idle_timeout, destroy_on_close, destroy_on_idle, retention)
        if snapshot is not None:
            if template is not None or workspace is not None or state is not None:
                raise invalid_argument("give snapshot= alone: its session's workspace starts as the snapshot")
            handle = await self._create_from_snapshot(snapshot_id_of(snapshot), policy, extra, confinement, image)
        elif state is not None:
            handle = await self._resume(state, template, workspace, policy, image)
        elif workspace is not None:
            if template is not None:
                raise invalid_argument("give either template= or workspace=, not both")
            handle = await self._create_bound(workspace, policy, extra, confinement, image)
        elif template is None:
            raise invalid_argument("create() needs template=, workspace= or state=")
        else:
            key = check_key(template)
            if image is not None and image != await trio.to_thread.run_sync(self._templates.image_of, key):
                raise invalid_argument(
                    f"template {key} runs on the image it was prewarmed with, not {image}; give that one or none"
                )
            handle = await self._create_from_template(key, policy, extra, confinement)
        await self._hand_over(handle, lifetime)
        return handle

    async def _hand_over(self, handle: SessionHandle, lifetime: Lifetime) -> None:
        """Give a session just made (or taken from a pool) its lifetime."""
        if lifetime.retention is not None:
            try:
                await trio.to_thread.run_sync(handle._retain, lifetime.retention)
            except BaseException:
                await handle.delete()  # nobody has seen it yet
                raise
        handle.destroy_on_close = lifetime.destroy_on_close
        handle.destroy_on_idle = lifetime.destroy_on_idle
        handle.session.touch()  # a pooled session may have waited a long time
        if lifetime.idle_timeout is not None:
            await self._nursery.start(handle._watch_idleness, lifetime.idle_timeout)

    async def _create_from_template(
        self, key: str, policy: NetworkPolicy, mounts: tuple[Mount, ...], confinement: Confinement
    ) -> SessionHandle:
        if self._pool_serves(key, mounts, confinement):
            with self._pools.taking(key, 1) as taken:
                (handle,) = taken
            if policy != DENY_ALL:  # pooled sessions wait with no network at all
                try:
                    await handle.session.set_network_policy(policy)
                except BaseException:
                    await handle.delete()
                    raise
            return handle
        return await self._create_fresh(key, policy, mounts, confinement)

    async def _create_fresh(
        self,
        key: str,
        policy: NetworkPolicy,
        mounts: tuple[Mount, ...] = (),
        confinement: Confinement = DEFAULT_CONFINEMENT,
        *,
        layer_stores: bool = False,
    ) -> SessionHandle:
        if not self._templates.exists(key):
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no template {key} in {self.state_directory}")
        layout = "overlay" if self._overlay else "copy"
        description = new_description(self.name, key, layout, mounts, confinement)
        image = await trio.to_thread.run_sync(self._templates.image_of, key)
        if image is not None:
            description["image"] = image
        session_dir = await self._make_session_dir(description, confinement)
        return await self._attach(session_dir, description, confinement, policy, new=True, layer_stores=layer_stores)

    async def _create_from_snapshot(
        self,
        snapshot_id: str,
        policy: NetworkPolicy,
        mounts: tuple[Mount, ...],
        confinement: Confinement,
        image: str | None = None,
    ) -> SessionHandle:
        """A new session over a snapshot: an empty upper layer over its
        layers, or (without an overlay) a copy of it. The session's record
        is written under the store's lock, so the snapshot cannot be deleted
        from under it (one from the fork pool may have mounted the layers by
        then; it is deleted if the snapshot is gone)."""
        layout = "overlay" if self._overlay else "copy"
        if self._pool_serves(FORK_POOL, mounts, confinement):
            snapshot = await trio.to_thread.run_sync(self._read_own_snapshot, snapshot_id)
            _check_snapshot_image(snapshot, image)
            handed_out = await self._hand_out_forks(snapshot, 1, policy, mounts, confinement)
            if handed_out:
                return handed_out[0]

        def make() -> tuple[Path, dict]:
            with self._snapshots.locked():
                stored = self._own_snapshot(snapshot_id)
                _check_snapshot_image(stored, image)
                description = new_description(self.name, stored.template, layout, mounts, confinement)
                description["snapshot"] = stored.id
                if stored.image is not None:
                    description["image"] = stored.image
                if layout == "overlay":
                    description["layers"], description["on_template"] = list(stored.layers), stored.on_template
                return self._make_session_dir_now(description, confinement), description

        session_dir, description = await trio.to_thread.run_sync(make)
        return await self._attach(session_dir, description, confinement, policy, new=True)

    def _own_snapshot(self, snapshot_id: str) -> Snapshot:
        """A stored snapshot of this backend's (another's is
        SANDBOX_STATE_MISMATCH); the caller holds the store's lock."""
        snapshot = self._snapshots.read(snapshot_id)
        if snapshot.backend != self.name:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"snapshot {snapshot_id} belongs to backend {snapshot.backend!r}, not {self.name!r}",
            )
        return snapshot

    def _read_own_snapshot(self, snapshot_id: str) -> Snapshot:
        with self._snapshots.locked():
            return self._own_snapshot(snapshot_id)

    def _pool_serves(self, key: str, mounts: Sequence[Mount], confinement: Confinement) -> bool:
        """Whether the pool ``key`` has a session ready that can serve
        these: pooled sessions have no mounts and the default confinement
        (and the fork pool's an overlay workspace)."""
        if not self._pools.waiting(key) or mounts or confinement != DEFAULT_CONFINEMENT:
            return False
        return key != FORK_POOL or self._overlay

    async def _hand_out_forks(
        self, snapshot: Snapshot, n: int, policy: NetworkPolicy, mounts: Sequence[Mount], confinement: Confinement
    ) -> list[SessionHandle]:
        """Up to ``n`` sessions of the fork pool (as many as are ready, none
        unless it serves ``mounts`` and ``confinement``), standing on
        ``snapshot`` with ``policy``. One whose holder cannot take the
        layers is deleted and left out (the caller starts one afresh);
        should one fail otherwise, none is handed out."""
        if not self._pool_serves(FORK_POOL, mounts, confinement) or snapshot.image is not None:
            return []  # (the pool's sessions run on the host's trees)
        taken: list[SessionHandle] = []

        async def hand_out(handle: SessionHandle) -> None:
            try:
                if await self._stand_on_snapshot(handle, snapshot):
                    if policy != DENY_ALL:  # pooled sessions wait with no network at all
                        await handle.session.set_network_policy(policy)
                    taken.append(handle)
                    return
            except BaseException:
                with trio.CancelScope(shield=True):
                    await handle.delete()
                raise
            await handle.delete()

        with self._pools.taking(FORK_POOL, n) as handles:
            try:
                await _together(*(functools.partial(hand_out, handle) for handle in handles))
            except BaseException:
                with trio.CancelScope(shield=True):
                    for handle in taken:
                        await handle.delete()
                raise
        return taken

    async def _stand_on_snapshot(self, handle: SessionHandle, snapshot: Snapshot) -> bool:
        """Give a session of the fork pool a snapshot (one this backend made
        or read from its store): its holder mounts the layers over its
        workspace, in the upper and work directories that waited empty
        beside its blank ones (see _start_driver), while its record is
        written (under the store's lock, as a new session's, and only if the
        snapshot is still there). False if the holder
        cannot; then, or on a failure, the caller deletes the session. From
        here on the session is the snapshot's; its blank directories go with
        its next snapshot."""
        description, storage = handle._description, handle._dir
        description.update(
            template=snapshot.template,
            snapshot=snapshot.id,
            layers=list(snapshot.layers),
            on_template=snapshot.on_template,
        )
        handle.template_key = snapshot.template

        def record() -> None:
            with self._snapshots.locked():
                self._own_snapshot(snapshot.id)  # still there: not being deleted from under it
                write_description(storage, description)

        layers = [f"s/{layer}" for layer in snapshot.layers] + (
            [f"t/{snapshot.template}"] if snapshot.on_template else []
        )
        _, taken = await _together(
            functools.partial(trio.to_thread.run_sync, record),
            functools.partial(
                handle._driver.take_layers, ["workspace", "overlay-work", *layers], self._lower_layers(description)
            ),
        )
        return taken

    async def _create_bound(
        self,
        workspace: str | os.PathLike[str],
        policy: NetworkPolicy,
        mounts: tuple[Mount, ...],
        confinement: Confinement,
        image: str | None,
    ) -> SessionHandle:
        if not isinstance(workspace, (str, os.PathLike)):
            raise invalid_argument(f"workspace must be a path, not {type(workspace).__name__}")
        path = Path(workspace).resolve()
        if not path.is_dir():
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"workspace {path} is not a directory")
        self._refuse_state_overlap(path, "workspace")
        description = new_description(self.name, None, "bound", mounts, confinement)
        description["workspace"] = str(path)
        if image is not None:
            description["image"] = image
        session_dir = await self._make_session_dir(description, confinement)
        return await self._attach(session_dir, description, confinement, policy, new=True)

    def _refuse_state_overlap(self, path: Path, what: str) -> None:
        state = self.state_directory.resolve()
        if path == state or state in path.parents or path in state.parents:
            raise SandboxError(
                ErrorCode.SANDBOX_PATH_REFUSED,
                f"{what} {path} overlaps the state directory {state}; a guest must never reach it",
            )

    async def _make_session_dir(self, description: dict, confinement: Confinement) -> Path:
        return await trio.to_thread.run_sync(self._make_session_dir_now, description, confinement)

    def _make_session_dir_now(self, description: dict, confinement: Confinement) -> Path:
        """Create a session directory under a temporary name and rename it
        into place, so no half-made session is ever visible. A capped
        session's workspace directory is in its image. Runs in a worker
        thread."""
        staging = self._sessions / f".new-{description['session']}"
        image = description.get("image")
        # An image is not deleted from under a session about to run on it (see delete_image).
        with self._images.locked(exclusive=False) if image else contextlib.nullcontext():
            if image:
                self._images.get(image)
            staging.mkdir(mode=0o700, parents=True)
            with contextlib.ExitStack() as on_failure:
                on_failure.callback(remove_tree, staging)
                if confinement.workspace_size is None:
                    (staging / "workspace").mkdir(mode=0o755)
                else:
                    WorkspaceImage(staging).create(confinement.workspace_size, "workspace")
                write_description(staging, description)
                final = self._sessions / description["session"]
                os.rename(staging, final)
                on_failure.pop_all()
        return final

    async def _resume(
        self, state: object, template: object, workspace: object, policy: NetworkPolicy, image: str | None
    ) -> SessionHandle:
        if not isinstance(state, Mapping):
            raise invalid_argument(f"state must be the dict capture_state() returned, not {type(state).__name__}")
        if state.get("format") != STATE_FORMAT or not isinstance(state.get("session"), str):
            raise invalid_argument("state is not a sandboxns session descriptor (see capture_state())")
        session_id = state["session"]
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise invalid_argument(f"state names an invalid session id {session_id!r}")
        if state.get("backend") != self.name:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"session {session_id} belongs to backend {state.get('backend')!r}, not {self.name!r}",
            )
        if template != state.get("template"):
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"session {session_id} was made from template {state.get('template')!r}, not {template!r}",
            )
        session_dir = self._sessions / session_id
        description = read_description(self.state_directory, session_id)
        if description.get("backend") != self.name or description.get("template") != state.get("template"):
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"state does not match session {session_id}")
        if workspace is not None and Path(workspace).resolve() != Path(description.get("workspace", "")):
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"session {session_id} is bound to {description.get('workspace') or 'its own workspace'}",
            )
        if image is not None and image != description.get("image"):
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"session {session_id} runs on {description.get('image') or 'the host'}, not {image}",
            )
        confinement = Confinement.from_dict(description.get("confinement", {}))
        if confinement.workspace_size is not None:
            require_workspace_cap_support()  # this host may not be the one that made it
        return await self._attach(session_dir, description, confinement, policy, new=False)

    async def _attach(
        self,
        session_dir: Path,
        description: dict,
        confinement: Confinement,
        policy: NetworkPolicy,
        *,
        new: bool,
        layer_stores: bool = False,
    ) -> SessionHandle:
        """Take the lease, mount a capped session's image, and start the
        session's sandbox (and its gateway, for an allow-list policy)."""
        async with contextlib.AsyncExitStack() as on_failure:
            if new:
                on_failure.push_async_callback(trio.to_thread.run_sync, remove_tree, session_dir)
            image = None
            if "image" in description:
                image = await trio.to_thread.run_sync(self._session_image, description)
            lease = await Lease.acquire(session_dir, self.state_directory)
            on_failure.callback(lease.release)
            workspace_image = None
            if confinement.workspace_size is not None:
                # In the host's mount namespace, before the sandbox starts:
                # the drivers and the host's file API see only directories.
                workspace_image = WorkspaceImage(session_dir)
                await trio.to_thread.run_sync(workspace_image.mount)
                on_failure.push_async_callback(unmount_image, workspace_image)
            if "pending_snapshot" in description:
                # Its owner died taking a snapshot: finish or undo that first.
                storage = storage_root(session_dir, confinement)
                await trio.to_thread.run_sync(self._settle_snapshot, session_dir, description, storage)
            # A gateway request counts as the session's activity. Only the
            # guest reaches the gateway, and no guest runs before the
            # handle below exists.
            network = SessionNetwork(
                self._hub, self._nursery, description["session"], on_request=lambda: handle.session.touch()
            )
            on_failure.push_async_callback(network.aclose)
            gateway = await network.prepare(policy)
            driver = await self._start_driver(
                session_dir, description, confinement, policy, lease, gateway, new=new, layer_stores=layer_stores
            )
            on_failure.pop_all()
        session = Session(driver, self._slots, network)
        if image is not None:
            session.environment = session_environment(image, DEFAULT_ENV, GATEWAY_ENVIRONMENT)
        handle = SessionHandle(
            self,
            session_dir,
            description,
            session=session,
            lease=lease,
            network=network,
            workspace_image=workspace_image,
        )
        self._live.add(handle)
        return handle

    async def _start_driver(
        self,
        session_dir: Path,
        description: dict,
        confinement: Confinement,
        policy: NetworkPolicy,
        lease: Lease,
        gateway: GatewayEndpoint | None,
        *,
        new: bool,
        layer_stores: bool = False,
    ):
        layout = description["layout"]
        storage = storage_root(session_dir, confinement)
        workspace = Path(description["workspace"]) if layout == "bound" else storage / "workspace"
        # A symlink swapped in since a path was stored (the guest of a
        # session bound to a directory above it can write some of these
        # trees) must not redirect a bind to another host path: the
        # workspace is checked here, the mounts once the plan has resolved
        # them.
        if layout == "bound":
            if workspace.resolve() != workspace:
                raise SandboxError(
                    ErrorCode.SANDBOX_PATH_REFUSED,
                    f"workspace {workspace} now leads to {workspace.resolve()}; refusing to bind it",
                )
            self._refuse_state_overlap(workspace, "workspace")
        overlay = None
        if layout == "overlay":
            scratch = storage / "overlay-work"
            # overlayfs wants its work directory empty of a previous mount's
            # leftovers, some of which it makes mode 000.
            await trio.to_thread.run_sync(remove_tree, scratch)
            scratch.mkdir(mode=0o700)
            stores = None
            if layer_stores:
                # Started ahead for a fork: it waits on a blank stack in the
                # directories a snapshot's upper layer goes on with, so that
                # the fork's own, these, are ready when it is handed out.
                workspace, scratch = storage / NEXT_UPPER, storage / NEXT_WORK
                for directory in (workspace, scratch):
                    directory.mkdir(mode=0o755 if directory == workspace else 0o700)
                stores = (self._templates.root, self._snapshots.root)
            overlay = Overlay(tuple(self._lower_layers(description)), scratch, stores)
        elif layout == "copy" and new:
            await self._fill(description, workspace)
        stored_mounts = description.get("mounts", [])
        plan = StartPlan(
            workspace,
            network=policy,
            mounts=[Mount(**mount) for mount in stored_mounts],
            # The cap is the mount made before; the driver sees a directory.
            confinement=dataclasses.replace(confinement, workspace_size=None),
            image_root=self._images.root_of(description["image"]) if "image" in description else None,
            overlay=overlay,
            gateway=gateway,
            lease=lease,
        )
        for stored, mount in zip(stored_mounts, plan.mounts, strict=True):
            if mount.host != stored["host"]:
                raise SandboxError(
                    ErrorCode.SANDBOX_PATH_REFUSED,
                    f"mount source {stored['host']} now leads to {mount.host}; refusing to bind it",
                )
            self._refuse_state_overlap(Path(mount.host), "mount")
        try:
            return await self._driver_class.start(plan)
        except OverlayUnavailable:
            if not new:
                raise
        # This kernel cannot overlay here: remember, and copy this session's
        # template (or snapshot) into its workspace instead.
        self._overlay = False
        description["layout"] = "copy"
        description.pop("layers", None)
        description.pop("on_template", None)
        await trio.to_thread.run_sync(remove_tree, storage / "overlay-work")
        await self._fill(description, workspace)
        await trio.to_thread.run_sync(write_description, session_dir, description)
        return await self._driver_class.start(dataclasses.replace(plan, overlay=None))

    def _lower_layers(self, description: dict) -> list[Path]:
        """An overlay workspace's read-only layers, topmost first."""
        layers, on_template = stack_of(description)
        for snapshot_id in layers:
            if not self._snapshots.files_of(snapshot_id).is_dir():
                raise SandboxError(
                    ErrorCode.SANDBOX_STATE_MISMATCH,
                    f"session {description['session']} stands on snapshot {snapshot_id}, which is gone",
                )
        lowers = [self._snapshots.files_of(snapshot_id) for snapshot_id in layers]
        return lowers + ([self._templates.files_of(description["template"])] if on_template else [])

    async def _fill(self, description: dict, workspace: Path) -> None:
        """Copy a new session's starting files into its (copied) workspace:
        the snapshot it is made from, merged whole, or its template."""
        source = description.get("snapshot")

        def fill() -> None:
            if source is None:
                copy_tree(self._templates.files_of(description["template"]), workspace)
                return
            with self._snapshots.locked():  # not deleted while it is copied
                snapshot = self._snapshots.read(source)
                layers = [self._snapshots.files_of(snapshot_id) for snapshot_id in snapshot.layers]
                if snapshot.on_template:
                    layers.append(self._templates.files_of(snapshot.template))
                merge_layers(layers, workspace)

        try:
            await trio.to_thread.run_sync(fill)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            what = f"snapshot {source}" if source is not None else f"template {description['template']}"
            raise SandboxError(
                ErrorCode.SANDBOX_LIMIT, f"{what} does not fit in the session's workspace: {exc.strerror}"
            ) from None

    async def _take_snapshot(
        self,
        handle: SessionHandle,
        name: str | None,
        copy: bool,
        meanwhile: Callable[[Snapshot], Awaitable[None]] | None = None,
    ) -> Snapshot:
        """See :meth:`SessionHandle.snapshot`; the caller has the session to
        itself. ``meanwhile(snapshot)`` runs once the snapshot is whole in
        the store, while the session's holder goes over to it."""
        description = handle._description
        layout = description["layout"]
        if layout == "bound" and not copy:
            raise invalid_argument(
                f"session {handle.session_id} works on the host directory {description['workspace']}; a snapshot"
                " of it is a copy of that directory's files: pass copy=True to make one"
            )
        layers, on_template = stack_of(description)
        confinement = Confinement.from_dict(description.get("confinement", {}))
        if layout == "bound":
            # As at attach: a session bound above this one may have swapped
            # in a symlink, which must not make this copy another path's.
            workspace = Path(description["workspace"])
            if workspace.resolve() != workspace:
                raise SandboxError(
                    ErrorCode.SANDBOX_PATH_REFUSED,
                    f"workspace {workspace} now leads to {workspace.resolve()}; refusing to copy it",
                )
            self._refuse_state_overlap(workspace, "workspace")
        else:
            workspace = storage_root(handle._dir, confinement) / "workspace"
        snapshot_id = new_snapshot_id()
        known = {
            "id": snapshot_id,
            "name": name,
            "parent": description.get("snapshot"),
            "created": time.time(),
            "bytes": None,
            "backend": self.name,
            "template": description["template"],
            "image": description.get("image"),
        }
        freezing = _Freezing()
        # Once the upper layer under the holder's overlay has changed (moved
        # into the store, or emptied over a copy), the holder must go over
        # to the new stack, whatever happens: so this is shielded, and the
        # session is stopped should it fail before, for its next attach to
        # settle what its record says.
        with trio.CancelScope(shield=True):
            try:
                if layout == "overlay" and len(layers) + 1 + on_template <= MAX_STACK_DEPTH:
                    snapshot = Snapshot(**known, layers=(snapshot_id, *layers), on_template=on_template)
                    await trio.to_thread.run_sync(
                        self._freeze, handle._dir, description, workspace.parent, snapshot, freezing
                    )
                else:
                    # A whole copy: of a copied or bound workspace, or of a
                    # stack grown too deep, which then stands on the copy alone.
                    snapshot = Snapshot(**known, layers=(snapshot_id,), on_template=False)
                    sources = [workspace, *(self._lower_layers(description) if layout == "overlay" else [])]
                    await trio.to_thread.run_sync(self._store_copy, snapshot, sources)
                    description["snapshot"] = snapshot_id
                    if layout == "overlay":
                        freezing.upper_changed = True
                        await trio.to_thread.run_sync(self._stand_on_copy, handle, workspace)
                    else:
                        await trio.to_thread.run_sync(write_description, handle._dir, description)
                restack = None
                if layout == "overlay":
                    # In place only where the holder's handle on the upper
                    # layer is the layer now in the store: renamed there.
                    names = (workspace.name, "overlay-work") if freezing.renamed else None
                    restack = functools.partial(handle._driver.restack, names, self._lower_layers(description))
            except BaseException:
                if freezing.upper_changed:
                    await handle._stop_unsettled()
                raise
            await _together(restack, meanwhile and functools.partial(meanwhile, snapshot))
        return snapshot

    def _stand_on_copy(self, handle: SessionHandle, workspace: Path) -> None:
        """Put an overlay workspace's records over the whole copy just made
        of it, and empty its upper layer."""
        description = handle._description
        # The record first: should this process die before the upper layer
        # is emptied, what is left there is in the copy below too.
        description["layers"], description["on_template"] = [description["snapshot"]], False
        write_description(handle._dir, description)
        _empty_upper(workspace, self._snapshots.files_of(description["snapshot"]))

    def _store_copy(self, snapshot: Snapshot, sources: list[Path]) -> None:
        """Put a snapshot in the store whose layer is ``sources`` (topmost
        first) merged whole."""
        with self._snapshots.locked():
            files = self._snapshots.begin(snapshot)
            try:
                files.mkdir(mode=0o700)
                merge_layers(sources, files)
                self._snapshots.commit(snapshot.id)
            except BaseException:
                self._snapshots.abandon(snapshot.id)
                raise

    def _freeze(
        self, session_dir: Path, description: dict, storage: Path, snapshot: Snapshot, freezing: _Freezing
    ) -> None:
        """An overlay workspace's snapshot, on the host's side, while no one
        writes through its upper layer (the holder's overlay, still standing
        on it, is put on the new stack afterwards): the snapshot's record in
        the store's staging area; the session's record saying a snapshot is
        under way ("pending_snapshot"), so that a process dying at any point
        leaves what the next attach finishes or undoes (_settle_snapshot);
        new upper and work directories beside the upper layer in
        ``storage``; the upper layer into the store (one rename), and the
        session settled on it. ``freezing`` says how far it got."""
        with self._snapshots.locked():
            self._snapshots.begin(snapshot)
            try:
                description["pending_snapshot"] = snapshot.id
                write_description(session_dir, description)
                for name in (NEXT_UPPER, NEXT_WORK, OLD_WORK):
                    remove_tree(storage / name)
                for name in (NEXT_UPPER, NEXT_WORK):
                    (storage / name).mkdir(mode=0o700)
                os.chmod(storage / NEXT_UPPER, stat.S_IMODE(os.stat(storage / "workspace").st_mode))
                freezing.upper_changed = True
                freezing.renamed = move_tree(storage / "workspace", self._snapshots.staging(snapshot.id) / "files")
                self._snapshots.commit(snapshot.id)
            finally:  # finished, or undone
                self._settle_snapshot_locked(session_dir, description, storage)

    def _settle_snapshot(self, session_dir: Path, description: dict, storage: Path) -> None:
        with self._snapshots.locked():
            self._settle_snapshot_locked(session_dir, description, storage)

    def _settle_snapshot_locked(self, session_dir: Path, description: dict, storage: Path) -> None:
        """Finish or undo the snapshot a session's record says is under way:
        finished once its layer is whole in the store (the session then
        stands on it, over an empty upper layer), undone otherwise (the
        upper layer never left)."""
        snapshot_id = description.pop("pending_snapshot")
        store = self._snapshots
        if not store.exists(snapshot_id) and (store.staging(snapshot_id) / "files").is_dir():
            store.commit(snapshot_id)
        upper, work = storage / "workspace", storage / "overlay-work"
        if store.exists(snapshot_id):
            layers, on_template = stack_of(description)
            description["layers"], description["on_template"] = [snapshot_id, *layers], on_template
            description["snapshot"] = snapshot_id
            # What is left of the old upper layer is in the store by now.
            remove_tree(upper)
            if (storage / NEXT_UPPER).is_dir():
                os.rename(storage / NEXT_UPPER, upper)
                if (storage / NEXT_WORK).is_dir():
                    # The holder's overlay works in it until it is put on
                    # the new stack: removed by the next snapshot.
                    remove_tree(storage / OLD_WORK)
                    if work.is_dir():
                        os.rename(work, storage / OLD_WORK)
                    os.rename(storage / NEXT_WORK, work)
            else:
                _empty_upper(upper, store.files_of(snapshot_id))
        else:
            store.abandon(snapshot_id)
            remove_tree(storage / NEXT_UPPER)
        remove_tree(storage / NEXT_WORK)
        write_description(session_dir, description)

    async def snapshots(self) -> list[Snapshot]:
        """Every snapshot in the state directory, oldest first."""
        self._check_open()
        return await trio.to_thread.run_sync(self._snapshots.all)

    async def delete_snapshot(self, snapshot: Snapshot | Mapping | str) -> None:
        """Delete a snapshot: SANDBOX_BUSY while a session (stopped or not)
        or another snapshot stands on it, SANDBOX_NOT_FOUND if there is
        none. Sessions made from it by copy do not need it."""
        self._check_open()
        await trio.to_thread.run_sync(delete_snapshot, self.state_directory, snapshot_id_of(snapshot))

    def audit_records(self, buffer: int = 1000):
        """An async context manager giving a stream of the gateway's audit
        records (:class:`~sandboxns.AuditRecord`) from now on; see
        :meth:`GatewayHub.audit_records`."""
        return self._hub.audit_records(buffer)

    async def pool(self, *, template: str, size: int) -> None:
        """Keep ``size`` sessions of ``template`` started and waiting, so that
        ``create(template=...)`` hands one out at once (applying the network
        policy given then) and a new one is started in the background.
        Returns once the pool is full; ``size=0`` empties it. Sessions never
        handed out are deleted when the backend closes."""
        self._check_open()
        key = check_key(template)
        if not self._templates.exists(key):
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no template {key} in {self.state_directory}")
        await self._pools.fill(key, size, functools.partial(self._create_fresh, key, DENY_ALL))

    async def pool_forks(self, *, size: int) -> None:
        """Keep ``size`` sessions started ahead for ``create(snapshot=...)``
        and :meth:`SessionHandle.fork`: one handed out takes the snapshot's
        layers in place (its holder mounts them over its workspace), so a
        fork costs no session start; a new one starts in the background.
        Needs the native driver's overlays (SANDBOX_UNAVAILABLE elsewhere);
        a fork with mounts or a confinement of its own starts afresh, as
        does one on a kernel before 6.13. Returns once the pool is full;
        ``size=0`` empties it. Sessions never handed out are deleted when
        the backend closes."""
        self._check_open()
        if not self._overlay:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"the {self.name} driver copies workspaces here: no session can take a snapshot's layers in place",
            )
        blank = await self.prewarm(template="sandboxns-fork-pool", files={})
        make = functools.partial(self._create_fresh, blank.template_key, DENY_ALL, layer_stores=True)
        await self._pools.fill(FORK_POOL, size, make)

    async def collect_expired(self) -> list[str]:
        """Delete the stopped sessions of the state directory (this
        backend's or another process's) that were created with a retention
        and have been stopped for longer; returns their ids. A session
        somebody holds is never touched. :func:`open_backend` does this as
        it opens, and every RETENTION_SWEEP_INTERVAL seconds while open."""
        self._check_open()
        for handle in self._live:
            if handle.retention is not None:
                handle._lease.refresh()  # alive now, should this process die (see _lease)
        return await trio.to_thread.run_sync(delete_expired_sessions, self.state_directory)

    async def _collect_periodically(self) -> None:
        with self._sweeping:
            while True:
                await trio.sleep(RETENTION_SWEEP_INTERVAL)
                try:
                    await self.collect_expired()
                except Exception:  # runs in the backend's nursery, which must not die of it
                    logger.exception("deleting expired sessions in %s failed", self.state_directory)

    async def aclose(self) -> None:
        """Shut down every session this backend still runs, and delete the
        pooled ones nobody was given."""
        self._closed = True
        self._sweeping.cancel()
        await self._pools.aclose()
        for handle in list(self._live):
            await handle.shutdown()


def _check_limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENT_COMMANDS_LIMIT:
        raise invalid_argument(
            f"max_concurrent_commands must be an integer from 1 to {MAX_CONCURRENT_COMMANDS_LIMIT}, not {value!r}"
        )
    return value


@asynccontextmanager
async def open_backend(
    *,
    driver: str = "native",
    state_directory: str | os.PathLike[str],
    max_concurrent_commands: int = DEFAULT_MAX_CONCURRENT_COMMANDS,
    on_broker_error: Callable[[BaseException], object] | None = None,
    upstream_ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[Backend]:
    """A backend over ``state_directory`` (created if missing) for as long
    as the block runs; sessions still live at its end are shut down (their
    files stay). Stopped sessions past their retention are deleted as it
    opens and every RETENTION_SWEEP_INTERVAL seconds. ``on_broker_error``
    receives the egress gateway's internal errors; ``upstream_ssl_context``
    verifies its https upstreams (default: the system's trust store)."""
    driver_class(driver)
    limit = _check_limit(max_concurrent_commands)
    if on_broker_error is not None and not callable(on_broker_error):
        raise invalid_argument("on_broker_error must be a callable or None")
    if not isinstance(state_directory, (str, os.PathLike)) or not str(state_directory):
        raise invalid_argument(f"state_directory must be a path, not {state_directory!r}")
    root = Path(state_directory).absolute()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for part in ("templates", "sessions", "snapshots"):
            (root / part).mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"cannot use state directory {root}: {exc}") from None
    if upstream_ssl_context is not None and not isinstance(upstream_ssl_context, ssl.SSLContext):
        raise invalid_argument("upstream_ssl_context must be an ssl.SSLContext or None")
    async with service_nursery() as nursery:
        backend = Backend(driver, root, limit, GatewayHub(upstream_ssl_context, on_broker_error), nursery)
        try:
            await backend.collect_expired()  # those that expired while no backend ran
            await trio.to_thread.run_sync(sweep_snapshot_store, root)
            nursery.start_soon(backend._collect_periodically)
            yield backend
        finally:
            await backend.aclose()
