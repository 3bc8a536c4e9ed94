"""Resource bounds a guest meets."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.smoke


async def test_tmp_and_shm_are_bounded(session):
    # 256 MiB for /tmp and 64 MiB for /dev/shm: a full one gives ENOSPC,
    # not the host's memory.
    script = (
        "head -c 300M /dev/zero > /tmp/big; echo tmp=$?; head -c 80M /dev/zero > /dev/shm/big; echo shm=$?; "
        "df -k /tmp /dev/shm | tail -n 2"
    )
    result = await session.run("sh", ["-c", script])
    lines = result.stdout.splitlines()
    assert lines[:2] == ["tmp=1", "shm=1"], result
    assert "No space left on device" in result.stderr
    sizes = [int(line.split()[1]) for line in lines[2:]]
    assert sizes == [256 * 1024, 64 * 1024]
