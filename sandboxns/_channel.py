"""A direct call channel from a caller to a node's backend (sandboxns.ray).

Ray carries everything that places, starts and watches backends; a call
through a Ray actor, though, costs about as much CPU as the sandboxed command
it runs (its submission, its reply, and two thread hops in the actor). So a
trio caller's hot calls (commands, file operations, coding tools' calls) go
over one TCP connection per node instead, which the node's backend serves
from its own trio thread: requests and replies are pickled frames, many in
flight at once, each answered when done.

Trust is that of Ray without TLS (with RAY_USE_TLS, sandboxns.ray does
not use channels): the listener takes connections on the node's address,
and a connection's first frame must be the 32-byte token the backend handed
out in a Ray call's reply; nothing is unpickled before that, and at most
PENDING_HANDSHAKES connections wait to present one. Once authenticated, the
peer is as trusted as a Ray driver (which can run any code on the node).
Whatever a connection sends or does, it ends only that connection, never
the backend. A connection that closes cancels its calls on the node (the
caller is gone); a closed connection fails the caller's pending calls, and
the caller goes back to Ray, which knows whether the backend lives.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from ._errors import ErrorCode, SandboxError

TOKEN_BYTES = 32
# A frame's length, before it: frames are as large as a command's output
# or a file may be (both limits are the caller's to set).
HEADER_BYTES = 8
# How long a connection has to present its token, and how many may be
# waiting to at once (more are closed at once).
HANDSHAKE_SECONDS = 10.0
PENDING_HANDSHAKES = 64
# How long a frame may take to leave: past it, the peer is not reading and
# the connection is given up (a frame half sent garbles every later one).
SEND_SECONDS = 60.0
CANCEL = "cancel"

logger = logging.getLogger("sandboxns.ray")


class ChannelClosed(Exception):
    """The connection to the node closed (or broke) under a call."""


async def _send_frame(stream: trio.abc.Stream, payload: bytes) -> None:
    await stream.send_all(len(payload).to_bytes(HEADER_BYTES, "big") + payload)


class _FrameReader:
    """Length-prefixed frames from a stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def _exactly(self, size: int) -> bytes | None:
        while len(self._buffer) < size:
            chunk = await self._stream.receive_some(max(65536, size - len(self._buffer)))
            if not chunk:
                return None
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    async def receive(self, most: int | None = None) -> bytes | None:
        """The next frame, or None once the stream ends (or a frame is
        over ``most`` bytes: the peer is not one of ours)."""
        header = await self._exactly(HEADER_BYTES)
        if header is None or most is not None and int.from_bytes(header, "big") > most:
            return None
        return await self._exactly(int.from_bytes(header, "big"))


def _reply(call_id: int, outcome: Any, failed: bool) -> bytes:
    try:
        return pickle.dumps((call_id, failed, outcome))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or error is reported, not lost
        error = SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the node could not send its answer back: {exc!r}")
        return pickle.dumps((call_id, True, error))


class ChannelListener:
    """The node's end: serves each connection (see serve), and closes
    those that would wait past PENDING_HANDSHAKES to present a token."""

    def __init__(self, token: bytes, dispatch: Callable[[str, tuple], Awaitable[Any]]) -> None:
        self._token = token
        self._dispatch = dispatch
        self._handshakes = trio.Semaphore(PENDING_HANDSHAKES)

    async def serve(self, stream: trio.abc.Stream) -> None:
        """Serve one caller: after its token, each request frame
        ``(call_id, method, args)`` runs ``await dispatch(method, args)``
        in a task of its own and is answered ``(call_id, failed, result or
        error)``; ``(call_id, "cancel", ())`` cancels that call (then
        answered as SANDBOX_STOPPED). Nothing a peer does fails more than
        its own connection."""
        # One reader for both: a read may take the token and the first
        # calls' frames together.
        reader = _FrameReader(stream)
        async with stream:
            try:
                if await self._authenticated(reader):
                    await self._serve_calls(stream, reader)
            except* Exception:  # a reset, a garbled frame, a peer not ours
                logger.debug("channel connection ended", exc_info=True)

    async def _authenticated(self, reader: _FrameReader) -> bool:
        try:
            self._handshakes.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            with trio.move_on_after(HANDSHAKE_SECONDS):
                presented = await reader.receive(most=TOKEN_BYTES)
                return presented is not None and secrets.compare_digest(presented, self._token)
            return False
        finally:
            self._handshakes.release()

    async def _serve_calls(self, stream: trio.abc.Stream, reader: _FrameReader) -> None:
        sending = trio.Lock()
        scopes: dict[int, trio.CancelScope] = {}

        async def answer(call_id: int, scope: trio.CancelScope, method: str, args: tuple) -> None:
            failed = True
            with scope:
                try:
                    outcome, failed = await self._dispatch(method, args), False
                except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
                    outcome = exc
                finally:
                    del scopes[call_id]
            if scope.cancelled_caught:
                outcome = SandboxError(ErrorCode.SANDBOX_STOPPED, "the call was cancelled by its caller")
            async with sending:
                with trio.move_on_after(SEND_SECONDS) as sent:
                    await _send_frame(stream, _reply(call_id, outcome, failed))
                if sent.cancelled_caught:
                    raise trio.BrokenResourceError("the caller does not read its answers")

        async with trio.open_nursery() as nursery:
            while (frame := await reader.receive()) is not None:
                call_id, method, args = pickle.loads(frame)
                if method == CANCEL:
                    # Frames arrive in order, and a call's scope is made
                    # as its frame is read: no cancel comes before it.
                    if call_id in scopes:
                        scopes[call_id].cancel()
                else:
                    scope = scopes[call_id] = trio.CancelScope()
                    nursery.start_soon(answer, call_id, scope, method, args)
            # The caller is gone: nothing waits for its calls.
            nursery.cancel_scope.cancel()


@dataclass
class _Pending:
    done: trio.Event
    failed: bool = False
    outcome: Any = None


class Channel:
    """The caller's end: one connection, used from the trio run that
    opened it, with any number of calls in flight."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._sending = trio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._call_ids = itertools.count()
        self.closed = False

    @classmethod
    async def connect(cls, host: str, port: int, token: bytes, timeout: float) -> Channel | None:
        """A channel, or None if the node cannot be reached within
        ``timeout`` seconds (a port filtered, a network between)."""
        stream = None
        try:
            with trio.move_on_after(timeout):
                stream = await trio.open_tcp_stream(host, port)
                await _send_frame(stream, token)
                channel = cls(stream)
                trio.lowlevel.spawn_system_task(channel._read_replies, name="sandboxns.ray channel")
                stream = None  # the channel's now
                return channel
        except (OSError, trio.BrokenResourceError):
            pass
        finally:
            if stream is not None:
                await trio.aclose_forcefully(stream)
        return None

    async def call(self, method: str, args: tuple, cancel_wait: float) -> Any:
        """``dispatch(method, args)`` on the node. Cancelled, the call is
        cancelled there, and its end waited for (``cancel_wait`` seconds
        at most) before the cancellation goes on."""
        if self.closed:
            raise ChannelClosed
        call_id = next(self._call_ids)
        pending = self._pending[call_id] = _Pending(trio.Event())
        try:
            await self._send((call_id, method, args))
            try:
                await pending.done.wait()
            except trio.Cancelled:
                with trio.move_on_after(cancel_wait, shield=True):
                    await self._send((call_id, CANCEL, ()))
                    await pending.done.wait()
                raise
        finally:
            del self._pending[call_id]
        if pending.failed:
            raise pending.outcome
        return pending.outcome

    async def aclose(self) -> None:
        self._close()
        await trio.aclose_forcefully(self._stream)

    async def _send(self, message: tuple) -> None:
        payload = pickle.dumps(message)
        async with self._sending:
            if self.closed:
                raise ChannelClosed
            # A frame half sent would garble every later one: once begun,
            # it is sent whole, or the connection given up.
            with trio.CancelScope(shield=True, deadline=trio.current_time() + SEND_SECONDS) as sending:
                try:
                    await _send_frame(self._stream, payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.aclose()
                    raise ChannelClosed from None
            if sending.cancelled_caught:
                await self.aclose()
                raise ChannelClosed

    async def _read_replies(self) -> None:
        reader = _FrameReader(self._stream)
        try:
            while (frame := await reader.receive()) is not None:
                call_id, failed, outcome = pickle.loads(frame)
                pending = self._pending.get(call_id)
                if pending is not None:  # else its caller stopped waiting
                    pending.failed, pending.outcome = failed, outcome
                    pending.done.set()
        except Exception:  # broken, closed here, or a reply unreadable: the channel ends, not the run
            logger.debug("channel closed", exc_info=True)
        finally:
            self._close()
            await trio.aclose_forcefully(self._stream)

    def _close(self) -> None:
        """Fail every call still waiting: its reply will never come."""
        self.closed = True
        for pending in self._pending.values():
            if not pending.done.is_set():
                pending.failed, pending.outcome = True, ChannelClosed()
                pending.done.set()
