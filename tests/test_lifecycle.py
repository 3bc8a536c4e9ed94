"""Session lifetime: nothing leaks into the guest or the host, and nothing of
a session survives it, even when the host process is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import trio
from conftest import descendants, host_processes_with, kill_native_holder, sleep_marker

import sandboxns


@pytest.mark.smoke
async def test_guest_sees_only_stdio(session):
    # ls lists the shell's table, not its own (which has ls's directory fd).
    result = await session.run("/bin/sh", ["-c", "ls /proc/$$/fd"])
    assert result.stdout.split() == ["0", "1", "2"]


@pytest.mark.smoke
async def test_no_fd_or_process_leak_in_the_host_after_1000_runs(session):
    await session.run("true")
    host_fds, resident = len(os.listdir("/proc/self/fd")), len(descendants(os.getpid()))
    for _ in range(1000):
        result = await session.run("true")
        assert result.exit_code == 0
    assert len(os.listdir("/proc/self/fd")) == host_fds
    # What the driver keeps (the native holder and its prepared init), plus
    # at most the native init of the last command, which reports before it
    # has quite finished exiting.
    assert len(descendants(os.getpid())) <= resident + 1


@pytest.mark.smoke
@pytest.mark.skipif(os.geteuid() != 0, reason="the holder is non-dumpable: only root may inspect it")
async def test_native_holder_keeps_no_fds_per_command(workspace):
    async with sandboxns.open_sandbox(workspace, driver="native") as session:

        def holder_fds() -> int:
            return len(os.listdir(f"/proc/{session.driver._pid}/fd"))

        await session.run("true")
        launcher_fds = holder_fds()
        for _ in range(200):
            await session.run("true")
        assert holder_fds() == launcher_fds


async def test_stop_kills_running_commands(driver_name, workspace):
    marker = sleep_marker()
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session, trio.open_nursery() as nursery:
        fifo = workspace / "started"
        os.mkfifo(fifo)

        async def run_until_stopped() -> None:
            with pytest.raises(sandboxns.SandboxError) as error:
                await session.run("/bin/sh", ["-c", f"echo > /workspace/started; sleep {marker}"])
            assert error.value.code == sandboxns.ErrorCode.SANDBOX_STOPPED

        nursery.start_soon(run_until_stopped)
        await trio.to_thread.run_sync(fifo.read_bytes)
        await session.driver.aclose()
    assert host_processes_with(marker) == []


async def test_a_native_holder_killed_from_the_host_fails_a_command_then_the_session_is_stopped(workspace):
    async with sandboxns.open_sandbox(workspace, driver="native") as session:
        await kill_native_holder(session)
        # The first to find it gone learns what happened; then it is stopped.
        for code in (sandboxns.ErrorCode.SANDBOX_UNAVAILABLE, sandboxns.ErrorCode.SANDBOX_STOPPED):
            with pytest.raises(sandboxns.SandboxError) as error:
                await session.run("true")
            assert error.value.code == code, error.value
        with pytest.raises(sandboxns.SandboxError) as error:
            await session.read_file("x")
        assert error.value.code == sandboxns.ErrorCode.SANDBOX_STOPPED


@pytest.mark.smoke
def test_sigkill_of_the_host_leaves_no_sandbox_process(tmp_path):
    marker = sleep_marker()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    host_program = textwrap.dedent(
        f"""
        import sys, trio, sandboxns

        async def main():
            async with sandboxns.open_sandbox({str(workspace)!r}) as session:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(session.run, "/bin/sh",
                        ["-c", "setsid sleep {marker} & sleep {marker} & echo > /workspace/started; wait"])
                    await trio.to_thread.run_sync(lambda: open({str(workspace / "started")!r}, "rb").read())
                    print("ready", flush=True)
                    await trio.sleep_forever()

        trio.run(main)
        """
    )
    os.mkfifo(workspace / "started")
    host = subprocess.Popen([sys.executable, "-c", host_program], stdout=subprocess.PIPE, cwd=tmp_path)
    try:
        assert host.stdout.readline() == b"ready\n"
        # Everything the sandbox consists of, as the host kernel sees it.
        sandbox = descendants(host.pid)
        # The guest's processes are among them (the check below is not vacuous).
        assert set(host_processes_with(marker)) & sandbox
        pidfds = [os.pidfd_open(pid) for pid in sandbox]
    finally:
        host.kill()
        host.wait()
    try:
        # A pidfd becomes readable when its process exits: wait for all of
        # them, with a generous bound rather than a sleep.
        for pidfd in pidfds:
            subprocess_wait(pidfd, timeout=10)
        assert host_processes_with(marker) == []
    finally:
        for pidfd in pidfds:
            os.close(pidfd)


def subprocess_wait(pidfd: int, timeout: float) -> None:
    import select

    readable, _, _ = select.select([pidfd], [], [], timeout)
    assert readable, "a sandbox process outlived its host"


async def test_session_outlives_trio_worker_threads(driver_name, workspace, monkeypatch):
    """The holder's parent-death signal fires when the *thread* that spawned
    it exits. Trio's worker threads exit when idle, so a holder started from
    one would die with it; ours is started from the trio thread."""
    from trio._core import _thread_cache

    monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 0.01)
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
        workers: list[threading.Thread] = []
        await trio.to_thread.run_sync(lambda: workers.append(threading.current_thread()))
        workers[0].join()  # returns once the idle worker has exited
        assert not workers[0].is_alive()
        assert (await session.run("true")).exit_code == 0


async def test_a_command_outlives_trios_idle_worker_threads(session):
    """Trio retires an idle worker thread after 10 s, and a parent-death
    signal fires when the *thread* that started a process ends: nothing of a
    command may be started from a worker thread."""
    result = await session.run("sleep", ["11"], timeout=20)
    assert (result.exit_code, result.timed_out) == (0, False)


@pytest.mark.smoke
async def test_a_kill_during_setup_kills_the_command(session):
    for timeout in (0.0005, 0.001, 0.002, 0.004, 0.008):
        marker = sleep_marker()
        result = await session.run("sleep", [marker], timeout=timeout)
        assert result.timed_out
        assert host_processes_with(marker) == []


@pytest.mark.smoke
async def test_closing_the_driver_while_commands_start(driver_name, workspace):
    for delay in (0, 0.0002, 0.0005, 0.001, 0.003):
        marker = sleep_marker()
        async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
            outcomes = []

            async def run(session=session, marker=marker, outcomes=outcomes) -> None:
                try:
                    await session.run("sh", ["-c", f"sleep {marker}; echo late > late"])
                except sandboxns.SandboxError as exc:
                    outcomes.append(exc.code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await trio.sleep(delay)  # not synchronisation: the point is to race
                await session.driver.aclose()
        assert outcomes == [sandboxns.ErrorCode.SANDBOX_STOPPED]
        assert host_processes_with(marker) == []
        assert not (workspace / "late").exists()
