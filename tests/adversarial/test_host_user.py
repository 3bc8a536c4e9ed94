"""A root host's guests run as an unprivileged host user, never as host
root, while the workspace keeps its owner on disk (see sandboxns._hostids)."""

from __future__ import annotations

import os

import pytest
import trio
from conftest import host_processes_with, sleep_marker, start_waiting_guest

import sandboxns
from sandboxns._hostids import guest_host_ids

pytestmark = [pytest.mark.smoke, pytest.mark.skipif(os.geteuid() != 0, reason="only a root host maps its guests")]


def _host_ids_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["Uid"].split()[1]), int(fields["Gid"].split()[1])


async def test_a_guest_is_an_unprivileged_host_user(driver_name, workspace):
    marker = sleep_marker()
    async with (
        sandboxns.open_sandbox(workspace, driver=driver_name) as session,
        trio.open_nursery() as nursery,
    ):
        await start_waiting_guest(session, workspace, nursery, marker)
        pids = [pid for pid in host_processes_with(marker) if _host_ids_of(pid) != (0, 0)]
        ids = {_host_ids_of(pid) for pid in host_processes_with(marker)}
        nursery.cancel_scope.cancel()
    # Every process carrying the guest's command line that is not the
    # host's own (bwrap's outer process starts as root) is the guests' user.
    assert pids and ids <= {guest_host_ids(), (0, 0)}
    assert guest_host_ids() != (0, 0) and guest_host_ids()[0] != 0


@pytest.mark.parametrize("owner", [(0, 0), (4321, 4322)])
async def test_the_workspace_keeps_its_owner_and_is_the_guests(driver_name, workspace, owner):
    os.chown(workspace, *owner)
    (workspace / "from-host").write_bytes(b"host")
    os.chown(workspace / "from-host", *owner)
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
        result = await session.run(
            "sh", ["-c", "stat -c '%u:%g' /workspace /workspace/from-host; echo guest >> from-host; echo x > made"]
        )
        await session.write_file("written", b"by the host api")
        await session.mkdir("dir")
        seen = await session.run("stat", ["-c", "%u:%g", "/workspace/written", "/workspace/dir"])
    assert result.exit_code == 0, result
    assert result.stdout.split() == ["1000:1000", "1000:1000"]  # the guest's own
    assert seen.stdout.split() == ["1000:1000", "1000:1000"]
    assert (workspace / "from-host").read_bytes() == b"hostguest\n"
    for name in ("from-host", "made", "written", "dir"):
        stat = (workspace / name).stat()
        assert (stat.st_uid, stat.st_gid) == owner, name  # on disk, still the owner's
