"""Session.run(): results, limits, errors and cancellation."""

from __future__ import annotations

import contextlib
import errno
import os
import signal

import pytest
import trio
from conftest import FirstLine, host_processes_with, no_free_file_descriptors, sleep_marker

import sandboxns
from sandboxns import ErrorCode, SandboxError


async def test_exit_code_signal_and_output(session):
    result = await session.run("/bin/sh", ["-c", "echo out; echo err >&2; exit 3"])
    assert (result.exit_code, result.signal) == (3, None)
    assert (result.stdout, result.stderr) == ("out\n", "err\n")
    assert (result.stdout_bytes, result.stderr_bytes) == (b"out\n", b"err\n")
    assert not result.timed_out and not result.truncated
    killed = await session.run("/bin/sh", ["-c", "kill -TERM $$"])
    assert (killed.exit_code, killed.signal) == (None, signal.SIGTERM)


async def test_concurrent_commands_each_get_their_own_status_and_output(session):
    # Eight callers at once, forty commands each: every command's result is
    # its own (the native holder hands commands to whichever init is idle,
    # and makes more while all are busy).
    results: dict[int, sandboxns.RunResult] = {}

    async def caller(first: int) -> None:
        for number in range(first, first + 40):
            results[number] = await session.run("sh", ["-c", f"echo {number}; exit {number % 7}"])

    async with trio.open_nursery() as nursery:
        for first in range(0, 320, 40):
            nursery.start_soon(caller, first)
    assert sorted(results) == list(range(320))
    for number, result in results.items():
        assert (result.exit_code, result.stdout) == (number % 7, f"{number}\n"), (number, result)


async def test_callers_spread_over_sessions_get_every_command_run(driver_name, tmp_path):
    # Eight callers over three sessions: each session's commands come one
    # at a time (whose inits the native driver reuses) and at once (whose
    # inits it does not), and commands end while others start.
    async with contextlib.AsyncExitStack() as stack:
        sessions = []
        for index in range(3):
            (tmp_path / f"w{index}").mkdir()
            sessions.append(
                await stack.enter_async_context(sandboxns.open_sandbox(tmp_path / f"w{index}", driver=driver_name))
            )
        failed = []

        async def caller(offset: int) -> None:
            for number in range(60 if driver_name == "native" else 6):
                result = await sessions[(offset + number) % 3].run("/usr/bin/true")
                if result.exit_code != 0:
                    failed.append(result)

        async with trio.open_nursery() as nursery:
            for offset in range(8):
                nursery.start_soon(caller, offset)
    assert failed == []


async def test_exit_127_from_the_command_is_not_a_setup_failure(session):
    result = await session.run("/bin/sh", ["-c", "exit 127"])
    assert result.exit_code == 127


async def test_missing_executable_and_cwd_are_structured_errors(session):
    with pytest.raises(SandboxError) as missing:
        await session.run("/no/such/program")
    assert missing.value.code == ErrorCode.SANDBOX_NOT_FOUND
    assert "/no/such/program" in missing.value.message
    with pytest.raises(SandboxError) as no_dir:
        await session.run("/bin/true", cwd="no/such/dir")
    assert no_dir.value.code == ErrorCode.SANDBOX_NOT_FOUND
    assert "no/such/dir" in no_dir.value.message
    # The session is unharmed.
    assert (await session.run("true")).exit_code == 0


async def test_path_lookup_uses_the_guest_path(session):
    assert (await session.run("true")).exit_code == 0
    with pytest.raises(SandboxError) as error:
        await session.run("true", env={"PATH": "/nowhere"})
    assert error.value.code == ErrorCode.SANDBOX_NOT_FOUND


async def test_stdin_and_utf8_replacement(session):
    result = await session.run("/bin/cat", stdin="héllo")
    assert result.stdout == "héllo"
    binary = await session.run("/bin/cat", stdin=b"\xff\xfeok")
    assert binary.stdout_bytes == b"\xff\xfeok"
    assert binary.stdout == "\ufffd\ufffdok"


async def test_cwd_is_workspace_relative(session, workspace):
    (workspace / "sub").mkdir()
    assert (await session.run("/bin/pwd")).stdout == "/workspace\n"
    assert (await session.run("/bin/pwd", cwd="sub")).stdout == "/workspace/sub\n"
    assert (await session.run("/bin/pwd", cwd="/workspace/sub")).stdout == "/workspace/sub\n"


@pytest.mark.parametrize("cwd", ["..", "/etc", "sub/../../x", "/workspacex"])
async def test_paths_outside_the_workspace_are_refused(session, cwd):
    with pytest.raises(SandboxError) as error:
        await session.run("/bin/true", cwd=cwd)
    assert error.value.code == ErrorCode.SANDBOX_PATH_REFUSED


@pytest.mark.parametrize(
    "kwargs",
    [
        {"executable": ""},
        {"executable": 5},
        {"executable": "true", "args": "not-a-list"},
        {"executable": "true", "args": ["a\0b"]},
        {"executable": "true", "env": {"A=B": "x"}},
        {"executable": "true", "env": ["A"]},
        {"executable": "true", "timeout": 0},
        {"executable": "true", "timeout": float("nan")},
        {"executable": "true", "max_output_bytes": -1},
        {"executable": "true", "stdin": 5},
    ],
)
async def test_bad_arguments_are_refused(session, kwargs):
    with pytest.raises(SandboxError) as error:
        await session.run(**kwargs)
    assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT


async def test_oversized_request_is_a_limit_error(session):
    with pytest.raises(SandboxError) as error:
        await session.run("/bin/true", ["x" * 200_000])
    assert error.value.code == ErrorCode.SANDBOX_LIMIT


@pytest.mark.smoke
async def test_timeout_kills_a_tree_that_traps_sigterm(session):
    marker = sleep_marker()
    result = await session.run("/bin/sh", ["-c", f"trap '' TERM; setsid sleep {marker} & sleep {marker}"], timeout=0.5)
    assert result.timed_out
    assert result.signal == signal.SIGKILL
    assert host_processes_with(marker) == []


@pytest.mark.smoke
async def test_output_cap_with_a_100_mib_producer(session):
    result = await session.run(
        "/bin/sh", ["-c", "head -c 104857600 /dev/zero; echo tail >&2"], max_output_bytes=1024 * 1024
    )
    assert result.exit_code == 0  # never blocked on a full pipe
    assert result.truncated
    assert len(result.stdout_bytes) + len(result.stderr_bytes) == 1024 * 1024


async def test_output_cap_counts_both_streams(session):
    result = await session.run("/bin/sh", ["-c", "echo 12345; echo 67890 >&2"], max_output_bytes=8)
    assert result.truncated
    assert len(result.stdout_bytes) + len(result.stderr_bytes) == 8
    exact = await session.run("/bin/sh", ["-c", "printf 1234"], max_output_bytes=4)
    assert not exact.truncated and exact.stdout == "1234"


@pytest.mark.smoke
async def test_background_processes_die_with_the_command(session):
    marker = sleep_marker()
    result = await session.run(
        "/bin/sh",
        [
            "-c",
            f"setsid sleep {marker} & (setsid sh -c 'sleep {marker} &' &); nohup sleep {marker} >/dev/null 2>&1 & echo started",
        ],
    )
    assert result.stdout == "started\n"
    assert host_processes_with(marker) == []


@pytest.mark.smoke
async def test_cancelling_run_kills_the_tree_first(session, workspace):
    marker = sleep_marker()
    fifo = workspace / "started"
    os.mkfifo(fifo)

    async def wait_until_started() -> None:
        # Opening a FIFO for reading blocks until the guest opens it to write.
        await trio.to_thread.run_sync(fifo.read_bytes)

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                session.run,
                "/bin/sh",
                ["-c", f"trap '' TERM; setsid sleep {marker} & echo go > /workspace/started; sleep {marker}"],
            )
            await wait_until_started()
            scope.cancel()
    assert scope.cancelled_caught
    assert host_processes_with(marker) == []
    assert (await session.run("true")).exit_code == 0


async def test_a_host_out_of_file_descriptors_is_a_sandbox_error(session):
    # Each command needs pipes: without them nothing starts, and the caller
    # gets the API's error, not the host's OSError.
    with no_free_file_descriptors(), pytest.raises(SandboxError) as error:
        await session.run("true")
    assert error.value.code == ErrorCode.SANDBOX_UNAVAILABLE, error.value
    assert isinstance(error.value.__cause__, OSError) and error.value.__cause__.errno == errno.EMFILE
    assert (await session.run("true")).exit_code == 0
    assert session.running == 0


async def test_run_after_stop_is_refused(driver_name, workspace):
    async with sandboxns.open_sandbox(workspace, driver=driver_name) as session:
        pass
    with pytest.raises(SandboxError) as error:
        await session.run("true")
    assert error.value.code == ErrorCode.SANDBOX_STOPPED
    with pytest.raises(SandboxError) as error:
        await session.read_file("anything")
    assert error.value.code == ErrorCode.SANDBOX_STOPPED


async def test_concurrent_commands_in_one_session(session):
    results = []

    async def one(i: int) -> None:
        results.append((await session.run("/bin/sh", ["-c", f"echo {i}"])).stdout)

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(one, i)
    assert sorted(results) == sorted(f"{i}\n" for i in range(16))


# Holds whatever fds it is sent on a Unix socket in the workspace.
KEEPER = """
import array, os, socket, sys, time
server = socket.socket(socket.AF_UNIX)
server.bind("keeper.sock")
server.listen()
print("listening", flush=True)
connection, _ = server.accept()
fds = array.array("i")
_, ancillary, _, _ = connection.recvmsg(1, socket.CMSG_SPACE(4))
fds.frombytes(ancillary[0][2])
time.sleep(60)
"""
# Sends its own stdout to the keeper, writes a line and exits.
GIVER = """
import socket, sys
client = socket.socket(socket.AF_UNIX)
client.connect("keeper.sock")
socket.send_fds(client, [b"x"], [1])
print("given", flush=True)
"""


async def test_run_returns_when_the_tree_is_gone_even_if_its_stdout_lives_on(session):
    # A guest can hand its stdout to a sibling command that outlives it;
    # run() returns with what the command wrote, not when the sibling ends.
    listening = FirstLine()
    keeper = await session.driver.spawn(
        ["python3", "-c", KEEPER], env={"PATH": "/usr/bin:/bin"}, cwd="/workspace", output=listening
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.wait)
            with trio.fail_after(10):
                await listening.arrived.wait()
                result = await session.run("python3", ["-c", GIVER])
            await keeper.send_signal(signal.SIGKILL)
    finally:
        await keeper.aclose()
    assert (result.exit_code, result.stdout) == (0, "given\n")


def test_error_codes_are_stable_strings():
    assert ErrorCode.SANDBOX_BUSY == "SANDBOX_BUSY"
    assert str(ErrorCode.SANDBOX_PATH_REFUSED) == "SANDBOX_PATH_REFUSED"
    error = SandboxError(ErrorCode.SANDBOX_LIMIT, "too big")
    assert error.code == "SANDBOX_LIMIT" and error.message == "too big"


@pytest.mark.parametrize("policy", ["allow-some", 3, {"deny": []}])
async def test_unknown_network_policies_are_refused(workspace, policy):
    with pytest.raises(SandboxError) as error:
        async with sandboxns.open_sandbox(workspace, network=policy):
            pass
    assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT


async def test_missing_workspace_is_not_found(tmp_path):
    with pytest.raises(SandboxError) as error:
        async with sandboxns.open_sandbox(tmp_path / "missing"):
            pass
    assert error.value.code == ErrorCode.SANDBOX_NOT_FOUND


async def test_cancellation_forwards_sigterm_to_the_command(session, workspace):
    fifo = workspace / "started"
    os.mkfifo(fifo)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                session.run,
                "/bin/sh",
                [
                    "-c",
                    (
                        "trap 'echo term > /workspace/got; exit 0' TERM; echo > /workspace/started; "
                        "while :; do sleep 0.01; done"
                    ),
                ],
            )
            await trio.to_thread.run_sync(fifo.read_bytes)
            scope.cancel()
    assert (workspace / "got").read_text() == "term\n"


async def test_command_has_no_controlling_terminal(session):
    result = await session.run("/bin/sh", ["-c", "tty; : < /dev/tty && echo opened"])
    assert result.stdout == "not a tty\n"
    assert "/dev/tty" in result.stderr  # the shell could not open it
