"""Command admission: at most max_concurrent_commands commands of a backend
run at once, a full backend refuses before any process starts, and every
slot comes back however its command ends."""

from __future__ import annotations

import os

import pytest
import trio
from conftest import host_processes_with, sleep_marker

import sandboxns
from sandboxns import ErrorCode, SandboxError

pytestmark = pytest.mark.smoke


def peak_concurrency(log: str) -> int:
    """Each command appends "s" when it starts and "e" before it ends; the
    peak of starts minus ends is a lower bound of how many ran at once."""
    running = peak = 0
    for line in log.split():
        running += 1 if line == "s" else -1
        peak = max(peak, running)
    return peak


async def test_the_limit_holds_under_200_concurrent_attempts(driver_name, state_dir, workspace):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        # Two sessions over one directory: the limit is per backend, and the
        # log they share shows how many commands overlapped.
        sessions = [(await backend.create(workspace=workspace)).session for _ in range(2)]
        refusals = 0
        completed = 0

        async def attempt(i: int) -> None:
            nonlocal refusals, completed
            while True:
                try:
                    result = await sessions[i % 2].run("sh", ["-c", "echo s >> log; sleep 0.05; echo e >> log"])
                except SandboxError as exc:
                    assert exc.code == ErrorCode.SANDBOX_BUSY, exc
                    assert "max_concurrent_commands" in exc.message
                    refusals += 1
                    await trio.sleep(0.005)  # back off and retry, like a client would
                    continue
                assert result.exit_code == 0
                completed += 1
                return

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(attempt, i)
        log = (workspace / "log").read_text()
        assert completed == 200 and refusals > 0
        assert log.count("s") == 200
        assert peak_concurrency(log) <= backend.max_concurrent_commands
        assert backend.active_commands == 0


async def test_a_refused_command_never_starts(driver_name, state_dir, workspace):
    async with sandboxns.open_backend(
        driver=driver_name, state_directory=state_dir, max_concurrent_commands=1
    ) as backend:
        session = (await backend.create(workspace=workspace)).session
        started = workspace / "started"
        os.mkfifo(started)
        marker = sleep_marker()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run, "sh", ["-c", f"echo > started; sleep {marker}"])
            await trio.to_thread.run_sync(started.read_bytes)
            with pytest.raises(SandboxError) as error:
                await session.run("sh", ["-c", "echo ran > refused"])
            assert error.value.code == ErrorCode.SANDBOX_BUSY
            nursery.cancel_scope.cancel()
        assert not (workspace / "refused").exists()
        assert host_processes_with(marker) == []
        assert backend.active_commands == 0


async def test_every_ending_frees_its_slot(driver_name, state_dir, workspace):
    async with sandboxns.open_backend(
        driver=driver_name, state_directory=state_dir, max_concurrent_commands=2
    ) as backend:
        handle = await backend.create(workspace=workspace)
        session = handle.session
        marker = sleep_marker()

        # A deadline.
        result = await session.run("sleep", [marker], timeout=0.2)
        assert result.timed_out and backend.active_commands == 0
        # A command that cannot start.
        with pytest.raises(SandboxError):
            await session.run("/no/such/program")
        assert backend.active_commands == 0
        # A descendant outliving its leader is killed before the slot frees.
        await session.run("sh", ["-c", f"sleep {marker} & exit 0"])
        assert host_processes_with(marker) == [] and backend.active_commands == 0
        # Cancellation.
        with trio.move_on_after(0.2):
            await session.run("sleep", [marker])
        assert host_processes_with(marker) == [] and backend.active_commands == 0
        # Both slots taken, then the session stopped under them.
        fifos = [workspace / f"started{i}" for i in range(2)]
        async with trio.open_nursery() as nursery:
            for fifo in fifos:
                os.mkfifo(fifo)
                nursery.start_soon(_expect_stopped, session, marker, fifo.name)
            for fifo in fifos:
                await trio.to_thread.run_sync(fifo.read_bytes)
            assert backend.active_commands == 2
            await handle.stop()
        assert host_processes_with(marker) == [] and backend.active_commands == 0
        # Full capacity is back.
        other = (await backend.create(workspace=workspace)).session
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(other.run, "true")
        assert backend.active_commands == 0


async def _expect_stopped(session, marker: str, fifo: str) -> None:
    with pytest.raises(SandboxError) as error:
        await session.run("sh", ["-c", f"echo > {fifo}; sleep {marker}"])
    assert error.value.code == ErrorCode.SANDBOX_STOPPED
