"""Sessions in a cgroup v2 of their own, under a delegated directory.

This needs a cgroup v2 directory this process may manage: the one in
SANDBOXNS_TEST_CGROUP, or (as root) a child of a cgroup2 mount. Without one
the cases that need it skip; the refusals run everywhere."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import trio
from conftest import host_processes_with, sleep_marker, start_waiting_guest

import sandboxns
from sandboxns import ErrorCode, SandboxError

pytestmark = pytest.mark.smoke


def _cgroup2_mount() -> Path | None:
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            before, _, after = line.partition(" - ")
            if after.split()[0] == "cgroup2":
                return Path(before.split()[4])
    return None


@pytest.fixture
def cgroup_parent():
    """A fresh delegated directory, removed afterwards."""
    given = os.environ.get("SANDBOXNS_TEST_CGROUP")
    base = Path(given) if given else _cgroup2_mount() if os.geteuid() == 0 else None
    if base is None:
        pytest.skip("no cgroup v2 directory to manage: set SANDBOXNS_TEST_CGROUP to a delegated one")
    parent = base / f"sandboxns-test-{secrets.token_hex(4)}"
    parent.mkdir()
    yield parent
    for child in parent.iterdir():
        if child.is_dir():
            child.rmdir()
    parent.rmdir()


def _controllers(parent: Path) -> set[str]:
    return set((parent / "cgroup.controllers").read_text().split())


async def test_every_process_of_a_session_is_in_its_cgroup(driver_name, workspace, cgroup_parent):
    confinement = sandboxns.Confinement(cgroup=sandboxns.CgroupLimits(cgroup_parent))
    marker = sleep_marker()
    async with (
        sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement) as session,
        trio.open_nursery() as nursery,
    ):
        await start_waiting_guest(session, workspace, nursery, marker)
        [session_cgroup] = [child for child in cgroup_parent.iterdir() if child.is_dir()]
        members = {int(pid) for pid in (session_cgroup / "cgroup.procs").read_text().split()}
        guests = set(host_processes_with(marker))
        assert guests and guests <= members
        nursery.cancel_scope.cancel()
    # Stopped: killed through the cgroup, which is then removed.
    assert not session_cgroup.exists()
    assert host_processes_with(marker) == []


async def test_the_cgroups_limits_are_set(driver_name, workspace, cgroup_parent):
    if not {"memory", "pids", "cpu"} <= _controllers(cgroup_parent):
        pytest.skip(f"{cgroup_parent} does not offer the memory, pids and cpu controllers")
    limits = sandboxns.CgroupLimits(cgroup_parent, memory_max=256 << 20, pids_max=32, cpu_max=0.5)
    confinement = sandboxns.Confinement(cgroup=limits, limits=sandboxns.ResourceLimits(processes=None))
    async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement) as session:
        [session_cgroup] = [child for child in cgroup_parent.iterdir() if child.is_dir()]
        assert (session_cgroup / "memory.max").read_text().split() == [str(256 << 20)]
        assert (session_cgroup / "cpu.max").read_text().split() == ["50000", "100000"]
        # pids.max bounds the session even where RLIMIT_NPROC does not (host root).
        script = "import os\nn = 0\ntry:\n    while os.fork():\n        n += 1\nexcept OSError:\n    print(n)\n"
        result = await session.run("python3", ["-c", script], timeout=20)
        assert 0 < int(result.stdout.split()[0]) < 32, result


async def test_a_missing_controller_is_refused(workspace, cgroup_parent):
    wanted = {"memory": {"memory_max": 1 << 30}, "pids": {"pids_max": 10}, "cpu": {"cpu_max": 1}}
    absent = sorted(set(wanted) - _controllers(cgroup_parent))
    if not absent:
        pytest.skip("every controller is available here")
    limits = sandboxns.CgroupLimits(cgroup_parent, **wanted[absent[0]])
    with pytest.raises(SandboxError) as caught:
        async with sandboxns.open_sandbox(workspace, confinement=sandboxns.Confinement(cgroup=limits)):
            pass
    assert caught.value.code == ErrorCode.SANDBOX_UNAVAILABLE and absent[0] in caught.value.message
    assert [child for child in cgroup_parent.iterdir() if child.is_dir()] == []


async def test_a_directory_that_is_not_cgroup_v2_is_refused(driver_name, workspace, tmp_path):
    confinement = sandboxns.Confinement(cgroup=sandboxns.CgroupLimits(tmp_path, pids_max=10))
    with pytest.raises(SandboxError) as caught:
        async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement):
            pass
    assert caught.value.code == ErrorCode.SANDBOX_UNAVAILABLE
    assert "not a cgroup v2 directory" in caught.value.message


@pytest.mark.parametrize(
    "options",
    [
        {"parent": "relative/dir"},
        {"parent": "/x", "memory_max": 0},
        {"parent": "/x", "pids_max": True},
        {"parent": "/x", "cpu_max": 0},
    ],
)
def test_bad_cgroup_limits_are_refused(options):
    with pytest.raises(SandboxError) as caught:
        sandboxns.CgroupLimits(**options)
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT


def test_limits_become_the_cgroup_files_values():
    limits = sandboxns.CgroupLimits("/sys/fs/cgroup/x", memory_max=1 << 30, pids_max=64, cpu_max=1.5)
    assert limits.settings() == {
        "memory.max": str(1 << 30),
        "memory.swap.max": "0",
        "pids.max": "64",
        "cpu.max": "150000 100000",
    }
    assert sandboxns.CgroupLimits("/sys/fs/cgroup/x").settings() == {}
