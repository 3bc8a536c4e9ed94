"""What only the bwrap driver has: its dependency on bubblewrap, its failure
reporting, and its one documented difference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

import sandboxns
from sandboxns import ErrorCode, SandboxError, _bwrap
from sandboxns._lease import ProcessId

pytestmark = pytest.mark.smoke


@pytest.fixture
def bwrap_installed():
    if _bwrap.find_bwrap() is None:
        pytest.skip("bubblewrap is not installed")


async def test_bwrap_driver_without_bubblewrap_is_unavailable(workspace, monkeypatch):
    monkeypatch.setattr(_bwrap, "find_bwrap", lambda: None)
    with pytest.raises(SandboxError) as error:
        async with sandboxns.open_sandbox(workspace, driver="bwrap"):
            pass
    assert error.value.code == ErrorCode.SANDBOX_UNAVAILABLE
    assert "bubblewrap" in error.value.message


@pytest.fixture
def open_directory():
    """A directory anyone may pass through: a root host runs bwrap as its
    guests' unprivileged host user, who cannot enter pytest's tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="sandboxns-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


async def test_bwrap_setup_failure_is_unavailable_with_its_message(workspace, open_directory, monkeypatch):
    """A bwrap that cannot make namespaces (here, a stand-in that fails the
    way bwrap does) gives SANDBOX_UNAVAILABLE carrying bwrap's own words,
    never an exit code."""
    fake = open_directory / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(_bwrap, "find_bwrap", lambda: str(fake))
    with pytest.raises(SandboxError) as error:
        async with sandboxns.open_sandbox(workspace, driver="bwrap"):
            pass
    assert error.value.code == ErrorCode.SANDBOX_UNAVAILABLE
    assert "Creating new namespace failed" in error.value.message


async def test_bwrap_reports_statuses_above_128_as_signals(workspace, bwrap_installed):
    """bwrap passes a command killed by signal N on as status 128+N, so an
    explicit `exit 130` looks the same: the documented difference from the
    native driver, which reports it as exit code 130."""
    async with sandboxns.open_sandbox(workspace, driver="bwrap") as session:
        result = await session.run("sh", ["-c", "exit 130"])
        assert (result.exit_code, result.signal) == (None, 2)
        result = await session.run("sh", ["-c", "exit 128"])
        assert (result.exit_code, result.signal) == (128, None)


OWNER_SCRIPT = """
import sys, trio, sandboxns

async def main():
    async with sandboxns.open_sandbox(sys.argv[1], driver="bwrap") as session:
        print(session.driver._private, flush=True)
        sys.stdin.read()  # until killed

trio.run(main)
"""


def _files_of_a_killed_owner(workspace: Path) -> Path:
    """Where a bwrap session's owner, killed by SIGKILL (so it removed
    nothing), kept its files."""
    with subprocess.Popen(
        [sys.executable, "-P", "-c", OWNER_SCRIPT, str(workspace)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as owner:
        left = Path(owner.stdout.readline().decode().strip())
        owner.kill()
        owner.wait()
    return left


async def test_a_killed_owners_files_are_reclaimed_by_the_next_session(bwrap_installed, open_directory):
    left = await trio.to_thread.run_sync(_files_of_a_killed_owner, open_directory)
    assert left.parent == _bwrap.private_root() and (left / "etc" / "passwd").exists()
    async with sandboxns.open_sandbox(open_directory, driver="bwrap") as session:
        assert not left.exists()
        own = session.driver._private
        assert own.parent == _bwrap.private_root()
    assert not own.exists()


async def test_only_a_live_owners_files_are_kept_whatever_its_pid(bwrap_installed, open_directory):
    # Named after pid and start time: a reused pid does not keep a dead
    # owner's files, and a live owner's stay.
    us = ProcessId.of(os.getpid())
    _bwrap.private_root().mkdir(mode=0o711, exist_ok=True)
    reused = _bwrap.private_root() / f"{us.pid}.{us.start + 1}-left"
    live = _bwrap.private_root() / f"{us.pid}.{us.start}-ours"
    reused.mkdir()
    live.mkdir()
    try:
        async with sandboxns.open_sandbox(open_directory, driver="bwrap"):
            assert not reused.exists() and live.exists()
    finally:
        live.rmdir()
