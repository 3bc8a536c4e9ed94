"""Moving a command's bytes: its output into a sink, its input in.

A command has up to three pipes and one more fd that says it has ended (the
native holder's report socket, bwrap's pidfd). Serving each from its own trio
task cost ~70 µs per command in task switches and epoll re-registrations, a
tenth of running ``/usr/bin/true``. So the pipes live in one private epoll
set and a driver's ``wait()`` waits, in its own task, for its end-of-command
fd *or* a pipe to be ready (:meth:`CommandPipes.until_readable`): one wakeup
path, no nursery.

Once the command's whole tree is gone, nothing can write to its pipes any
more: what it wrote is in the pipe buffers, so :meth:`CommandPipes.finish`
reads what is there without waiting for EOF. (A guest can pass its stdout to
a sibling command over a Unix socket; waiting for EOF would then hang the
caller until the sibling exits.)
"""

from __future__ import annotations

import contextlib
import os
import select
from dataclasses import dataclass, field
from typing import Protocol

import trio

_READ_CHUNK = 65536
# Reads per ready pipe before looking at the others again: a writer as fast
# as we read must not starve them.
_READS_PER_EVENT = 16
_WRITE_CHUNK = 65536
# How much of stderr drivers may inspect (bwrap's own failure message).
STDERR_HEAD = 4096


class OutputSink(Protocol):
    """Where a running command's output goes."""

    def feed(self, name: str, chunk: bytes) -> bool:
        """Take a chunk of the stream ``name`` ("stdout" or "stderr").
        Returning True asks for the command to be killed: the sink has had
        enough."""
        ...


@dataclass
class OutputCollector:
    """An output sink that keeps at most ``limit`` bytes of stdout and
    stderr together. Past that it drops the rest (so a command never blocks
    on a full pipe however much it writes), or with ``stop_when_full`` asks
    for the command to be killed. ``run`` uses one; pass one to
    ``Session.execute`` to have the result carry the output."""

    limit: int
    stop_when_full: bool = False
    kept: int = 0
    truncated: bool = False
    chunks: dict[str, list[bytes]] = field(default_factory=lambda: {"stdout": [], "stderr": []})

    def feed(self, name: str, chunk: bytes) -> bool:
        room = self.limit - self.kept
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[:room]
        if chunk:
            self.chunks[name].append(chunk)
            self.kept += len(chunk)
        return self.truncated and self.stop_when_full

    def output(self, name: str) -> bytes:
        """What was kept of the named stream."""
        return b"".join(self.chunks[name])


class _Input:
    """Feeds a command's stdin pipe from data, or from a host fd as that fd
    delivers, through the pump's epoll set. The host fd itself never reaches
    the guest: through /proc/self/fd a guest reopens any fd it holds, so a
    host file given as input could be opened for writing."""

    def __init__(self, epoll: select.epoll, data: bytes, source: int | None) -> None:
        self._epoll = epoll
        self._pending = memoryview(data)
        self._source = source
        self._source_polled = False
        # The one fd whose readiness moves the input on: the pipe while
        # there is something to write (or a file to read at will), the
        # source while there is not.
        self.waits_on = -1
        self.child_end, self._pipe = os.pipe2(os.O_CLOEXEC)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(os.close, self.child_end)
            cleanup.callback(self.close)
            os.set_blocking(self._pipe, False)  # our end only: the flag is per open file
            if source is not None:
                try:
                    self._wait_on(source, select.EPOLLIN)
                    self._source_polled = True
                except PermissionError:
                    # epoll refuses regular files (and /dev/null): they are
                    # always ready, so they are read whenever the pipe drains.
                    pass
            if not self._source_polled:
                self._wait_on(self._pipe, select.EPOLLOUT)
            cleanup.pop_all()

    def _wait_on(self, fd: int, events: int) -> None:
        if self.waits_on >= 0:
            self._epoll.unregister(self.waits_on)
            self.waits_on = -1
        self._epoll.register(fd, events)
        self.waits_on = fd

    def ready(self) -> None:
        """``waits_on`` is ready: move as much as can move now."""
        if self.waits_on == self._source:
            if not self._take_source():
                self.close()
                return
            self._wait_on(self._pipe, select.EPOLLOUT)
        while True:
            try:
                while self._pending:
                    self._pending = self._pending[os.write(self._pipe, self._pending[:_WRITE_CHUNK]) :]
            except BlockingIOError:
                return  # on when the pipe drains
            except OSError:
                break  # EPIPE: a command may exit without reading its input; its business
            if self._source is None:
                break
            if self._source_polled:
                self._wait_on(self._source, select.EPOLLIN)
                return
            if not self._take_source():
                break
        self.close()

    def _take_source(self) -> bool:
        """Read the source's next chunk; False at its end. A polled source
        is read once per readiness, so the read does not block (its file
        status flags are the caller's, and stay as they are)."""
        try:
            chunk = os.read(self._source, _READ_CHUNK)
        except OSError:
            chunk = b""  # a directory, say: no more input
        self._pending = memoryview(chunk)
        return bool(chunk)

    def close(self) -> None:
        """End the command's input (idempotent); the source stays open."""
        if self.waits_on >= 0:
            self._epoll.unregister(self.waits_on)
            self.waits_on = -1
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1


class CommandPipes:
    """The host ends of one command's pipes. The driver gives the other
    ends (:attr:`child_fds`: stdin or None, stdout, stderr) to the command
    and then closes them with :meth:`close_child_ends`."""

    def __init__(self, sink: OutputSink, stdin: int | bytes | None) -> None:
        """``stdin`` is bytes to feed the command, a host fd to copy its
        input from as that delivers, or None (the driver supplies an empty
        input)."""
        self._sink = sink
        self._names: dict[int, str] = {}
        self._input: _Input | None = None
        self._owned_child_fds: list[int] = []
        self._wants_kill = False
        self.stderr_head = bytearray()
        self._epoll = select.epoll(flags=select.EPOLL_CLOEXEC)
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(self.close)
            cleanup.callback(self.close_child_ends)
            ends = []
            for name in ("stdout", "stderr"):
                read_end, write_end = os.pipe2(os.O_CLOEXEC)
                self._owned_child_fds.append(write_end)
                self._watch(read_end, name)
                ends.append(write_end)
            stdin_end = None
            if stdin is not None:
                data, source = (stdin, None) if isinstance(stdin, bytes) else (b"", stdin)
                self._input = _Input(self._epoll, data, source)
                self._owned_child_fds.append(self._input.child_end)
                stdin_end = self._input.child_end
            self.child_fds: tuple[int | None, int, int] = (stdin_end, *ends)
            cleanup.pop_all()

    def _watch(self, fd: int, name: str) -> None:
        os.set_blocking(fd, False)
        self._names[fd] = name
        self._epoll.register(fd, select.EPOLLIN)

    def close_child_ends(self) -> None:
        """Close our copies of the command's ends, once it has its own."""
        for fd in self._owned_child_fds:
            os.close(fd)
        self._owned_child_fds = []

    def take_kill_request(self) -> bool:
        """True once, after the sink has asked for the command to die."""
        wanted, self._wants_kill = self._wants_kill, False
        return wanted

    async def until_readable(self, fd: int) -> None:
        """Move bytes until ``fd`` is readable, or until the sink asks for
        the command to be killed (see :meth:`take_kill_request`)."""
        self._epoll.register(fd, select.EPOLLIN)
        try:
            while True:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                ready = False
                for event_fd, _ in self._epoll.poll(0):
                    if event_fd == fd:
                        ready = True
                    elif self._input is not None and event_fd == self._input.waits_on:
                        self._input.ready()
                    else:
                        self._read(event_fd, _READS_PER_EVENT)
                if ready or self._wants_kill:
                    return
        finally:
            self._epoll.unregister(fd)

    def finish(self) -> None:
        """The command's tree is gone: take what it left in the pipes."""
        for fd in list(self._names):
            self._read(fd, None)

    def _read(self, fd: int, limit: int | None) -> None:
        name = self._names[fd]
        reads = 0
        while limit is None or reads < limit:
            reads += 1
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self._forget(fd)
                return
            if name == "stderr" and len(self.stderr_head) < STDERR_HEAD:
                self.stderr_head += chunk[: STDERR_HEAD - len(self.stderr_head)]
            if self._sink.feed(name, chunk):
                self._wants_kill = True

    def _forget(self, fd: int) -> None:
        self._epoll.unregister(fd)
        os.close(fd)
        del self._names[fd]

    def close(self) -> None:
        """Close every host end (idempotent)."""
        for fd in list(self._names):
            self._forget(fd)
        if self._input is not None:
            self._input.close()
        if not self._epoll.closed:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()
