"""Session lifetimes: idle timeouts, and what closing a handle does.

Virtual time: trio's MockClock jumps ahead whenever every task has waited
for a while. The threshold is real time, long enough for a real sandbox to
answer (its holder starting, a command exiting) before the clock jumps."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from conftest import refused

from sandboxns import ErrorCode, SandboxSpec, create_sandbox_coding_tools

pytestmark = pytest.mark.smoke

IDLE = 60.0


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.3)


@pytest.fixture
async def template(backend) -> str:
    return (await backend.prewarm(template="lifetimes", files={"kept.txt": b"template"})).template_key


def session_dir(backend, handle):
    return backend.state_directory / "sessions" / handle.session_id


async def test_an_idle_session_is_stopped_and_can_be_resumed(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE)
    await handle.session.write_file("work.txt", b"unsaved work")
    started = trio.current_time()
    await handle.wait_closed()
    assert trio.current_time() - started == pytest.approx(IDLE, abs=1)
    assert not handle.live
    await refused(ErrorCode.SANDBOX_STOPPED, handle.session.run("true"))
    # Stopped, not deleted: the lease is free and the work is there.
    resumed = await backend.create(state=handle.capture_state(), template=template)
    async with resumed:
        assert await resumed.session.read_text_file("work.txt") == "unsaved work"


async def test_activity_re_arms_the_timeout(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE)
    for _ in range(3):
        await trio.sleep(IDLE - 10)
        assert handle.live
        await handle.session.list_dir(".")  # a file operation counts
    await trio.sleep(IDLE - 10)
    assert handle.live
    await handle.session.run("true")  # so does a command
    last = trio.current_time()
    await handle.wait_closed()
    assert trio.current_time() - last == pytest.approx(IDLE, abs=1)


async def test_coding_tools_file_operations_are_activity(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE)
    tools = await create_sandbox_coding_tools(handle, authorize=lambda operation: True)
    for _ in range(3):
        await trio.sleep(IDLE - 10)
        assert handle.live
        assert "error" not in await tools.dispatch("read_file", {"path": "kept.txt"})
    last = trio.current_time()
    await handle.wait_closed()
    assert trio.current_time() - last == pytest.approx(IDLE, abs=1)


async def test_a_running_command_keeps_the_session_alive_however_long(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE)
    # Virtual time runs to the command's deadline, far past the idle timeout.
    result = await handle.session.run("sleep", ["1000"], timeout=10 * IDLE)
    assert result.timed_out and handle.live
    ended = trio.current_time()
    await handle.wait_closed()
    assert trio.current_time() - ended == pytest.approx(IDLE, abs=1)


async def test_destroy_on_close_deletes_an_idle_session(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE, destroy_on_close=True)
    directory = session_dir(backend, handle)
    assert directory.is_dir()
    await handle.wait_closed()
    assert not directory.exists()


async def test_closing_a_handle_stops_by_default_and_deletes_when_asked(backend, template):
    kept = await backend.create(template=template)
    async with kept:
        await kept.session.write_file("note.txt", b"kept")
    assert not kept.live and session_dir(backend, kept).is_dir()
    resumed = await backend.create(state=kept.capture_state(), template=template)
    await resumed.aclose()
    destroyed = await backend.create(template=template, destroy_on_close=True)
    await destroyed.aclose()
    assert not session_dir(backend, destroyed).exists()


async def test_a_closed_handle_cancels_its_idle_timer(clock, backend, template):
    handle = await backend.create(template=template, idle_timeout=IDLE)
    await handle.stop()
    resumed = await backend.create(state=handle.capture_state(), template=template)
    # The old handle's timer must not stop the new owner's session.
    await trio.sleep(10 * IDLE)
    assert resumed.live
    await resumed.aclose()


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "60", True])
async def test_bad_idle_timeouts_are_refused(backend, template, value):
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=template, idle_timeout=value))
    assert not list((backend.state_directory / "sessions").iterdir())


async def test_bad_destroy_on_close_is_refused(backend, template):
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=template, destroy_on_close="yes"))


async def test_a_pooled_session_counts_idleness_from_its_hand_out(clock, backend, template):
    await backend.pool(template=template, size=1)
    await trio.sleep(10 * IDLE)  # waiting in the pool is not idleness of the new owner
    handle = await backend.create(template=template, idle_timeout=IDLE)
    handed_out = trio.current_time()
    assert (await handle.session.run("true")).exit_code == 0
    await handle.wait_closed()
    assert trio.current_time() - handed_out == pytest.approx(IDLE, abs=1)


async def test_a_stop_during_a_network_change_waits_for_it(backend, template):
    handle = await backend.create(template=template)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle.session.set_network_policy, "allow-all")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(handle.stop)
    assert not handle.live


async def test_a_specs_lifecycle_reaches_its_session(clock, tmp_path):
    spec = SandboxSpec.from_dict({"id": "idle", "lifecycle": {"idle_timeout": IDLE, "destroy_on_close": True}})
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        directory = sandbox.backend.state_directory / "sessions" / sandbox.handle.session_id
        started = trio.current_time()
        await sandbox.handle.wait_closed()
        assert trio.current_time() - started == pytest.approx(IDLE, abs=1)
        assert not directory.exists()
