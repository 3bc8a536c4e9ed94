"""Leases across OS processes: one owner at a time, automatic recovery when a
crashed owner's session is provably gone, and the operator commands when it
is not."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from conftest import host_processes_with, sleep_marker

import sandboxns
from sandboxns import ErrorCode, SandboxError, _lease

pytestmark = pytest.mark.smoke

OWNER = str(Path(__file__).with_name("lease_owner.py"))


class Owner:
    """lease_owner.py in its own process, read line by line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    @classmethod
    async def start(cls, driver: str, state_dir: Path, mode: str, *arguments: str) -> Owner:
        process = await trio.lowlevel.open_process(
            [sys.executable, OWNER, driver, str(state_dir), mode, *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        return cls(process)

    async def line(self) -> str:
        with trio.fail_after(20):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(4096)
                assert chunk, f"owner exited early: {self._buffer!r}"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    async def finish(self) -> int:
        await self.process.stdin.aclose()
        with trio.fail_after(20):
            return await self.process.wait()


def sandboxns_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandboxns", *args], check=False, capture_output=True, text=True, cwd="/"
    )


async def test_two_processes_contend_and_a_crashed_owner_is_recovered(driver_name, state_dir):
    marker = sleep_marker()
    first = await Owner.start(driver_name, state_dir, "create", marker)
    state = await first.line()
    assert await first.line() == "running"
    assert host_processes_with(marker)

    second = await Owner.start(driver_name, state_dir, "resume", state)
    refusal = await second.line()
    assert refusal.startswith("SANDBOX_BUSY") and f"process {first.process.pid}" in refusal
    assert await second.finish() == 0

    first.process.kill()  # SIGKILL, mid-command
    await first.process.wait()
    third = await Owner.start(driver_name, state_dir, "resume", state)
    assert await third.line() == "resumed before_the_crash"
    assert host_processes_with(marker) == []  # nothing of the first owner's session is left
    assert await third.finish() == 0
    listing = sandboxns_cli("lease", "list", "--state-dir", str(state_dir))
    assert listing.returncode == 0 and f"{json.loads(state)['session']}  free" in listing.stdout


def test_a_zombie_is_gone():
    # Exited, not yet reaped: it holds nothing of a session (its pidfd is
    # readable), so a lease whose record lists it is free of processes.
    child = subprocess.Popen(["sleep", sleep_marker()])
    process = _lease.ProcessId.of(child.pid)
    assert process is not None and process.alive()
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # waits for the exit, leaves the zombie
    assert not process.alive() and _lease.LeaseRecord(processes=(process,)).remaining() == []
    assert child.wait() == -9


async def test_when_safety_cannot_be_proven_the_operator_decides(driver_name, state_dir, monkeypatch):
    monkeypatch.setattr(_lease, "TEARDOWN_WAIT", 0.2)
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="t", files={"a": b"1"})
        handle = await backend.create(template=template.template_key)
        state = handle.capture_state()
        await handle.stop()
        session_dir = state_dir / "sessions" / state["session"]
        lease_file = session_dir / "lease"

        # 1. The lease is free, but a process of the session seems to remain.
        leftover = await trio.lowlevel.open_process(["sleep", sleep_marker()])
        record = _lease.LeaseRecord(processes=(_lease.ProcessId.of(leftover.pid),))
        lease_file.write_text(json.dumps(record.as_json()))
        with pytest.raises(SandboxError) as error:
            await backend.create(template=template.template_key, state=state)
        assert error.value.code == ErrorCode.SANDBOX_BUSY
        assert f"lease list --state-dir {state_dir}" in error.value.message
        listing = sandboxns_cli("lease", "list", "--state-dir", str(state_dir))
        assert f"processes remain (pid {leftover.pid})" in listing.stdout
        refusal = sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), state["session"])
        assert refusal.returncode != 0 and "--force" in refusal.stderr
        assert leftover.poll() is None  # nothing was killed without --force
        forced = sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), state["session"], "--force")
        assert forced.returncode == 0, forced.stderr
        assert await leftover.wait() == -9
        resumed = await backend.create(template=template.template_key, state=state)
        await resumed.stop()

        # 2. Someone other than the recorded (dead) owner locks the lease.
        stuck = os.open(lease_file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(stuck, fcntl.LOCK_EX)
            with pytest.raises(SandboxError) as error:
                await backend.create(template=template.template_key, state=state)
            assert error.value.code == ErrorCode.SANDBOX_BUSY and "lease clear" in error.value.message
            assert "not its recorded owner" in sandboxns_cli("lease", "list", "--state-dir", str(state_dir)).stdout
            assert sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), state["session"]).returncode != 0
            forced = sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), state["session"], "--force")
            assert forced.returncode == 0, forced.stderr
            # The stuck process's lock no longer counts: the file was replaced.
            resumed = await backend.create(template=template.template_key, state=state)
            assert await resumed.session.read_text_file("a") == "1"
            await resumed.delete()
        finally:
            os.close(stuck)
    assert sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), state["session"]).returncode != 0


async def test_a_forced_clear_takes_the_session_from_a_live_owner(driver_name, state_dir):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="t", files={})
        handle = await backend.create(template=template.template_key)
        session_id = handle.session_id
        assert sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), session_id).returncode != 0
        assert (await handle.session.run("true")).exit_code == 0
        forced = sandboxns_cli("lease", "clear", "--state-dir", str(state_dir), session_id, "--force")
        assert forced.returncode == 0, forced.stderr
        for operation in (handle.session.run("true"), handle.session.write_file("late", b"x")):
            with pytest.raises(SandboxError) as error:
                await operation  # the session is no longer this handle's
            assert error.value.code == ErrorCode.SANDBOX_STOPPED
        taker = await backend.create(template=template.template_key, state=handle.capture_state())
        with pytest.raises(SandboxError) as error:
            await handle.delete()
        assert error.value.code == ErrorCode.SANDBOX_BUSY
        await handle.shutdown()
        await taker.delete()
        assert os.listdir(state_dir / "sessions") == []


async def torn_down(session_dir: Path) -> None:
    """Wait until nothing is left of a dead owner's session: its lease free
    (the native launcher holds it until then) and its recorded processes
    gone."""
    lease = os.open(session_dir / "lease", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with trio.fail_after(20):
            await trio.to_thread.run_sync(fcntl.flock, lease, fcntl.LOCK_EX, abandon_on_cancel=True)
    finally:
        os.close(lease)
    assert await _lease.wait_all_gone(_lease.read_record(session_dir / "lease").processes, 20) == []


def last_seen(session_dir: Path, seconds_ago: float) -> None:
    """Set the time the session's owner was last known alive (its lease's
    modification time, the retention clock)."""
    then = time.time() - seconds_ago
    os.utime(session_dir / "lease", (then, then))


async def test_gc_spares_a_session_another_process_holds_and_collects_it_once_that_owner_died(driver_name, state_dir):
    marker = sleep_marker()
    owner = await Owner.start(driver_name, state_dir, "create", marker, "3600")
    session_id = json.loads(await owner.line())["session"]
    assert await owner.line() == "running"
    session_dir = state_dir / "sessions" / session_id
    last_seen(session_dir, 3601)  # as old as it gets: only the held lease keeps it
    gc = sandboxns_cli("gc", "--state-dir", str(state_dir))
    assert (gc.returncode, gc.stdout) == (0, ""), gc.stderr
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        assert await backend.collect_expired() == []
    assert session_dir.is_dir() and host_processes_with(marker)

    owner.process.kill()  # it never stops the session: the retention counts from its last sign of life
    await owner.process.wait()
    await torn_down(session_dir)
    last_seen(session_dir, 60)
    assert sandboxns_cli("gc", "--state-dir", str(state_dir)).stdout == ""
    last_seen(session_dir, 3601)
    dry_run = sandboxns_cli("gc", "--state-dir", str(state_dir), "--dry-run")
    assert (dry_run.returncode, dry_run.stdout) == (0, f"{session_id}  expired\n"), dry_run.stderr
    assert session_dir.is_dir()
    gc = sandboxns_cli("gc", "--state-dir", str(state_dir))
    assert (gc.returncode, gc.stdout) == (0, f"{session_id}  deleted\n"), gc.stderr
    assert os.listdir(state_dir / "sessions") == [] and host_processes_with(marker) == []


async def test_session_delete_refuses_a_held_session_and_deletes_a_stopped_one(driver_name, state_dir):
    marker = sleep_marker()
    owner = await Owner.start(driver_name, state_dir, "create", marker)
    session_id = json.loads(await owner.line())["session"]
    assert await owner.line() == "running"
    session_dir = state_dir / "sessions" / session_id
    listing = sandboxns_cli("session", "list", "--state-dir", str(state_dir))
    assert listing.stdout == f"{session_id}  held by process {owner.process.pid}\n", listing.stderr
    held = sandboxns_cli("session", "delete", "--state-dir", str(state_dir), session_id)
    assert held.returncode == 125 and "in use" in held.stderr, held
    assert session_dir.is_dir() and host_processes_with(marker)

    owner.process.kill()
    await owner.process.wait()
    await torn_down(session_dir)
    deleted = sandboxns_cli("session", "delete", "--state-dir", str(state_dir), session_id)
    assert (deleted.returncode, deleted.stdout) == (0, f"{session_id}  deleted\n"), deleted.stderr
    assert os.listdir(state_dir / "sessions") == [] and host_processes_with(marker) == []
    again = sandboxns_cli("session", "delete", "--state-dir", str(state_dir), session_id)
    assert again.returncode == 127 and "no session" in again.stderr


@pytest.mark.parametrize(
    "command", [("lease", "list"), ("session", "list"), ("gc",), ("snapshot", "list"), ("session", "delete", "x")]
)
def test_operator_commands_refuse_a_state_directory_that_does_not_exist(tmp_path, command):
    missing = tmp_path / "nonexistent"
    done = sandboxns_cli(*command, "--state-dir", str(missing))
    assert done.returncode == 127 and f"no state directory {missing}" in done.stderr, done
    assert not missing.exists()
