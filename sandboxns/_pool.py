"""Sessions started ahead of need, handed out at once (Backend.pool and
Backend.pool_forks).

A pool keeps its size of sessions ready; its own task in the backend's
nursery starts another whenever one is handed out or the size grows, and
sleeps otherwise. A start that fails stops the filling until the pool is
asked to fill again, and that caller is given the failure.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Generic, Protocol, TypeVar

import trio

from ._errors import SandboxError, invalid_argument

MAX_POOL_SIZE = 1024
# The key of the pool of sessions started ahead for forks (Backend.pool_forks).
FORK_POOL = "forks"


class Pooled(Protocol):
    async def delete(self) -> None: ...


Handle = TypeVar("Handle", bound=Pooled)


class _Pool(Generic[Handle]):
    """The sessions of one key waiting to be handed out."""

    def __init__(self, size: int, make: Callable[[], Awaitable[Handle]]) -> None:
        self.make = make
        self.size = size
        self.ready: collections.deque[Handle] = collections.deque()
        self.wake = trio.Event()  # a hand-out, a new size, or the end
        self.filled = trio.Event()  # another session is ready (or failed)
        self.failure: SandboxError | None = None


class SessionPools(Generic[Handle]):
    """A backend's pools, by key: a template's key, or FORK_POOL (sessions
    ready to take a snapshot's layers)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._pools: dict[str, _Pool[Handle]] = {}
        self._closed = False

    async def fill(self, key: str, size: int, make: Callable[[], Awaitable[Handle]]) -> None:
        """Keep ``size`` sessions of ``key`` ready, each made by ``make``
        (the first call's ``make`` stays the pool's); returns once there
        are that many, or raises why one could not start. Deletes those
        beyond a smaller size."""
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_POOL_SIZE:
            raise invalid_argument(f"size must be an integer from 0 to {MAX_POOL_SIZE}, not {size!r}")
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(size, make)
            self._nursery.start_soon(self._keep_filled, pool)
        pool.size = size
        pool.failure = None
        pool.wake.set()
        while len(pool.ready) < size and pool.failure is None:
            await pool.filled.wait()
        while len(pool.ready) > size:
            await pool.ready.pop().delete()
        if pool.failure is not None:
            raise pool.failure

    def waiting(self, key: str) -> list[Handle]:
        """The sessions of ``key`` ready now, oldest first."""
        pool = self._pools.get(key)
        return [] if pool is None else list(pool.ready)

    @contextlib.contextmanager
    def taking(self, key: str, n: int) -> Iterator[list[Handle]]:
        """Up to ``n`` of the sessions ready in ``key``'s pool, now the
        caller's; their replacements start once the block ends, so that
        they do not compete with the hand-out for the host's cores."""
        pool = self._pools.get(key)
        if pool is None:
            yield []
            return
        taken = [pool.ready.popleft() for _ in range(min(n, len(pool.ready)))]
        try:
            yield taken
        finally:
            pool.wake.set()

    async def _keep_filled(self, pool: _Pool[Handle]) -> None:
        """A pool's task: start sessions until it is full, then sleep until
        one is handed out or the size changes."""
        while not self._closed:
            while len(pool.ready) < pool.size and pool.failure is None and not self._closed:
                try:
                    handle = await pool.make()
                except SandboxError as exc:
                    pool.failure = exc  # reported to whoever waits in fill()
                else:
                    pool.ready.append(handle)
                pool.filled.set()
                pool.filled = trio.Event()
            await pool.wake.wait()
            pool.wake = trio.Event()

    async def aclose(self) -> None:
        """Stop filling, and delete every session nobody was given."""
        self._closed = True
        for pool in self._pools.values():
            pool.wake.set()
            while pool.ready:
                await pool.ready.pop().delete()
