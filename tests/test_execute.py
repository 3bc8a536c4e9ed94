"""Session.execute: a command's output streamed to a sink as it arrives."""

from __future__ import annotations

import os

import pytest
from conftest import host_processes_with, sleep_marker

import sandboxns
from sandboxns import ErrorCode, SandboxError

pytestmark = pytest.mark.smoke


class Recorder:
    """Every chunk in order; asks for the command to be killed once it has
    seen ``stop_after`` on stdout."""

    def __init__(self, stop_after: bytes | None = None) -> None:
        self.chunks: list[tuple[str, bytes]] = []
        self.stop_after = stop_after

    def feed(self, name: str, chunk: bytes) -> bool:
        self.chunks.append((name, chunk))
        return self.stop_after is not None and self.stop_after in self.text("stdout")

    def text(self, name: str) -> bytes:
        return b"".join(chunk for stream, chunk in self.chunks if stream == name)


async def test_output_reaches_the_sink_and_the_result_keeps_none_of_it(session):
    sink = Recorder()
    result = await session.execute("/bin/sh", ["-c", "echo out; echo err >&2; exit 3"], output=sink)
    assert (sink.text("stdout"), sink.text("stderr")) == (b"out\n", b"err\n")
    assert (result.exit_code, result.stdout_bytes, result.stderr_bytes, result.truncated) == (3, b"", b"", False)


async def test_a_sink_that_has_enough_kills_the_whole_tree(session):
    marker = sleep_marker()
    sink = Recorder(stop_after=b"ready")
    script = f"sleep {marker} & echo ready; wait"
    result = await session.execute("/bin/sh", ["-c", script], output=sink, timeout=60)
    assert result.signal is not None and not result.timed_out, result
    assert host_processes_with(marker) == []


async def test_a_collector_gives_the_result_its_output(session):
    collector = sandboxns.OutputCollector(limit=4)
    result = await session.execute("/bin/echo", ["hello"], output=collector)
    assert (result.stdout, result.truncated) == ("hell", True)


async def test_input_from_a_host_fd_is_copied_not_handed_over(session):
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as writer:
        writer.write(b"piped in")
    try:
        sink = Recorder()
        # The guest sees a pipe of its own, never our fd.
        script = "cat; echo; readlink /proc/self/fd/0"
        await session.execute("/bin/sh", ["-c", script], output=sink, stdin=read_end)
    finally:
        os.close(read_end)
    first, link = sink.text("stdout").decode().splitlines()
    assert first == "piped in" and link.startswith("pipe:")


@pytest.mark.parametrize(
    "arguments",
    [
        {"output": None},
        {"output": object()},
        {"output": Recorder(), "stdin": -1},
        {"output": Recorder(), "stdin": 1.5},
        {"output": Recorder(), "cancel_grace": -1},
        {"output": Recorder(), "timeout": 0},
    ],
)
async def test_bad_arguments_are_refused_before_anything_runs(session, arguments):
    with pytest.raises(SandboxError) as caught:
        await session.execute("/bin/true", **arguments)
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert session.running == 0


async def test_run_refuses_a_host_fd_as_stdin(session):
    with pytest.raises(SandboxError) as caught:
        await session.run("/bin/true", stdin=0)
    assert caught.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT and "execute()" in caught.value.message
