"""The sandboxns API for synchronous callers.

Scripts, threaded servers and asyncio applications (through
``asyncio.to_thread``) use the same backends, sessions and coding tools as
trio code: each :func:`open_backend`, :func:`open_sandbox` or :func:`build`
starts one thread that runs trio, and every call is handed to it with
``trio.from_thread.run`` and waits for its answer. Calls from several
threads at once run concurrently. Errors are the same ``SandboxError``\\ s.

Close what you open (or use ``with``): closing stops the sessions and ends
the thread. Callbacks given to the API (``authorize`` and the like) run in
that thread, so a slow one holds up every sandbox of the same backend.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Self

import trio

from ._backend import Backend
from ._backend import open_backend as _open_backend
from ._coding import CodingTools
from ._coding_tools import create_sandbox_coding_tools as _create_coding_tools
from ._errors import ErrorCode, SandboxError
from ._files import DirEntry
from ._handle import SessionHandle
from ._network import NetworkPolicy
from ._open import open_sandbox as _open_sandbox
from ._session import RunResult, Session
from ._spec import SandboxSpec, SpecSandbox
from ._templates import Template

__all__ = [
    "BlockingBackend",
    "BlockingCodingTools",
    "BlockingHandle",
    "BlockingSandbox",
    "BlockingSession",
    "build",
    "create_sandbox_coding_tools",
    "open_backend",
    "open_sandbox",
]


def _refuse_trio_caller() -> None:
    """A blocking call from a trio task would stall its whole event loop
    (and trio refuses to wait for another loop from one), so code running
    trio is told to use the async API before anything is made."""
    if trio.lowlevel.in_trio_run():
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT,
            "sandboxns.blocking was called inside a running trio event loop; use the async API there "
            "(sandboxns.open_backend, open_sandbox, SandboxSpec.build), or call this from a thread "
            "(trio.to_thread.run_sync)",
        )


class _Portal:
    """A thread running trio, holding one async context manager open until
    :meth:`close`, and running callers' coroutines meanwhile."""

    def __init__(self, open_context: Callable[[], AbstractAsyncContextManager]) -> None:
        _refuse_trio_caller()
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.value: Any = None
        self._thread = threading.Thread(target=self._run, args=(open_context,), name="sandboxns-blocking", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._thread.join()
            failure, self._failure = self._failure, None
            raise failure

    def _run(self, open_context: Callable[[], AbstractAsyncContextManager]) -> None:
        try:
            trio.run(self._main, open_context)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits (start or close)
            self._failure = exc
        finally:
            self._started.set()

    async def _main(self, open_context: Callable[[], AbstractAsyncContextManager]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._closing = trio.Event()
        async with open_context() as value:
            self.value = value
            self._started.set()
            await self._closing.wait()

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await function(*args, **kwargs)`` in the trio thread."""
        return self._enter(trio.from_thread.run, functools.partial(function, *args, **kwargs))

    def call_sync(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` in the trio thread."""
        return self._enter(trio.from_thread.run_sync, functools.partial(function, *args, **kwargs))

    def _enter(self, runner: Callable[..., Any], call: Callable[[], Any]) -> Any:
        self._refuse_own_thread()
        if self._closed:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "this blocking sandbox was closed")
        try:
            return runner(call, trio_token=self._token)
        except trio.RunFinishedError:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "this blocking sandbox was closed") from None

    def _refuse_own_thread(self) -> None:
        if threading.current_thread() is self._thread:
            raise SandboxError(
                ErrorCode.SANDBOX_INVALID_ARGUMENT,
                "the blocking API was called from its own trio thread (a callback?); use the async API there",
            )
        _refuse_trio_caller()

    def close(self) -> None:
        """Leave the context (stopping what it owns) and end the thread.
        Idempotent; a second caller waits for the first to finish."""
        self._refuse_own_thread()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # RunFinishedError: the thread already ended, and _failure says why.
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._closing.set, trio_token=self._token)
            self._thread.join()
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure


class _Closing:
    """``with`` support for the objects that own a portal."""

    _portal: _Portal

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BlockingSession:
    """A :class:`~sandboxns.Session`, blocking; see its methods for details."""

    def __init__(self, session: Session, portal: _Portal) -> None:
        self._session = session
        self._portal = portal

    @property
    def network(self) -> NetworkPolicy:
        return self._session.network

    @property
    def environment(self) -> dict[str, str]:
        return dict(self._session.environment)

    @property
    def running(self) -> int:
        return self._session.running

    def run(self, executable: str, args: Sequence[str] = (), **options: Any) -> RunResult:
        return self._portal.call(self._session.run, executable, args, **options)

    def read_file(self, path: str) -> bytes:
        return self._portal.call(self._session.read_file, path)

    def read_text_file(self, path: str) -> str:
        return self._portal.call(self._session.read_text_file, path)

    def write_file(self, path: str, data: bytes) -> None:
        self._portal.call(self._session.write_file, path, data)

    def write_text_file(self, path: str, text: str) -> None:
        self._portal.call(self._session.write_text_file, path, text)

    def list_dir(self, path: str = ".") -> list[DirEntry]:
        return self._portal.call(self._session.list_dir, path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._portal.call(self._session.remove, path, recursive=recursive)

    def mkdir(self, path: str, *, parents: bool = False) -> None:
        self._portal.call(self._session.mkdir, path, parents=parents)

    def set_network_policy(self, policy: object) -> None:
        self._portal.call(self._session.set_network_policy, policy)

    def configure(self, **defaults: Any) -> None:
        self._portal.call_sync(self._session.configure, **defaults)


class BlockingHandle:
    """A :class:`~sandboxns.SessionHandle`, blocking. ``with handle:``
    closes it at the end (stop, or delete with ``destroy_on_close``)."""

    def __init__(self, handle: SessionHandle, portal: _Portal) -> None:
        self._handle = handle
        self._portal = portal
        self.session = BlockingSession(handle.session, portal)
        self.session_id = handle.session_id
        self.template_key = handle.template_key

    @property
    def live(self) -> bool:
        return self._handle.live

    def capture_state(self) -> dict:
        return self._handle.capture_state()

    def stop(self) -> None:
        self._portal.call(self._handle.stop)

    def shutdown(self) -> None:
        self._portal.call(self._handle.shutdown)

    def delete(self) -> None:
        self._portal.call(self._handle.delete)

    def close(self) -> None:
        self._portal.call(self._handle.aclose)

    def wait_closed(self) -> None:
        self._portal.call(self._handle.wait_closed)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BlockingBackend(_Closing):
    """A :class:`~sandboxns.Backend`, blocking, in its own trio thread."""

    def __init__(self, backend: Backend, portal: _Portal) -> None:
        self._portal = portal
        self._backend = backend
        self.name = backend.name
        self.state_directory = backend.state_directory

    @property
    def max_concurrent_commands(self) -> int:
        return self._backend.max_concurrent_commands

    @property
    def active_commands(self) -> int:
        return self._backend.active_commands

    def prewarm(self, *, template: str, files: Mapping[str, bytes]) -> Template:
        return self._portal.call(self._backend.prewarm, template=template, files=files)

    def create(self, **options: Any) -> BlockingHandle:
        return BlockingHandle(self._portal.call(self._backend.create, **options), self._portal)

    def pool(self, *, template: str, size: int) -> None:
        self._portal.call(self._backend.pool, template=template, size=size)

    def collect_expired(self) -> list[str]:
        return self._portal.call(self._backend.collect_expired)


class BlockingSandbox(BlockingSession, _Closing):
    """A sandbox from :func:`open_sandbox`: a :class:`BlockingSession` that
    owns its trio thread; closing kills everything in it."""


class BlockingSpecSandbox(_Closing):
    """A sandbox built from a spec (see :func:`build`). Its backend is its
    own: closing either closes both."""

    def __init__(self, portal: _Portal) -> None:
        self._portal = portal
        built: SpecSandbox = portal.value
        self.spec = built.spec
        self.backend = BlockingBackend(built.backend, portal)
        self.handle = BlockingHandle(built.handle, portal)
        self.session = self.handle.session
        self.installs = built.installs


class BlockingCodingTools:
    """:class:`~sandboxns.CodingTools`, blocking: :meth:`dispatch` waits for
    the tool's JSON result."""

    def __init__(self, tools: CodingTools, portal: _Portal) -> None:
        self._tools = tools
        self._portal = portal
        self.names = tools.names

    def as_openai_tools(self) -> list[dict]:
        return self._tools.as_openai_tools()

    def as_anthropic_tools(self) -> list[dict]:
        return self._tools.as_anthropic_tools()

    def dispatch(self, name: str, arguments: Mapping[str, Any] | None) -> dict:
        return self._portal.call(self._tools.dispatch, name, arguments)


def open_backend(**options: Any) -> BlockingBackend:
    """:func:`sandboxns.open_backend`, blocking (same arguments). Close it,
    or use ``with``, to shut its sessions down."""
    portal = _Portal(lambda: _open_backend(**options))
    return BlockingBackend(portal.value, portal)


def open_sandbox(workspace: str | os.PathLike[str], **options: Any) -> BlockingSandbox:
    """:func:`sandboxns.open_sandbox`, blocking (same arguments)."""
    portal = _Portal(lambda: _open_sandbox(workspace, **options))
    return BlockingSandbox(portal.value, portal)


def build(spec: SandboxSpec, **options: Any) -> BlockingSpecSandbox:
    """:meth:`SandboxSpec.build`, blocking (same arguments)."""
    if not isinstance(spec, SandboxSpec):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"spec must be a SandboxSpec, not {spec!r}")
    return BlockingSpecSandbox(_Portal(lambda: spec.build(**options)))


def create_sandbox_coding_tools(handle: BlockingHandle | BlockingSession, **options: Any) -> BlockingCodingTools:
    """:func:`sandboxns.create_sandbox_coding_tools` for a blocking handle
    (same keyword arguments)."""
    if isinstance(handle, BlockingHandle):
        target, portal = handle._handle, handle._portal
    elif isinstance(handle, BlockingSession):
        target, portal = handle._session, handle._portal
    else:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "give a handle or session from sandboxns.blocking")
    return BlockingCodingTools(portal.call(_create_coding_tools, target, **options), portal)
