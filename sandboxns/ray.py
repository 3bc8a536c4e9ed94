"""Sessions across a Ray cluster: one backend per node, sessions placed on
the least loaded.

Install with ``pip install 'sandboxns[ray]'``. Each Ray node that declares
the custom resource ``sandboxns`` (``ray start --resources
'{"sandboxns": 1}'``) gets one actor, pinned to it, which owns an ordinary
backend (:func:`sandboxns.open_backend`) over that node's own state
directory. :func:`open_cluster` finds those nodes (and those that join
later) and places each new session on the one with the fewest commands
running, then the fewest sessions; a :class:`RemoteSessionHandle` then
reaches its session through its node's actor, with the surface of a local
handle.

Nothing here is a cluster manager: Ray schedules the actors, and reports a
node that is gone; its sessions' calls then fail with SANDBOX_UNAVAILABLE
naming the node, and new sessions go elsewhere.

The actor runs trio in a thread of its own (as :mod:`sandboxns.blocking`
does) and serves calls from a few threads of Ray's; it takes no CPU of the
node's (its sandboxes are processes Ray does not schedule). The trio run
that opened the cluster sends its sessions' hot calls (commands, file
operations, coding tools') over a direct channel to each node instead
(see _channel: a Ray call costs about what a command does); other calls,
and other trio runs' calls, are Ray calls, awaited without blocking the
event loop. Synchronous code, Ray tasks' included, uses
:class:`BlockingCluster`.

Credentials: a network policy's header values travel in the arguments of
the call that applies them, to that node's actor alone, and always as a
Ray call. Ray passes small arguments (under its 100 KiB
``max_direct_call_object_size``) inline in the task message, never through
its object store, so they are never spilled to disk; they are not kept
with the actor's constructor arguments (which Ray stores to restart an
actor), and no error message here includes them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import ray
import trio
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import _coding_files
from ._backend import DEFAULT_MAX_CONCURRENT_COMMANDS, Backend, open_backend
from ._channel import TOKEN_BYTES, Channel, ChannelClosed, ChannelListener
from ._coding import WORKSPACE_OPERATIONS, CapturedCommand, CapturedRun, WorkspaceTarget
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._files import DirEntry, HostWorkspaceIO
from ._rootfs_images import Image
from ._session import RunResult
from ._snapshots import Snapshot
from ._templates import Template
from .blocking import _Portal, _refuse_trio_caller

__all__ = [
    "RESOURCE",
    "BlockingCluster",
    "BlockingRemoteHandle",
    "BlockingRemoteSession",
    "Cluster",
    "RemoteSession",
    "RemoteSessionHandle",
    "open_blocking_cluster",
    "open_cluster",
]

logger = logging.getLogger("sandboxns.ray")

# The custom resource a node declares to host sandboxes; each node's actor
# takes all of one, so a node has one backend.
RESOURCE = "sandboxns"
# In a node's state directory: the id of the backends over it.
BACKEND_ID_FILE = "ray-backend-id"
# How often, at most, a placement looks for nodes that joined or left.
NODE_REFRESH_SECONDS = 1.0
# Threads serving one actor's calls at once: its commands, file operations
# and lifecycle calls (Ray starts them all up front).
ACTOR_CONCURRENCY = 32
# What a session's remote handle may call on the actor.
_SESSION_CALLS = frozenset(
    {
        "run",
        "read_file",
        "read_text_file",
        "write_file",
        "write_text_file",
        "list_dir",
        "remove",
        "mkdir",
        "set_network_policy",
    }
)
# What a trio caller calls over its direct channel to the node (the rest of
# a session's calls, and all from other callers, are Ray calls).
_CHANNEL_SESSION_CALLS = _SESSION_CALLS - {"set_network_policy"}
# What coding tools on the caller's side may call (see WorkspaceTarget).
_CODING_CALLS = frozenset({"environment", "run_probe", "network_state", "workspace_call", "execute"})
_ENDING_CALLS = frozenset({"stop", "shutdown", "delete"})
# How long a cancelled call waits for its node to end what it started (a
# command: SIGTERM, its grace, SIGKILL) before the cancellation goes on.
CANCEL_WAIT_SECONDS = 10.0
# Cancellations a node keeps for calls that have not reached it yet (calls
# and cancellations may arrive in either order on a threaded actor).
EARLY_CANCELS_KEPT = 1024
# Threads of the actor kept for its quick calls (load, describe, cancel,
# channel), so that long commands filling the others never delay them.
CONTROL_CONCURRENCY = 4
# How long a new backend may take to answer before it is given up (a node
# whose resource is still held, a node that left meanwhile).
BACKEND_START_SECONDS = 60.0
# How long opening a direct channel may take, and how long after a node's
# channel could not be opened its calls go through Ray before trying again.
CHANNEL_CONNECT_SECONDS = 5.0
CHANNEL_RETRY_SECONDS = 60.0
# Exceptions of the coding tools' file functions that the tools handle
# themselves; any other failure on a node comes back as SANDBOX_UNAVAILABLE.
_PASSED_THROUGH = (_coding_files.StaleError, _coding_files.SearchTimeout)
_HANDLE_CALLS = _ENDING_CALLS | {"snapshot"}


class NodeBackend:
    """The actor on one node: a backend over the node's state directory,
    served from a trio thread, and the sessions it made, by id."""

    def __init__(self, state_directory: str, driver: str, max_concurrent_commands: int) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        options = {
            "driver": driver,
            "state_directory": state_directory.replace("{node_id}", self.node_id),
            "max_concurrent_commands": max_concurrent_commands,
        }
        self._host = ray.util.get_node_ip_address()
        self._token = secrets.token_bytes(TOKEN_BYTES)
        listener = ChannelListener(self._token, _ChannelCalls(self).dispatch)
        self._portal = _Portal(lambda: _serving(options, self._host, listener.serve))
        self._backend, self._port = self._portal.value
        self.backend_id = _backend_identity(Path(self._backend.state_directory))
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        # Calls under way that the caller may cancel, by call id; and the
        # ids cancelled before their call arrived.
        self._cancel_scopes: dict[str, trio.CancelScope] = {}
        self._early_cancels: collections.OrderedDict[str, None] = collections.OrderedDict()

    @ray.method(concurrency_group="control")
    def describe(self) -> tuple[str, int, str]:
        return self.node_id, os.getpid(), self.backend_id

    @ray.method(concurrency_group="control")
    def channel(self) -> tuple[str, int, bytes]:
        """Where and how to reach this backend directly (see _channel)."""
        return self._host, self._port, self._token

    @ray.method(concurrency_group="control")
    def load(self) -> tuple[int, int, int]:
        """(commands running, sessions live, the admission limit)."""
        with self._lock:
            live = sum(1 for handle in self._handles.values() if handle.live)
        return self._backend.active_commands, live, self._backend.max_concurrent_commands

    def prewarm(self, template: str, files: Mapping[str, bytes], image: str | None) -> Template:
        return self._portal.call(self._backend.prewarm, template=template, files=files, image=image)

    def import_image(self, path: str) -> Image:
        return self._portal.call(self._backend.import_image, path)

    def pool(self, template: str, size: int) -> None:
        self._portal.call(self._backend.pool, template=template, size=size)

    def pool_forks(self, size: int) -> None:
        self._portal.call(self._backend.pool_forks, size=size)

    def create(self, options: Mapping[str, Any]) -> dict:
        state = options.get("state")
        if state is not None:
            if state.get("backend_id", self.backend_id) != self.backend_id:
                raise SandboxError(
                    ErrorCode.SANDBOX_STATE_MISMATCH,
                    f"session {state.get('session')} is not of this node's backend ({self.backend_id})",
                )
            options = {**options, "state": {key: value for key, value in state.items() if key != "backend_id"}}
        handle = self._portal.call(self._backend.create, **options)
        with self._lock:
            self._handles[handle.session_id] = handle
        return self._describe(handle)

    def fork(self, session_id: str, n: int, options: Mapping[str, Any]) -> list[dict]:
        forks = self._portal.call(self._handle(session_id).fork, n, **options)
        with self._lock:
            for handle in forks:
                self._handles[handle.session_id] = handle
        return [self._describe(handle) for handle in forks]

    def session_call(
        self, call_id: str, session_id: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        return self._cancellable(call_id, self._session_method(session_id, name, _SESSION_CALLS), *args, **kwargs)

    def coding_call(self, call_id: str, session_id: str, name: str, args: Sequence[Any]) -> Any:
        """A WorkspaceTarget method of the session, for coding tools whose
        authorization hooks run on the caller's side."""
        return self._cancellable(call_id, self._coding_method(session_id, name, args), *args)

    def _session_method(self, session_id: str, name: str, allowed: frozenset[str]) -> Callable[..., Any]:
        if name not in allowed:
            raise invalid_argument(f"{name!r} is not a session call here")
        return getattr(self._handle(session_id).session, name)

    def _coding_method(self, session_id: str, name: str, args: Sequence[Any]) -> Callable[..., Any]:
        if name not in _CODING_CALLS:
            raise invalid_argument(f"{name!r} is not a coding call")
        if name == "workspace_call" and (not args or args[0] not in WORKSPACE_OPERATIONS):
            raise invalid_argument("a workspace_call names a workspace operation of the coding tools")
        handle = self._handle(session_id)
        if not isinstance(handle.session.driver, HostWorkspaceIO):
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "this sandbox has no workspace binding for coding tools")
        return getattr(WorkspaceTarget(handle, handle.session), name)

    @ray.method(concurrency_group="control")
    def cancel(self, call_id: str) -> None:
        """Cancel a call (its command is ended as a local cancellation ends
        it), or the call when it arrives."""
        with self._lock:
            scope = self._cancel_scopes.get(call_id)
            if scope is None:
                self._early_cancels[call_id] = None
                while len(self._early_cancels) > EARLY_CANCELS_KEPT:
                    self._early_cancels.popitem(last=False)
                return
        self._portal.call_sync(scope.cancel)

    def handle_call(self, session_id: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if name not in _HANDLE_CALLS:
            raise invalid_argument(f"{name!r} is not a handle call")
        if name in _ENDING_CALLS:
            with self._lock:
                if session_id not in self._handles:
                    return None  # deleted already: as idempotent as a local handle's
        handle = self._handle(session_id)
        result = self._portal.call(getattr(handle, name), *args, **kwargs)
        if name == "delete":
            with self._lock:
                self._handles.pop(session_id, None)
        return result

    def close(self) -> None:
        self._portal.close()

    def _cancellable(self, call_id: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            with trio.CancelScope() as scope:
                with self._lock:
                    if self._early_cancels.pop(call_id, False) is None:
                        scope.cancel()
                    self._cancel_scopes[call_id] = scope
                try:
                    return await function(*args, **kwargs)
                finally:
                    with self._lock:
                        del self._cancel_scopes[call_id]
            # Cancelled: the caller has stopped waiting for an answer.
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the call was cancelled by its caller")

        return self._portal.call(call)

    def _handle(self, session_id: str) -> Any:
        with self._lock:
            handle = self._handles.get(session_id)
        if handle is None:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no session {session_id} on node {self.node_id}")
        return handle

    def _describe(self, handle: Any) -> dict:
        return {"state": {**handle.capture_state(), "backend_id": self.backend_id}, "template": handle.template_key}


def _backend_identity(state_directory: Path) -> str:
    """The id of the backend over ``state_directory``, made by the first
    one: what a session's state names, so that it is resumed where its
    files are even when the host comes back as a new Ray node."""
    path = state_directory / BACKEND_ID_FILE
    with contextlib.suppress(FileNotFoundError):
        return path.read_text()
    spare = state_directory / f".{BACKEND_ID_FILE}-{secrets.token_hex(8)}"
    spare.write_text(secrets.token_hex(16))
    try:
        os.link(spare, path)  # no reader ever sees a partial id
    except FileExistsError:
        pass  # another backend's made it meanwhile
    finally:
        spare.unlink()
    return path.read_text()


def _as_raised(exc: BaseException, node: _Node) -> BaseException:
    """What a call's caller gets for what its node raised: a SandboxError
    as itself, the coding tools' own refusals as they are, anything else
    (a bug) as SANDBOX_UNAVAILABLE naming it."""
    if isinstance(exc, SandboxError):
        return SandboxError(exc.code, exc.message)
    if isinstance(exc, _PASSED_THROUGH):
        return exc
    return SandboxError(
        ErrorCode.SANDBOX_UNAVAILABLE, f"node {node.node_id} failed the call: {type(exc).__name__}: {exc}"
    )


def _ray_uses_tls() -> bool:
    """Whether Ray encrypts its own connections (the direct channels do
    not: then every call is a Ray call)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


@contextlib.asynccontextmanager
async def _serving(
    options: Mapping[str, Any], host: str, serve: Callable[[trio.SocketStream], Awaitable[None]]
) -> AsyncIterator[tuple[Backend, int]]:
    """A backend, and a listener on ``host`` for direct channels to it
    (closed before the backend is)."""
    async with open_backend(**options) as backend, trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host=host))
        yield backend, listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


class _ChannelCalls:
    """What a NodeBackend's direct channels call, in its trio thread. Apart
    from the actor class: Ray makes an actor with any coroutine method an
    asyncio actor, whose plain methods would then run one at a time."""

    def __init__(self, node: NodeBackend) -> None:
        self._node = node

    async def dispatch(self, method: str, args: tuple) -> Any:
        node = self._node
        # A policy's header values never travel by channel (see the module
        # docstring): set_network_policy is a Ray call only.
        if method == "session_call":
            session_id, name, call_args, kwargs = args
            return await node._session_method(session_id, name, _CHANNEL_SESSION_CALLS)(*call_args, **kwargs)
        if method == "coding_call":
            session_id, name, call_args = args
            return await node._coding_method(session_id, name, call_args)(*call_args)
        raise invalid_argument(f"{method!r} is not a channel call")


def _remote_node_backend() -> Any:
    """NodeBackend as a Ray actor class: served from several threads, and
    never restarted by Ray (a node that died lost its sessions' holders)."""
    return ray.remote(
        max_concurrency=ACTOR_CONCURRENCY, concurrency_groups={"control": CONTROL_CONCURRENCY}, max_restarts=0
    )(NodeBackend)


@dataclasses.dataclass
class _Node:
    node_id: str
    actor: Any
    alive: bool = True
    backend_id: str | None = None  # once it has answered
    # The direct channel of the cluster's trio run (see Cluster._hot_call),
    # and until when not to try one (one could not be opened).
    channel: Channel | None = None
    channel_lock: trio.Lock | None = None
    direct_after: float = 0.0

    def __getstate__(self) -> dict:
        # Passed to another process: the channel is this trio run's.
        return {**self.__dict__, "channel": None, "channel_lock": None}


async def _resolve(ref: ray.ObjectRef, cancel: Callable[[], object] | None = None) -> Any:
    """Await a Ray result from trio: Ray calls back from one of its threads
    once the result is in, and the event loop is woken for it. Cancelled,
    ``cancel()`` asks the node to end the call, which is waited for (as
    long as CANCEL_WAIT_SECONDS) before the cancellation goes on: like a
    local command's, a remote one is gone once its cancelled call returns."""
    token = trio.lowlevel.current_trio_token()
    future = ref.future()
    done = trio.Event()

    def wake(_: object) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(wake)
    try:
        await done.wait()
    except trio.Cancelled:
        if cancel is not None:
            with trio.move_on_after(CANCEL_WAIT_SECONDS, shield=True):
                cancel()
                await done.wait()
        raise
    return future.result()


class Cluster:
    """The sandboxns backends of a Ray cluster's nodes. Use
    :func:`open_cluster`; close it with :meth:`aclose` (or ``async with``)."""

    def __init__(
        self,
        state_directory: str,
        driver: str,
        max_concurrent_commands: int,
        nodes: Sequence[str] | None,
    ) -> None:
        self.state_directory = state_directory
        self.driver = driver
        self.max_concurrent_commands = max_concurrent_commands
        self._wanted = None if nodes is None else frozenset(nodes)
        self._nodes: dict[str, _Node] = {}
        self._refreshed = -float("inf")
        self._closed = False
        self._actor_class = _remote_node_backend()
        # Call ids: unique across the processes this cluster is passed to.
        self._caller = secrets.token_hex(8)
        self._call_numbers = itertools.count()
        # The trio run that may use direct channels: the opener's (and
        # none where Ray's own connections are encrypted).
        self._home_run = None if _ray_uses_tls() else trio.lowlevel.current_trio_token()
        # Whether this object starts backends: the opener's does; a copy in
        # a Ray task does not (an actor dies with the worker that made it).
        self._owner = True

    @property
    def nodes(self) -> list[str]:
        """The ids of the nodes whose backends are reachable, as last seen."""
        return [node.node_id for node in self._nodes.values() if node.alive]

    def blocking(self) -> BlockingCluster:
        """This cluster for synchronous code (see :class:`BlockingCluster`),
        which can be passed to Ray tasks and actors."""
        return BlockingCluster(self)

    def __getstate__(self) -> dict:
        # Passed to another process (a Ray task's): the actors' handles go
        # with it, and the class they were made from is made again there.
        state = dict(self.__dict__)
        del state["_actor_class"], state["_caller"], state["_call_numbers"], state["_home_run"]
        state["_owner"] = False
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._actor_class = _remote_node_backend()
        self._caller = secrets.token_hex(8)
        self._call_numbers = itertools.count()
        self._home_run = None  # Ray calls only

    async def refresh(self) -> None:
        """Start a backend on each node that declares the resource and has
        none running (nodes join a cluster at any time; a backend's process
        may die while its node lives on), and forget nodes Ray reports
        gone. A backend started again on a node opens the same state
        directory, where the sessions its predecessor left are recovered
        as after any crash: their leases are free once their processes are
        gone, and each resumes from its captured state."""
        self._check_open()
        self._refreshed = time.monotonic()
        listed = await trio.to_thread.run_sync(ray.nodes)
        started = []
        for entry in listed:
            node_id = entry["NodeID"]
            wanted = self._wanted is None or node_id in self._wanted
            if not entry["Alive"]:
                if node_id in self._nodes:
                    self._nodes[node_id].alive = False
            elif self._owner and wanted and entry["Resources"].get(RESOURCE, 0) >= 1 and node_id not in self.nodes:
                if node_id in self._nodes:  # its backend died: it goes for good, and its resource with it
                    await self._forget(self._nodes[node_id])
                actor = self._actor_class.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    resources={RESOURCE: 1},
                    # Its sandboxes are processes of their own, which Ray
                    # does not schedule: the node's CPUs stay for its tasks.
                    num_cpus=0,
                ).remote(self.state_directory, self.driver, self.max_concurrent_commands)
                self._nodes[node_id] = _Node(node_id, actor)
                started.append(node_id)

        # A new backend is ready once it answers; one that fails to start
        # (its node left meanwhile) is marked gone.
        async def ready(node: _Node) -> None:
            with trio.move_on_after(BACKEND_START_SECONDS):
                described = await self._call_quietly(node.node_id, "describe")
                if described is not None:
                    node.backend_id = described[2]
                return
            await self._forget(node)

        async with trio.open_nursery() as nursery:
            for node_id in started:
                nursery.start_soon(ready, self._nodes[node_id])

    async def import_image(self, path: str | os.PathLike[str]) -> Image:
        """:meth:`Backend.import_image` on every node: ``path`` names the
        image on each node's host (a shared filesystem, or a copy on each);
        the same image gives the same digest everywhere."""
        await self._refresh_if_due()
        results = await self._on_every_node("import_image", os.fspath(path))
        digests = {image.digest for image in results.values()}
        if len(digests) != 1:
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"nodes imported different images: {sorted(digests)}")
        return next(iter(results.values()))

    async def prewarm(self, *, template: str, files: Mapping[str, bytes], image: str | None = None) -> Template:
        """:meth:`Backend.prewarm` on every node (the key is the same on
        each, so a session of it can be made anywhere); with ``image``,
        which every node must have imported (see :meth:`import_image`)."""
        await self._refresh_if_due()
        results = await self._on_every_node("prewarm", template, dict(files), image)
        keys = {result.template_key for result in results.values()}
        if len(keys) != 1:
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"nodes made different templates: {sorted(keys)}")
        return next(iter(results.values()))

    async def pool(self, *, template: str, size_per_node: int) -> None:
        """:meth:`Backend.pool` on every node."""
        await self._refresh_if_due()
        await self._on_every_node("pool", template, size_per_node)

    async def pool_forks(self, *, size_per_node: int) -> None:
        """:meth:`Backend.pool_forks` on every node (forks are made on
        their origin's node)."""
        await self._refresh_if_due()
        await self._on_every_node("pool_forks", size_per_node)

    async def create(
        self, *, node: str | None = None, state: Mapping | None = None, **options: Any
    ) -> RemoteSessionHandle:
        """:meth:`Backend.create` on a node: ``node`` if given, the node
        whose backend holds a ``state``'s session (resumed where its files
        are: the node it was made on, or the node its host came back as),
        or the least loaded (fewest commands running, then fewest
        sessions). When every node runs as many commands as its admission
        limit allows, this is SANDBOX_BUSY: nothing is queued."""
        await self._refresh_if_due()
        if state is not None:
            if (
                not isinstance(state, Mapping)
                or not isinstance(state.get("node"), str)
                or not isinstance(state.get("backend_id", ""), str)
            ):
                raise invalid_argument("state is not a remote session's descriptor (see capture_state())")
            # Its own node if that is still there, else the node whose
            # backend is over the same state directory (its host came back).
            holders = [
                known.node_id for known in self._nodes.values()
                if known.alive and known.backend_id == state.get("backend_id")
            ]  # fmt: skip
            holder = state["node"] if state["node"] in holders or not holders else holders[0]
            if node is not None and node != holder:
                raise SandboxError(
                    ErrorCode.SANDBOX_STATE_MISMATCH, f"session {state.get('session')} lives on node {holder}"
                )
            node = holder
            options["state"] = {key: value for key, value in state.items() if key != "node"}
        if node is None:
            node = await self._least_loaded()
        elif node not in self.nodes:
            code = ErrorCode.SANDBOX_STATE_MISMATCH if state is not None else ErrorCode.SANDBOX_NOT_FOUND
            raise SandboxError(code, f"node {node} has no sandboxns backend in this cluster")
        backend = self._nodes[node]
        described = await self._call_on(backend, "create", options)
        return RemoteSessionHandle(self, backend, described)

    async def aclose(self) -> None:
        """Shut every node's backend down (their sessions stop; their files
        stay) and end the actors."""
        if self._closed:
            return
        self._closed = True
        async with trio.open_nursery() as nursery:
            for node in self._nodes.values():
                nursery.start_soon(self._close_node, node)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _close_node(self, node: _Node) -> None:
        with trio.CancelScope(shield=True):
            if node.alive:
                try:
                    await self._call_on(node, "close")
                except SandboxError:
                    pass  # gone already
            await self._forget(node)

    @staticmethod
    async def _forget(node: _Node) -> None:
        """Close a node's channel, end its actor: it is gone, or replaced."""
        node.alive = False
        if node.channel is not None:
            await node.channel.aclose()
            node.channel = None
        ray.kill(node.actor)

    async def _least_loaded(self) -> str:
        loads: dict[str, tuple[int, int, int]] = {}

        async def ask(node_id: str) -> None:
            load = await self._call_quietly(node_id, "load")
            if load is not None:
                loads[node_id] = load

        async with trio.open_nursery() as nursery:
            for node_id in self.nodes:
                nursery.start_soon(ask, node_id)
        if not loads:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "no node of this Ray cluster runs a sandboxns backend")
        open_nodes = {node_id: load for node_id, load in loads.items() if load[0] < load[2]}
        if not open_nodes:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"every node runs as many commands as it admits ({len(loads)} nodes); try again later",
            )
        return min(open_nodes, key=lambda node_id: (open_nodes[node_id][:2], node_id))

    async def _on_every_node(self, method: str, *args: Any) -> dict[str, Any]:
        results: dict[str, Any] = {}
        failures: list[SandboxError] = []

        async def one(node_id: str) -> None:
            try:
                results[node_id] = await self._call(node_id, method, *args)
            except SandboxError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            for node_id in self.nodes:
                nursery.start_soon(one, node_id)
        if failures:
            raise failures[0]
        if not results:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "no node of this Ray cluster runs a sandboxns backend")
        return results

    async def _refresh_if_due(self) -> None:
        self._check_open()
        if time.monotonic() - self._refreshed >= NODE_REFRESH_SECONDS:
            await self.refresh()

    async def _call_quietly(self, node_id: str, method: str, *args: Any) -> Any:
        """The call's result, or None if the node is gone (it is marked so)."""
        try:
            return await self._call(node_id, method, *args)
        except SandboxError as exc:
            if exc.code is not ErrorCode.SANDBOX_UNAVAILABLE:
                raise
            return None

    async def _call(self, node_id: str, method: str, *args: Any) -> Any:
        """A method of a node's actor. Errors come back as the exception
        the actor raised (a SandboxError as itself); a backend that is
        gone (its node or its process dead, or unreachable) is
        SANDBOX_UNAVAILABLE naming the node."""
        return await self._call_on(self._node(node_id), method, *args)

    async def _call_on(self, node: _Node, method: str, *args: Any) -> Any:
        """_call on one backend of a node: a session's handle keeps the one
        it was made by, and a backend started on its node later does not
        take over its calls (its sessions resume there from their state)."""
        self._check_alive(node)
        return await self._answer(node, getattr(node.actor, method).remote(*args))

    async def _cancellable_call(self, node: _Node, method: str, *args: Any) -> Any:
        """_call_on for a method taking a call id first: cancelling the
        caller cancels the call on the node."""
        self._check_alive(node)
        call_id = f"{self._caller}-{next(self._call_numbers)}"
        ref = getattr(node.actor, method).remote(call_id, *args)
        return await self._answer(node, ref, lambda: node.actor.cancel.remote(call_id))

    async def _hot_call(self, node: _Node, method: str, *args: Any) -> Any:
        """_cancellable_call, over the node's direct channel when called
        from the trio run that opened the cluster (see _channel)."""
        channel = await self._channel(node) if self._home_run is trio.lowlevel.current_trio_token() else None
        if channel is None:
            return await self._cancellable_call(node, method, *args)
        try:
            return await channel.call(method, args, CANCEL_WAIT_SECONDS)
        except ChannelClosed:
            pass
        except Exception as exc:  # noqa: BLE001 - what the node raised, as a Ray call's would be
            raise _as_raised(exc, node) from None
        # Whether the backend is gone is Ray's to say (SANDBOX_UNAVAILABLE
        # from it, as for any call); the call itself may have run.
        await self._call_on(node, "describe")
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE,
            f"the connection to the sandboxns backend of node {node.node_id} closed during the call",
        )

    async def _channel(self, node: _Node) -> Channel | None:
        self._check_alive(node)
        if node.channel is not None and not node.channel.closed:
            return node.channel
        if time.monotonic() < node.direct_after:
            return None
        if node.channel_lock is None:
            node.channel_lock = trio.Lock()
        async with node.channel_lock:
            if node.channel is not None and node.channel.closed:
                await node.channel.aclose()
                node.channel = None
            if node.channel is None and time.monotonic() >= node.direct_after:
                host, port, token = await self._call_on(node, "channel")
                node.channel = await Channel.connect(host, port, token, CHANNEL_CONNECT_SECONDS)
                if node.channel is None:
                    logger.warning(
                        "node %s cannot be reached at %s:%d: its calls go through Ray for %g s",
                        node.node_id, host, port, CHANNEL_RETRY_SECONDS,
                    )  # fmt: skip
                    node.direct_after = time.monotonic() + CHANNEL_RETRY_SECONDS
        return node.channel

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"node {node_id} has no sandboxns backend here")
        self._check_alive(node)
        return node

    @staticmethod
    def _check_alive(node: _Node) -> None:
        if not node.alive:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the sandboxns backend of node {node.node_id} is gone")

    async def _answer(self, node: _Node, ref: ray.ObjectRef, cancel: Callable[[], object] | None = None) -> Any:
        try:
            return await _resolve(ref, cancel)
        except ray.exceptions.ActorUnavailableError:
            # Unreachable for now (Ray retries its connection): not dead.
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE, f"the sandboxns backend of node {node.node_id} is unreachable for now"
            ) from None
        except ray.exceptions.RayActorError as exc:
            node.alive = False
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"the sandboxns backend of node {node.node_id} is gone ({type(exc).__name__})",
            ) from None
        except ray.exceptions.RayTaskError as exc:
            raise _as_raised(exc.cause, node) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the cluster is closed")


class RemoteSession:
    """A session on another node: the methods of a :class:`Session` that
    cross a network well (commands, file operations, the network policy)."""

    def __init__(self, handle: RemoteSessionHandle) -> None:
        self._handle = handle

    async def run(self, executable: str, args: Sequence[str] = (), **options: Any) -> RunResult:
        return await self._call("run", executable, list(args), **options)

    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", path)

    async def read_text_file(self, path: str) -> str:
        return await self._call("read_text_file", path)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._call("write_file", path, data)

    async def write_text_file(self, path: str, text: str) -> None:
        await self._call("write_text_file", path, text)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        return await self._call("list_dir", path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call("remove", path, recursive=recursive)

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        await self._call("mkdir", path, parents=parents)

    async def set_network_policy(self, policy: object) -> None:
        # A Ray call, not a channel's: see the module docstring.
        handle = self._handle
        await handle._cluster._cancellable_call(
            handle._backend, "session_call", handle.session_id, "set_network_policy", (policy,), {}
        )

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        handle = self._handle
        return await handle._cluster._hot_call(handle._backend, "session_call", handle.session_id, name, args, kwargs)


class _RemoteWorkspaceTarget:
    """A WorkspaceTarget's methods for coding tools on the caller's side
    (its authorization hooks stay there), each served by the node's
    WorkspaceTarget of the session."""

    def __init__(self, handle: RemoteSessionHandle) -> None:
        self.handle = handle

    def check_live(self) -> None:
        # What this side knows; the node checks again on every call.
        if not self.handle.live:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the sandbox session is stopped")

    async def environment(self) -> dict[str, str]:
        return await self._call("environment")

    async def run_probe(self) -> RunResult:
        return await self._call("run_probe")

    async def network_state(self) -> tuple[str, int]:
        return await self._call("network_state")

    async def workspace_call(self, function: Callable, *args: Any) -> Any:
        return await self._call("workspace_call", function, *args)

    async def execute(self, command: CapturedCommand) -> CapturedRun:
        return await self._call("execute", command)

    async def _call(self, name: str, *args: Any) -> Any:
        handle = self.handle
        return await handle._cluster._hot_call(handle._backend, "coding_call", handle.session_id, name, args)


class RemoteSessionHandle:
    """A session on a node of the cluster: the surface of a local
    :class:`~sandboxns.SessionHandle`, its calls made through the node's
    actor. ``node`` is the Ray node id; ``capture_state()`` names it, and
    only that node resumes the session."""

    def __init__(self, cluster: Cluster, backend: _Node, described: Mapping[str, Any]) -> None:
        self._cluster = cluster
        self._backend = backend
        self.node = backend.node_id
        self._state = dict(described["state"])
        self.session_id: str = self._state["session"]
        self.template_key: str | None = described["template"]
        self.session = RemoteSession(self)
        # False once stopped, shut down or deleted through this handle.
        self.live = True

    def capture_state(self) -> dict:
        """What ``Cluster.create(state=...)`` resumes the session from (on
        its node): the local descriptor and the node's id."""
        return {**self._state, "node": self.node}

    async def stop(self) -> None:
        self.live = False
        await self._call("stop")

    async def shutdown(self) -> None:
        self.live = False
        await self._call("shutdown")

    async def delete(self) -> None:
        self.live = False
        await self._call("delete")

    async def aclose(self) -> None:
        await self.shutdown()

    async def snapshot(self, name: str | None = None, *, copy: bool = False) -> Snapshot:
        """A snapshot on this session's node (see SessionHandle.snapshot)."""
        return await self._call("snapshot", name, copy=copy)

    def coding_target(self) -> _RemoteWorkspaceTarget:
        """What create_sandbox_coding_tools(handle) drives: the tools and
        their hooks run here, the workspace and commands on the node."""
        return _RemoteWorkspaceTarget(self)

    async def fork(self, n: int, **options: Any) -> list[RemoteSessionHandle]:
        """Forks on this session's node (see SessionHandle.fork)."""
        described = await self._cluster._call_on(self._backend, "fork", self.session_id, n, options)
        return [RemoteSessionHandle(self._cluster, self._backend, one) for one in described]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._cluster._call_on(self._backend, "handle_call", self.session_id, name, args, kwargs)


def _blocking(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``await function(*args, **kwargs)`` in a trio run of its own."""
    _refuse_trio_caller()
    return trio.run(functools.partial(function, *args, **kwargs))


class BlockingCluster:
    """A :class:`Cluster` for synchronous code: a script, or a Ray task or
    actor it is passed to (``ray.get`` collects what they return). Each
    call runs the async one in a trio run of its own; the cluster is closed
    by whoever opened it, not here."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    @property
    def nodes(self) -> list[str]:
        return self._cluster.nodes

    def prewarm(self, *, template: str, files: Mapping[str, bytes], image: str | None = None) -> Template:
        return _blocking(self._cluster.prewarm, template=template, files=files, image=image)

    def import_image(self, path: str | os.PathLike[str]) -> Image:
        return _blocking(self._cluster.import_image, path)

    def create(self, **options: Any) -> BlockingRemoteHandle:
        return BlockingRemoteHandle(_blocking(self._cluster.create, **options))

    def close(self) -> None:
        """Close the cluster (see Cluster.aclose): for the code that opened
        it, with :func:`open_blocking_cluster`."""
        _blocking(self._cluster.aclose)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BlockingRemoteSession:
    """:class:`RemoteSession`, blocking: each of its methods, taking the
    same arguments."""

    def __init__(self, session: RemoteSession) -> None:
        self._session = session

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in vars(RemoteSession):
            raise AttributeError(name)
        return functools.partial(_blocking, getattr(self._session, name))


class BlockingRemoteHandle:
    """:class:`RemoteSessionHandle`, blocking; ``with`` shuts it down."""

    def __init__(self, handle: RemoteSessionHandle) -> None:
        self._handle = handle
        self.node = handle.node
        self.session_id = handle.session_id
        self.template_key = handle.template_key
        self.session = BlockingRemoteSession(handle.session)

    def capture_state(self) -> dict:
        return self._handle.capture_state()

    def stop(self) -> None:
        _blocking(self._handle.stop)

    def shutdown(self) -> None:
        _blocking(self._handle.shutdown)

    def delete(self) -> None:
        _blocking(self._handle.delete)

    def snapshot(self, name: str | None = None, *, copy: bool = False) -> Snapshot:
        return _blocking(self._handle.snapshot, name, copy=copy)

    def fork(self, n: int, **options: Any) -> list[BlockingRemoteHandle]:
        return [BlockingRemoteHandle(fork) for fork in _blocking(self._handle.fork, n, **options)]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


async def open_cluster(
    *,
    state_directory: str | os.PathLike[str],
    driver: str = "native",
    max_concurrent_commands: int = DEFAULT_MAX_CONCURRENT_COMMANDS,
    nodes: Sequence[str] | None = None,
) -> Cluster:
    """A :class:`Cluster` of the connected Ray cluster's nodes that declare
    the ``sandboxns`` resource (or of ``nodes``, by id): a backend on each,
    over ``state_directory`` on that node (where ``{node_id}`` in it is the
    node's id: for several nodes on one machine), with its own admission
    limit. ``ray.init()`` first."""
    if not ray.is_initialized():
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "Ray is not initialized here: call ray.init() first")
    if isinstance(max_concurrent_commands, bool) or not isinstance(max_concurrent_commands, int):
        raise invalid_argument(f"max_concurrent_commands must be an integer, not {max_concurrent_commands!r}")
    if nodes is not None and (isinstance(nodes, str) or not all(isinstance(node, str) for node in nodes)):
        raise invalid_argument("nodes must be a list of Ray node ids")
    cluster = Cluster(os.fspath(state_directory), driver, max_concurrent_commands, nodes)
    await cluster.refresh()
    if not cluster.nodes:
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE,
            f"no node of this Ray cluster declares the resource {RESOURCE!r} "
            f"(ray start --resources '{{\"{RESOURCE}\": 1}}')",
        )
    return cluster


def open_blocking_cluster(**options: Any) -> BlockingCluster:
    """:func:`open_cluster` for synchronous code (same arguments); close it,
    or use ``with``."""
    return BlockingCluster(_blocking(open_cluster, **options))
