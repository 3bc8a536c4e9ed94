"""Moving a command's bytes: its output into a sink, its input data in.

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


class CommandPipes:
    """The host ends of one command's pipes. The driver gives the other
    ends (:attr:`child_fds`: stdin or None, stdout, stderr) to the command
    and then closes them with :meth:`close_child_ends`."""

    def __init__(self, sink: OutputSink, stdin: int | bytes | None) -> None:
        """``stdin`` is an fd to hand the command as is, bytes to feed it, or
        None (the driver supplies an empty input)."""
        self._sink = sink
        self._names: dict[int, str] = {}
        self._input = memoryview(b"")
        self._input_fd = -1
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
            if isinstance(stdin, bytes):
                read_end, self._input_fd = os.pipe2(os.O_CLOEXEC)
                self._owned_child_fds.append(read_end)
                os.set_blocking(self._input_fd, False)  # our end only: the flag is per open file
                self._input = memoryview(stdin)
                self._epoll.register(self._input_fd, select.EPOLLOUT)
                stdin = read_end
            self.child_fds: tuple[int | None, int, int] = (stdin, *ends)
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
                    elif event_fd == self._input_fd:
                        self._write_input()
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

    def _write_input(self) -> None:
        try:
            while self._input:
                self._input = self._input[os.write(self._input_fd, self._input[:_WRITE_CHUNK]) :]
        except BlockingIOError:
            return
        except OSError:
            pass  # EPIPE: a command may exit without reading its input; its business
        self._epoll.unregister(self._input_fd)
        os.close(self._input_fd)
        self._input_fd = -1

    def _forget(self, fd: int) -> None:
        self._epoll.unregister(fd)
        os.close(fd)
        del self._names[fd]

    def close(self) -> None:
        """Close every host end (idempotent)."""
        for fd in list(self._names):
            self._forget(fd)
        if self._input_fd >= 0:
            self._epoll.unregister(self._input_fd)
            os.close(self._input_fd)
            self._input_fd = -1
        if not self._epoll.closed:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()
