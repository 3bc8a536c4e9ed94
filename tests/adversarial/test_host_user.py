"""A root host's guests run as an unprivileged host user, never as host
root, while the workspace keeps its owner on disk (see sandboxns._hostids)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from conftest import host_processes_with, sleep_marker, start_waiting_guest

import sandboxns
from sandboxns import _hostids
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
        # The command itself (bwrap's processes carry the marker too).
        [pid] = [
            p for p in host_processes_with(marker) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"python3\0")
        ]
        ids = _host_ids_of(pid)
        nursery.cancel_scope.cancel()
    assert ids == guest_host_ids() and 0 not in ids


def test_the_host_ids_come_from_the_sandboxns_subordinate_range(tmp_path):
    subuid = tmp_path / "subuid"
    subuid.write_text("alice:100000:65536\nsandboxns:1500000000:65536\n")
    assert _hostids._first_subordinate_id(str(subuid)) == 1500000000
    subuid.write_text("alice:100000:65536\nsandboxns:0:0\n")  # no usable range: the default
    assert _hostids._first_subordinate_id(str(subuid)) == _hostids.DEFAULT_HOST_ID
    assert _hostids._first_subordinate_id(str(tmp_path / "missing")) == _hostids.DEFAULT_HOST_ID


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
