"""Session lifetimes: idle timeouts, what closing a handle does, and how long
a stopped session is kept.

Virtual time: trio's MockClock jumps ahead whenever every task has waited
for a while. The threshold is real time, long enough for a real sandbox to
answer (its holder starting, a command exiting) before the clock jumps.

A stopped session's retention counts in wall-clock time from its lease
file's modification time (see sandboxns._lease); the tests set that time
back rather than wait."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import refused

import sandboxns
from sandboxns import ErrorCode, SandboxSpec, blocking, create_sandbox_coding_tools
from sandboxns._backend import RETENTION_SWEEP_INTERVAL

pytestmark = pytest.mark.smoke

IDLE = 60.0
RETENTION = 3600.0


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


async def test_bad_destroy_flags_are_refused(backend, template):
    for flags in ({"destroy_on_close": "yes"}, {"destroy_on_idle": 1, "idle_timeout": IDLE}, {"destroy_on_idle": True}):
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=template, **flags))
    assert not list((backend.state_directory / "sessions").iterdir())


async def test_destroy_on_idle_deletes_only_what_its_idle_timeout_closes(backend, template):
    closed = await backend.create(template=template, idle_timeout=IDLE, destroy_on_idle=True)
    await closed.aclose()
    assert session_dir(backend, closed).is_dir()  # closing it stops it
    idle = await backend.create(template=template, idle_timeout=0.2, destroy_on_idle=True)
    await idle.wait_closed()
    assert not session_dir(backend, idle).exists()


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


@pytest.mark.parametrize(("destroy_on", "closing_deletes"), [([], False), (["close"], True), (["idle"], False)])
async def test_a_specs_destroy_on_says_what_closing_does(driver_name, tmp_path, destroy_on, closing_deletes):
    lifecycle = {"idle_timeout": IDLE, "destroy_on": destroy_on}
    spec = SandboxSpec.from_dict({"id": "closing", "driver": driver_name, "lifecycle": lifecycle})
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        directory = sandbox.backend.state_directory / "sessions" / sandbox.handle.session_id
    assert directory.exists() is not closing_deletes


async def test_a_specs_destroy_on_idle_deletes_a_session_its_idle_timeout_closes(driver_name, tmp_path):
    lifecycle = {"idle_timeout": 0.2, "destroy_on": ["idle"]}
    spec = SandboxSpec.from_dict({"id": "idle", "driver": driver_name, "lifecycle": lifecycle})
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        directory = sandbox.backend.state_directory / "sessions" / sandbox.handle.session_id
        await sandbox.handle.wait_closed()
        assert not directory.exists()


async def test_a_specs_retention_reaches_its_session(driver_name, tmp_path):
    spec = SandboxSpec.from_dict({"id": "kept", "driver": driver_name, "lifecycle": {"retain_stopped": RETENTION}})
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        directory = sandbox.backend.state_directory / "sessions" / sandbox.handle.session_id
        assert sandbox.handle.retention == RETENTION
    async with sandboxns.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend:
        assert await backend.collect_expired() == []  # closing the spec's sandbox stopped it
        age(directory)
        assert await backend.collect_expired() == [directory.name]


def seen_lately(directory: Path) -> bool:
    """Whether the session's lease says its owner was alive a moment ago
    (file times are coarser than time.time())."""
    return time.time() - (directory / "lease").stat().st_mtime < 60


def age(directory: Path, seconds: float = RETENTION + 1) -> None:
    """Make the session's lease say its owner was last seen ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(directory / "lease", (then, then))


async def test_a_stopped_session_is_deleted_once_its_retention_has_passed(backend, template):
    handle = await backend.create(template=template, retention=RETENTION)
    forever = await backend.create(template=template)  # no retention: kept for ever, as before
    for stopped in (handle, forever):
        await stopped.session.write_file("work.txt", b"unsaved")
        await stopped.stop()
    assert await backend.collect_expired() == []  # stopped just now
    age(session_dir(backend, handle), RETENTION - 60)
    assert await backend.collect_expired() == []  # not yet
    for stopped in (handle, forever):
        age(session_dir(backend, stopped))
    assert await backend.collect_expired() == [handle.session_id]
    assert not session_dir(backend, handle).exists()
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(state=handle.capture_state(), template=template))
    async with await backend.create(state=forever.capture_state(), template=template) as resumed:
        assert await resumed.session.read_text_file("work.txt") == "unsaved"


async def test_a_held_session_is_kept_and_resuming_restarts_its_clock(backend, template):
    handle = await backend.create(template=template, retention=RETENTION)
    directory = session_dir(backend, handle)
    age(directory)
    assert await backend.collect_expired() == []  # live: this process holds its lease
    assert seen_lately(directory)  # and each sweep stamps it, for the day this process dies
    await handle.stop()
    age(directory)  # due, but nobody collected it yet: it can still be resumed
    resumed = await backend.create(state=handle.capture_state(), template=template)
    assert resumed.retention == RETENTION  # stored with the session
    age(directory)
    assert await backend.collect_expired() == []
    await resumed.stop()
    assert seen_lately(directory)  # the clock starts again at the stop
    assert await backend.collect_expired() == []
    age(directory)
    assert await backend.collect_expired() == [handle.session_id]


async def test_a_pooled_session_takes_its_retention_when_handed_out(backend, template):
    await backend.pool(template=template, size=1)
    handle = await backend.create(template=template, retention=RETENTION)
    await handle.stop()
    description = json.loads((session_dir(backend, handle) / "session.json").read_text())
    assert description["retention"] == RETENTION
    age(session_dir(backend, handle))
    assert await backend.collect_expired() == [handle.session_id]


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "3600", True, [3600]])
async def test_bad_retentions_are_refused_before_anything_is_stored(backend, template, value):
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=template, retention=value))
    assert not list((backend.state_directory / "sessions").iterdir())


async def test_a_resumed_session_keeps_its_own_retention(backend, template):
    kept = await backend.create(template=template, retention=RETENTION)
    await kept.stop()
    stored = (session_dir(backend, kept) / "session.json").read_bytes()
    resuming = backend.create(state=kept.capture_state(), template=template, retention=60)
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, resuming)
    assert (session_dir(backend, kept) / "session.json").read_bytes() == stored


async def test_a_record_with_a_bad_retention_is_refused_and_never_collected(backend, template):
    handle = await backend.create(template=template, retention=RETENTION)
    await handle.stop()
    record = session_dir(backend, handle) / "session.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "retention": "soon"}))
    age(session_dir(backend, handle))
    error = await refused(
        ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(state=handle.capture_state(), template=template)
    )
    assert "retention" in error.message
    assert await backend.collect_expired() == []
    assert session_dir(backend, handle).is_dir()


@pytest.fixture
def stopped_session(driver_name, state_dir) -> Path:
    """A session with a retention, stopped just now, made before the test's
    trio run: a test on virtual time then meets no real process."""
    with blocking.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = backend.prewarm(template="lifetimes", files={})
        handle = backend.create(template=template.template_key, retention=RETENTION)
        handle.stop()
        assert backend.collect_expired() == []
    return state_dir / "sessions" / handle.session_id


async def test_opening_a_backend_deletes_what_expired_meanwhile(driver_name, state_dir, stopped_session):
    age(stopped_session)
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir):
        assert not stopped_session.exists()


async def test_a_running_backend_looks_again_every_interval(clock, driver_name, state_dir, stopped_session):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir):
        assert stopped_session.is_dir()  # not due when the backend opened
        age(stopped_session)
        opened = trio.current_time()
        with trio.fail_after(100 * RETENTION_SWEEP_INTERVAL):
            while stopped_session.exists():
                await trio.sleep(RETENTION_SWEEP_INTERVAL)
        # The sweep that deleted it ran one interval after the opening one;
        # this loop may have looked just before it did.
        assert trio.current_time() - opened <= 2 * RETENTION_SWEEP_INTERVAL
