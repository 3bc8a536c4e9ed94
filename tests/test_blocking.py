"""The blocking facade, from plain threads and from asyncio."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
import trio
from conftest import descendants

from sandboxns import ErrorCode, SandboxError, SandboxSpec, blocking

pytestmark = pytest.mark.smoke


def test_a_backend_used_from_several_threads(driver_name, tmp_path):
    with blocking.open_backend(driver=driver_name, state_directory=tmp_path / "state") as backend:
        template = backend.prewarm(template="threads", files={"seed.txt": b"seed"})
        handle = backend.create(template=template.template_key)
        outputs: list[str] = []
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for j in range(5):
                    outputs.append(handle.session.run("sh", ["-c", f"echo {i}-{j}"]).stdout)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert sorted(outputs) == sorted(f"{i}-{j}\n" for i in range(4) for j in range(5))
        assert handle.session.read_text_file("seed.txt") == "seed"
        with pytest.raises(SandboxError) as error:
            handle.session.read_file("/etc/passwd")
        assert error.value.code == ErrorCode.SANDBOX_PATH_REFUSED
        assert descendants(os.getpid()) or driver_name == "bwrap"  # the native session's holder
        state = handle.capture_state()
        handle.stop()
        with backend.create(template=template.template_key, state=state) as resumed:
            assert resumed.session.run("cat", ["seed.txt"]).stdout == "seed"
        backend.create(template=template.template_key)  # left for the backend to shut down
    assert not descendants(os.getpid())  # every holder is gone with the backend
    with pytest.raises(SandboxError) as error:
        handle.session.run("true")
    assert error.value.code == ErrorCode.SANDBOX_STOPPED


def test_from_an_asyncio_event_loop(tmp_path):
    async def main() -> list[str]:
        sandbox = await asyncio.to_thread(blocking.open_sandbox, tmp_path)
        try:
            results = await asyncio.gather(
                *(asyncio.to_thread(sandbox.run, "sh", ["-c", f"echo {i} > f{i}; cat f{i}"]) for i in range(6))
            )
            return [result.stdout for result in results]
        finally:
            await asyncio.to_thread(sandbox.close)

    assert sorted(asyncio.run(main())) == [f"{i}\n" for i in range(6)]
    assert (tmp_path / "f5").read_text() == "5\n"


def test_coding_tools_and_a_spec(tmp_path):
    spec = SandboxSpec.from_dict({"id": "blocking", "template": {"files": {"a.txt": "alpha\n"}}})
    with blocking.build(spec, state_directory=tmp_path / "state") as sandbox:
        tools = blocking.create_sandbox_coding_tools(sandbox.handle, authorize=lambda operation: True)
        assert "read_file" in tools.names and tools.as_anthropic_tools()
        result = tools.dispatch("read_file", {"path": "a.txt"})
        assert "alpha" in json.dumps(result)
        assert tools.dispatch("read_file", {"path": "/etc/passwd"})["error"] == "SANDBOX_PATH_REFUSED"
        # The spec's backend and session, as the async form has them.
        assert sandbox.backend.name == "native" and sandbox.backend.active_commands == 0
        assert sandbox.backend.max_concurrent_commands > 0 and sandbox.installs == ()
        sandbox.session.configure(environment={"GREETING": "hi"})
        assert sandbox.session.environment["GREETING"] == "hi" and sandbox.session.running == 0
        assert sandbox.session.run("sh", ["-c", "echo $GREETING"]).stdout == "hi\n"


def test_a_failed_open_raises_in_the_caller(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SandboxError) as error:
        blocking.open_sandbox(tmp_path / "file")
    assert error.value.code == ErrorCode.SANDBOX_NOT_FOUND
    assert not [t for t in threading.enumerate() if t.name == "sandboxns-blocking"]


def test_the_blocking_api_refuses_calls_from_its_own_thread(tmp_path):
    # As a callback (an authorize hook, say) would: close() and run() from
    # inside the trio thread must be refused, not deadlock or half-close.
    with blocking.open_sandbox(tmp_path) as sandbox:
        for call in (sandbox.close, lambda: sandbox.run("true")):
            with pytest.raises(SandboxError) as error:
                sandbox._portal.call_sync(call)
            assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
        assert sandbox.run("true").exit_code == 0  # still open and working
    with pytest.raises(SandboxError) as error:
        sandbox.run("true")
    assert error.value.code == ErrorCode.SANDBOX_STOPPED


async def test_inside_a_trio_loop_the_blocking_api_refuses_at_once(tmp_path):
    # Its calls could never wait there: refused before a thread or a
    # sandbox exists, naming the way that works.
    spec = SandboxSpec.from_dict({"id": "in-trio"})
    for open_ in (
        lambda: blocking.open_sandbox(tmp_path),
        lambda: blocking.open_backend(state_directory=tmp_path / "state"),
        lambda: blocking.build(spec, state_directory=tmp_path / "state"),
    ):
        with pytest.raises(SandboxError) as error:
            open_()
        assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
        assert "async API" in error.value.message
    assert not [t for t in threading.enumerate() if t.name == "sandboxns-blocking"]
    assert not descendants(os.getpid())
    assert not (tmp_path / "state").exists()
    # One opened from a thread is refused the same way from a trio task,
    # and works from a thread again.
    sandbox = await trio.to_thread.run_sync(blocking.open_sandbox, tmp_path)
    try:
        with pytest.raises(SandboxError) as error:
            sandbox.run("true")
        assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
        assert (await trio.to_thread.run_sync(sandbox.run, "true")).exit_code == 0
    finally:
        await trio.to_thread.run_sync(sandbox.close)
