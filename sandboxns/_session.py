"""Session: the driver-independent half of a sandbox.

A driver knows how to spawn inside its isolation; the session turns that into
what callers use: argument checking, workspace path normalisation, text
conversion, and ``run()`` with a deadline, an output cap and clean
cancellation. Every driver gets exactly the same behaviour from here.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from ._confinement import ResourceLimits
from ._driver import MAX_COMMAND_BYTES, ExitStatus, SandboxDriver, SandboxProcess
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._files import DirEntry
from ._network import PROXY_ENVIRONMENT, PROXY_TRUST_ENVIRONMENT, NetworkPolicy, check_network_policy
from ._paths import WORKSPACE, normalize_path
from ._pump import OutputCollector, OutputSink

if TYPE_CHECKING:
    from ._gateway import SessionNetwork

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
MAX_FILE_BYTES = 1024 * 1024  # per read or write through the API, unless configured
# The most configure() allows: output and file data are held in memory.
MAX_OUTPUT_BYTES_LIMIT = 1024**3
MAX_FILE_BYTES_LIMIT = 256 * 1024**2
DEFAULT_ENV: Mapping[str, str] = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
}
# A cancelled command gets this long after SIGTERM before SIGKILL.
CANCEL_GRACE = 1.0


def _check_string(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise invalid_argument(f"{what} must be a string, not {type(value).__name__}")
    if "\0" in value:
        raise invalid_argument(f"{what} must not contain NUL characters")
    return value


def _check_env(env: object) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise invalid_argument(f"env must be a mapping of strings, not {type(env).__name__}")
    checked = {}
    for key, value in env.items():
        _check_string(key, "an environment variable name")
        if not key or "=" in key:
            raise invalid_argument(f"invalid environment variable name {key!r}")
        checked[key] = _check_string(value, f"environment variable {key}")
    return checked


def check_seconds(value: object, what: str = "timeout") -> float:
    """A positive, finite number of seconds, or SANDBOX_INVALID_ARGUMENT."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise invalid_argument(f"{what} must be a positive number of seconds, not {value!r}")
    return float(value)


def check_command(
    executable: object, args: object, env: object, cwd: object, timeout: object
) -> tuple[list[str], dict[str, str], str, float]:
    """Validate a command's arguments; returns (argv, env, guest cwd, timeout)."""
    _check_string(executable, "executable")
    if not executable:
        raise invalid_argument("executable must not be empty")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise invalid_argument("args must be a sequence of strings")
    argv = [executable, *(_check_string(arg, "each argument") for arg in args)]
    checked_env = dict(DEFAULT_ENV) if env is None else _check_env(env)
    guest_cwd = WORKSPACE if cwd is None else normalize_path(cwd)
    # Every command learns its working directory the way a shell would tell
    # it (bwrap sets PWD unconditionally; the native driver matches).
    checked_env["PWD"] = guest_cwd
    size = sum(len(os.fsencode(item)) + 1 for item in (guest_cwd, *argv, *(f"{k}={v}" for k, v in checked_env.items())))
    if size > MAX_COMMAND_BYTES:
        raise SandboxError(
            ErrorCode.SANDBOX_LIMIT, f"arguments and environment take {size} bytes; the limit is {MAX_COMMAND_BYTES}"
        )
    return argv, checked_env, guest_cwd, check_seconds(timeout)


@dataclass(frozen=True)
class RunResult:
    """The outcome of :meth:`Session.run`.

    ``exit_code`` is None when a signal ended the command (``signal`` says
    which); a command killed at its deadline has ``timed_out`` set. Output
    beyond the cap was dropped when ``truncated`` is set.
    """

    exit_code: int | None
    signal: int | None
    stdout_bytes: bytes
    stderr_bytes: bytes
    timed_out: bool
    truncated: bool
    duration: float

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")


def _kept(output: OutputSink, name: str) -> bytes:
    """What a sink kept of a stream, if it keeps anything (an
    OutputCollector does)."""
    collected = getattr(output, "output", None)
    return collected(name) if callable(collected) else b""


async def _terminate(process: SandboxProcess, grace: float) -> None:
    """SIGTERM, a grace period, then SIGKILL; returns once the tree is gone."""
    await process.send_signal(signal.SIGTERM)
    with trio.move_on_after(grace):
        await process.wait()
        return
    await process.send_signal(signal.SIGKILL)
    await process.wait()


class Admission(Protocol):
    """A limit on concurrently running commands, shared by sessions."""

    def check(self) -> None:
        """Raise SandboxError(SANDBOX_BUSY) if no slot is free, taking none:
        lets a full backend turn callers away before any other work."""
        ...

    def acquire(self) -> None:
        """Take a slot, or raise SandboxError(SANDBOX_BUSY) at once."""
        ...

    def release(self) -> None: ...


class Session:
    """A sandbox session over a driver: run commands in it.

    With ``admission``, every command holds one of its slots from before the
    process starts until the command's whole process tree is gone."""

    def __init__(
        self, driver: SandboxDriver, admission: Admission | None = None, network: SessionNetwork | None = None
    ) -> None:
        self.driver = driver
        self._admission = admission
        self._network = network
        self._running = 0
        self._file_operations = 0
        # What has the session to itself right now (a policy change, a
        # snapshot), or None; see exclusive().
        self._exclusive: str | None = None
        # Bumped by every policy change: whatever was prepared under an
        # older generation is void.
        self.network_generation = 0
        self.environment: Mapping[str, str] = dict(DEFAULT_ENV)
        self.timeout = DEFAULT_TIMEOUT
        self.max_output_bytes = DEFAULT_MAX_OUTPUT_BYTES
        self.max_file_bytes = MAX_FILE_BYTES
        # trio.current_time() of the last command start or end, file
        # operation or gateway request; see idle().
        self.last_activity = trio.current_time()
        self._quiet = trio.Event()  # set while no command runs
        self._quiet.set()

    def configure(
        self,
        *,
        environment: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        max_file_bytes: int | None = None,
    ) -> None:
        """Set the session's defaults: the environment of a command run
        without ``env``, its deadline and output cap, and the largest file
        one read or write may move. Everything is checked before anything
        changes."""
        checked_env = None if environment is None else _check_env(environment)
        checked_timeout = None if timeout is None else check_seconds(timeout)
        for name, value, most in (
            ("max_output_bytes", max_output_bytes, MAX_OUTPUT_BYTES_LIMIT),
            ("max_file_bytes", max_file_bytes, MAX_FILE_BYTES_LIMIT),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most):
                raise invalid_argument(f"{name} must be an integer from 1 to {most}, not {value!r}")
        if checked_env is not None:
            self.environment = checked_env
        if checked_timeout is not None:
            self.timeout = checked_timeout
        if max_output_bytes is not None:
            self.max_output_bytes = max_output_bytes
        if max_file_bytes is not None:
            self.max_file_bytes = max_file_bytes

    def touch(self) -> None:
        """Note activity now (for idle timeouts)."""
        self.last_activity = trio.current_time()

    def check_usable(self) -> None:
        """Raise SANDBOX_STOPPED if the session can no longer run commands
        or touch its files (stopped, its holder gone, or its lease taken
        away), without trying anything. A driver that does not say (one
        of your own without ``check_usable``) passes."""
        check = getattr(self.driver, "check_usable", None)
        if callable(check):
            check()

    @property
    def running(self) -> int:
        """How many commands run in the session right now."""
        return self._running

    async def wait_quiet(self) -> None:
        """Return once no command runs in the session."""
        while self._running:
            await self._quiet.wait()

    @property
    def network(self) -> NetworkPolicy:
        """The network policy in force (its repr never shows header values)."""
        return self.driver.network

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """For ``what`` (a policy change, a snapshot), which needs the
        session to itself: SANDBOX_BUSY while a command or a file operation
        runs, and until the block ends every new one is SANDBOX_BUSY."""
        if self._running or self._file_operations or self._exclusive is not None:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"{what} can only happen while no command or file operation runs in the session",
            )
        self._exclusive = what
        self.touch()
        try:
            yield
        finally:
            self._exclusive = None

    def _check_not_exclusive(self) -> None:
        if self._exclusive is not None:
            raise SandboxError(ErrorCode.SANDBOX_BUSY, f"the session is busy: {self._exclusive} is under way")

    @contextlib.contextmanager
    def _file_operation(self) -> Iterator[None]:
        self._check_not_exclusive()
        self._file_operations += 1
        self.touch()
        try:
            yield
        finally:
            self._file_operations -= 1

    async def set_network_policy(self, policy: object) -> None:
        """Replace the session's network policy. Refused with SANDBOX_BUSY
        while any command runs; policies are never stored on disk."""
        checked = check_network_policy(policy)
        with self.exclusive("a change of the network policy"):
            try:
                if self._network is not None:
                    await self._network.apply(self.driver, checked)
                elif checked.needs_gateway:
                    raise SandboxError(
                        ErrorCode.SANDBOX_POLICY_REFUSED,
                        "an allow-list policy needs the egress gateway, which open_sandbox() and backends provide",
                    )
                else:
                    await self.driver.set_network(checked, None)
            finally:
                self.network_generation += 1

    async def read_file(self, path: str) -> bytes:
        """The content of a workspace file (at most 1 MiB)."""
        with self._file_operation():
            return await self.driver.read_bytes(normalize_path(path), self.max_file_bytes)

    async def read_text_file(self, path: str) -> str:
        """A workspace file as text. It must be valid UTF-8: anything else is
        refused (SANDBOX_INVALID_ARGUMENT) rather than silently altered."""
        data = await self.read_file(path)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise invalid_argument(
                f"{normalize_path(path)} is not UTF-8 text (invalid byte 0x{data[exc.start]:02x} at offset"
                f" {exc.start}); read it with read_file() for the raw bytes"
            ) from None

    async def write_file(self, path: str, data: bytes) -> None:
        """Create or atomically replace a workspace file (at most 1 MiB)."""
        guest_path = normalize_path(path)
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise invalid_argument(f"data must be bytes, not {type(data).__name__}")
        if len(data) > self.max_file_bytes:
            raise SandboxError(
                ErrorCode.SANDBOX_LIMIT, f"{len(data)} bytes is over the {self.max_file_bytes}-byte limit"
            )
        with self._file_operation():
            await self.driver.write_bytes(guest_path, data)

    async def write_text_file(self, path: str, text: str) -> None:
        if not isinstance(text, str):
            raise invalid_argument(f"text must be a string, not {type(text).__name__}")
        await self.write_file(path, text.encode("utf-8"))

    async def workspace_call(self, operation, *args):
        """Run ``operation(workspace_dir_fd, *args)`` in a worker thread (the
        driver's :meth:`workspace_call`), as a file operation: refused while
        a snapshot or policy change has the session to itself."""
        with self._file_operation():
            return await self.driver.workspace_call(operation, *args)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        with self._file_operation():
            return await self.driver.list_dir(normalize_path(path))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        with self._file_operation():
            await self.driver.remove(normalize_path(path), recursive=bool(recursive))

    async def mkdir(self, path: str, *, parents: bool = False) -> None:
        with self._file_operation():
            await self.driver.mkdir(normalize_path(path), parents=bool(parents))

    async def run(
        self,
        executable: str,
        args: Sequence[str] = (),
        *,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        resource_limits: ResourceLimits | None = None,
    ) -> RunResult:
        """Run one command to completion inside the sandbox.

        ``executable`` is a guest path or a name looked up on the guest's
        ``PATH``. The environment is exactly ``env`` (default: the
        session's, see :meth:`configure`; PATH, HOME and LANG unless
        configured). Past ``timeout`` seconds (default 30) the command's
        whole tree is killed and ``timed_out`` is set; output past
        ``max_output_bytes`` (default 1 MiB) is dropped. ``resource_limits``
        replace the session's rlimits for this command (see
        :class:`~sandboxns.ResourceLimits`). Cancelling the call kills the
        tree before the cancellation propagates.
        """
        if max_output_bytes is None:
            max_output_bytes = self.max_output_bytes
        if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes < 0:
            raise invalid_argument(f"max_output_bytes must be a non-negative integer, not {max_output_bytes!r}")
        if isinstance(stdin, int) and not isinstance(stdin, bool):
            raise invalid_argument("stdin must be bytes, str or None (execute() also takes a host fd)")
        return await self.execute(
            executable,
            args,
            output=OutputCollector(max_output_bytes),
            stdin=stdin,
            env=env,
            cwd=cwd,
            timeout=timeout,
            resource_limits=resource_limits,
        )

    async def execute(
        self,
        executable: str,
        args: Sequence[str] = (),
        *,
        output: OutputSink,
        stdin: bytes | str | int | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        resource_limits: ResourceLimits | None = None,
        cancel_grace: float = CANCEL_GRACE,
    ) -> RunResult:
        """Run one command as :meth:`run` does, streaming its output as it
        arrives: ``output.feed(name, chunk)`` for each chunk of "stdout" or
        "stderr", in order; a ``feed`` that returns True asks for the
        command's tree to be killed. The result's ``stdout``, ``stderr`` and
        ``truncated`` are the sink's when it is an :class:`OutputCollector`
        (or has its ``output(name)`` and ``truncated``), else empty.
        ``stdin`` may also be a host fd, whose input is copied to the
        command as it arrives (the fd itself never reaches the guest). On
        cancellation the command gets ``cancel_grace`` seconds between
        SIGTERM and SIGKILL.
        """
        if self._admission is not None:
            self._admission.check()  # refusals are the common case under load: make them cheap
        argv, env, guest_cwd, timeout = check_command(
            executable,
            args,
            self.environment if env is None else env,
            cwd,
            self.timeout if timeout is None else timeout,
        )
        if not callable(getattr(output, "feed", None)):
            raise invalid_argument(f"output must have a feed(name, chunk) method, not {output!r}")
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8")
        elif isinstance(stdin, (bytearray, memoryview)):
            stdin = bytes(stdin)
        elif isinstance(stdin, int) and not isinstance(stdin, bool):
            if stdin < 0:
                raise invalid_argument(f"stdin as a host fd must be >= 0, not {stdin}")
        elif stdin is not None and not isinstance(stdin, bytes):
            raise invalid_argument(f"stdin must be bytes, str, a host fd or None, not {type(stdin).__name__}")
        if resource_limits is not None and not isinstance(resource_limits, ResourceLimits):
            raise invalid_argument(f"resource_limits must be a sandboxns.ResourceLimits, not {resource_limits!r}")
        if (
            isinstance(cancel_grace, bool)
            or not isinstance(cancel_grace, (int, float))
            or not math.isfinite(cancel_grace)
            or cancel_grace < 0
        ):
            raise invalid_argument(f"cancel_grace must be a non-negative number of seconds, not {cancel_grace!r}")
        return await self._execute(
            argv, env=env, cwd=guest_cwd, stdin=stdin, timeout=timeout, output=output,
            cancel_grace=cancel_grace, limits=resource_limits,
        )  # fmt: skip

    async def _execute(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        timeout: float,
        output: OutputSink,
        stdin: int | bytes | None,
        cancel_grace: float,
        limits: ResourceLimits | None,
    ) -> RunResult:
        """Run checked arguments to completion (see :meth:`execute`)."""
        self._check_not_exclusive()
        policy = self.driver.network
        if policy.needs_gateway:
            env = {**PROXY_ENVIRONMENT, **(PROXY_TRUST_ENVIRONMENT if policy.intercepts else {}), **env}
        if self._admission is not None:
            self._admission.acquire()
        self._running += 1
        if self._quiet.is_set():
            self._quiet = trio.Event()
        self.touch()
        try:
            return await self._supervise(argv, env, cwd, timeout, output, stdin, cancel_grace, limits)
        finally:
            self._running -= 1
            self.touch()
            if not self._running:
                self._quiet.set()
            if self._admission is not None:
                self._admission.release()

    async def _supervise(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        timeout: float,
        output: OutputSink,
        stdin: int | bytes | None,
        cancel_grace: float,
        limits: ResourceLimits | None,
    ) -> RunResult:
        """Spawn and wait; returns only once the command's whole tree is
        gone, whatever happens (timeout, cancellation, a stop)."""
        started = time.monotonic()
        try:
            process = await self.driver.spawn(argv, env=env, cwd=cwd, stdin=stdin, output=output, limits=limits)
        except OSError as exc:
            # The host could not make what a command needs (pipes, a
            # socket pair: EMFILE, ENOMEM); nothing of it runs.
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"cannot start the command: {exc}") from exc
        timed_out = False
        status: ExitStatus | None = None
        session_stopped = False
        try:
            with trio.move_on_after(timeout):
                status = await process.wait()
            if status is None:
                timed_out = True
                await process.send_signal(signal.SIGKILL)
                status = await process.wait()
        except SandboxError as exc:
            session_stopped = exc.code == ErrorCode.SANDBOX_STOPPED
            raise
        finally:
            with trio.CancelScope(shield=True):
                if status is None and not session_stopped:
                    with contextlib.suppress(SandboxError):
                        await _terminate(process, cancel_grace)
                await process.aclose()
                if session_stopped:
                    # The session died under the command; its tree is gone
                    # once the driver has finished closing.
                    await self.driver.aclose()
        return RunResult(
            exit_code=status.exit_code,
            signal=status.signal,
            stdout_bytes=_kept(output, "stdout"),
            stderr_bytes=_kept(output, "stderr"),
            timed_out=timed_out,
            truncated=bool(getattr(output, "truncated", False)),
            duration=time.monotonic() - started,
        )
