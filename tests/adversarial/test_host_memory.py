"""No sandbox-side process holds a copy of the host process's memory: the
holder is exec'd with an empty environment (never a fork of Python), bwrap
is exec'd with none, and credentials stay in the host's gateway. A random
canary in the host's environment and in a gateway policy's header is looked
for in the memory of every process of the session."""

from __future__ import annotations

import os
import re
import secrets

import pytest
import trio
from conftest import descendants, sleep_marker, start_waiting_guest

import sandboxns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reading every process's memory needs root")

# Readable mappings in /proc/PID/maps (the kernel's own [vvar] pages are not).
MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) r")


def memory_holds(pid: int | str, needle: bytes) -> bool:
    """Whether needle is anywhere in the readable memory of process pid."""
    with open(f"/proc/{pid}/maps") as maps_file:
        regions = [MAPPING.match(line) for line in maps_file]
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for region in filter(None, regions):
            start, end = int(region[1], 16), int(region[2], 16)
            try:
                memory.seek(start)
                if needle in memory.read(end - start):
                    return True
            except (OSError, OverflowError):
                continue  # unreadable (a guard page, [vvar], ...)
    return False


async def test_no_sandbox_process_holds_the_hosts_secrets(driver_name, workspace, monkeypatch):
    canary = f"canary-{secrets.token_hex(16)}"
    monkeypatch.setenv("SANDBOXNS_TEST_CANARY", canary)
    policy = {"allow": [{"origin": "https://canary.invalid", "headers": {"authorization": f"Bearer {canary}"}}]}
    # The scanner finds it where it is: in this process.
    assert memory_holds("self", canary.encode())
    async with (
        sandboxns.open_sandbox(workspace, driver=driver_name, network=policy) as session,
        trio.open_nursery() as nursery,
    ):
        marker = sleep_marker()
        await start_waiting_guest(session, workspace, nursery, marker)
        sandbox_side = descendants(os.getpid())
        # The native holder's launcher and pid 1, a prepared and a running
        # command's init, and the command; or bwrap's two and the command.
        assert len(sandbox_side) >= 3, sandbox_side
        holding = [pid for pid in sorted(sandbox_side) if memory_holds(pid, canary.encode())]
        # And in another process: the guest's command line is in its memory.
        assert any(memory_holds(pid, marker.encode()) for pid in sandbox_side)
        nursery.cancel_scope.cancel()
    assert holding == []
