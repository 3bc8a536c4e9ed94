"""A direct call channel from a caller to a node's backend (sandboxns.ray).

Ray carries everything that places, starts and watches backends; a call
through a Ray actor, though, costs about as much CPU as the sandboxed command
it runs (its submission, its reply, and two thread hops in the actor). So a
trio caller's hot calls (commands, file operations, coding tools' calls) go
over one TCP connection per node instead, which the node's backend serves
from its own trio thread: requests and replies are pickled frames, many in
flight at once, each answered when done.

Trust is Ray's: the listener takes connections on the node's address, and a
connection's first frame must be the 32-byte token the backend handed out in
a Ray call's reply; nothing is unpickled before that. Once authenticated,
the peer is as trusted as a Ray driver (which can run any code on the node).
A connection that closes cancels its calls on the node (the caller is gone);
a closed connection fails the caller's pending calls, and the caller goes
back to Ray, which knows whether the backend lives.
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
# The largest frame either side accepts: a file is at most 1 MiB, and a
# coding tool's command output at most two 8 MiB streams.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# How long a connection has to present its token.
HANDSHAKE_SECONDS = 10.0
CANCEL = "cancel"

logger = logging.getLogger("sandboxns.ray")


class ChannelClosed(Exception):
    """The connection to the node closed (or broke) under a call."""


async def _send_frame(stream: trio.abc.Stream, payload: bytes) -> None:
    await stream.send_all(len(payload).to_bytes(4, "big") + payload)


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

    async def receive(self, most: int = MAX_FRAME_BYTES) -> bytes | None:
        """The next frame, or None once the stream ends (or a frame is
        over ``most`` bytes: the peer is not one of ours)."""
        header = await self._exactly(4)
        if header is None or int.from_bytes(header, "big") > most:
            return None
        return await self._exactly(int.from_bytes(header, "big"))


def _reply(call_id: int, outcome: Any, failed: bool) -> bytes:
    try:
        return pickle.dumps((call_id, failed, outcome))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or error is reported, not lost
        error = SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the node could not send its answer back: {exc!r}")
        return pickle.dumps((call_id, True, error))


async def serve_connection(
    stream: trio.abc.Stream, token: bytes, dispatch: Callable[[str, tuple], Awaitable[Any]]
) -> None:
    """Serve one caller: after its token, each request frame
    ``(call_id, method, args)`` runs ``await dispatch(method, args)`` in a
    task of its own and is answered ``(call_id, failed, result or error)``;
    ``(call_id, "cancel", ())`` cancels that call (then answered as
    SANDBOX_STOPPED)."""
    reader = _FrameReader(stream)
    async with stream:
        with trio.move_on_after(HANDSHAKE_SECONDS):
            presented = await reader.receive(most=TOKEN_BYTES)
        if presented is None or not secrets.compare_digest(presented, token):
            return
        sending = trio.Lock()
        scopes: dict[int, trio.CancelScope] = {}

        async def answer(call_id: int, method: str, args: tuple) -> None:
            failed = True
            with trio.CancelScope() as scope:
                scopes[call_id] = scope
                try:
                    outcome, failed = await dispatch(method, args), False
                except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
                    outcome = exc
                finally:
                    del scopes[call_id]
            if scope.cancelled_caught:
                outcome = SandboxError(ErrorCode.SANDBOX_STOPPED, "the call was cancelled by its caller")
            async with sending:
                try:
                    await _send_frame(stream, _reply(call_id, outcome, failed))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the caller is gone

        try:
            async with trio.open_nursery() as nursery:
                while True:
                    frame = await reader.receive()
                    if frame is None:
                        # The caller is gone: nothing waits for its calls.
                        nursery.cancel_scope.cancel()
                        break
                    call_id, method, args = pickle.loads(frame)
                    if method == CANCEL:
                        # Frames arrive in order: a call's cancel never
                        # comes before the call.
                        if call_id in scopes:
                            scopes[call_id].cancel()
                    else:
                        nursery.start_soon(answer, call_id, method, args)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


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
    async def connect(cls, host: str, port: int, token: bytes) -> Channel:
        stream = await trio.open_tcp_stream(host, port)
        channel = cls(stream)
        try:
            await _send_frame(stream, token)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        trio.lowlevel.spawn_system_task(channel._read_replies, name="sandboxns.ray channel")
        return channel

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
        # Shielded: a frame half sent would garble every later one.
        with trio.CancelScope(shield=True):
            async with self._sending:
                try:
                    await _send_frame(self._stream, payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._close()
                    raise ChannelClosed from None

    async def _read_replies(self) -> None:
        reader = _FrameReader(self._stream)
        try:
            while (frame := await reader.receive()) is not None:
                call_id, failed, outcome = pickle.loads(frame)
                pending = self._pending.get(call_id)
                if pending is not None:  # else its caller stopped waiting
                    pending.failed, pending.outcome = failed, outcome
                    pending.done.set()
        except Exception:
            logger.debug("channel closed", exc_info=True)
        finally:
            self._close()

    def _close(self) -> None:
        """Fail every call still waiting: its reply will never come."""
        self.closed = True
        for pending in self._pending.values():
            if not pending.done.is_set():
                pending.failed, pending.outcome = True, ChannelClosed()
                pending.done.set()
