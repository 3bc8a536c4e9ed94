"""Warm pools: sessions started ahead and handed out by create()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import sandboxns
from sandboxns import ErrorCode, SandboxError

pytestmark = pytest.mark.smoke


async def test_a_pooled_session_is_a_fresh_session(backend):
    template = await backend.prewarm(template="t", files={"a.txt": b"template"})
    key = template.template_key
    await backend.pool(template=key, size=2)
    first = await backend.create(template=key)
    second = await backend.create(template=key)
    assert first.session_id != second.session_id
    await first.session.run("sh", ["-c", "echo changed > a.txt; echo left > /tmp/left"])
    assert await second.session.read_text_file("a.txt") == "template"  # workspaces are separate
    probe = await first.session.run("sh", ["-c", "ls -A /tmp; cat /proc/net/dev | grep -c :"])
    assert probe.stdout == "1\n"  # a clean /tmp, and only lo: pooled sessions wait with no network
    # Each is a real session: leases, state, resume.
    state = first.capture_state()
    await first.stop()
    resumed = await backend.create(template=key, state=state)
    assert await resumed.session.read_text_file("a.txt") == "changed\n"
    with pytest.raises(SandboxError) as error:
        await backend.create(template=key, state=second.capture_state())
    assert error.value.code == ErrorCode.SANDBOX_BUSY
    await backend.pool(template=key, size=2)  # refilled in the background; this waits for it
    assert len(backend._pools.waiting(key)) == 2


async def test_the_policy_is_applied_at_hand_out(backend):
    template = await backend.prewarm(template="t", files={})
    key = template.template_key
    await backend.pool(template=key, size=1)
    handle = await backend.create(template=key, network="allow-all")
    host_interfaces = Path("/proc/net/dev").read_text().count(":")
    result = await handle.session.run("cat", ["/proc/net/dev"])
    assert result.stdout.count(":") == host_interfaces
    assert handle.session.network.kind == "allow-all"


async def test_unused_pooled_sessions_are_deleted_with_the_backend(driver_name, state_dir):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="t", files={})
        await backend.pool(template=template.template_key, size=3)
        kept = await backend.create(template=template.template_key)
        await backend.pool(template=template.template_key, size=1)  # shrinks
    assert os.listdir(state_dir / "sessions") == [kept.session_id]


async def test_bad_pool_requests(backend):
    template = await backend.prewarm(template="t", files={})
    for size in (-1, 1.5, True, 10**6):
        with pytest.raises(SandboxError) as error:
            await backend.pool(template=template.template_key, size=size)
        assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    with pytest.raises(SandboxError) as error:
        await backend.pool(template="f" * 64, size=1)
    assert error.value.code == ErrorCode.SANDBOX_NOT_FOUND
