"""Coding tools for agents: read, write, edit, list, glob, search, run
commands and page their output, over one sandbox session.

``create_sandbox_coding_tools(handle, authorize=...)`` probes the session,
then returns :class:`CodingTools`: plain :class:`Tool` objects (name,
description, JSON schema, async call) that any agent loop can drive through
``dispatch(name, arguments)`` and the OpenAI/Anthropic function schemas.

Every side effect is first put to the host's ``authorize(operation)`` as a
typed operation, and every path segment to ``authorize_path(path)``; a
refusal is a result the model can read (``{"error", "message", "hint"}``),
never an exception in the agent loop. File tools work on the host's
contained view of the workspace (see _coding_files); commands run inside the
sandbox under the backend's admission limit. Nothing the tools return names a
host path, and the tools themselves cannot be serialised into model input or
stored state.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex
import trio

from . import _coding_files as files
from ._errors import ErrorCode, SandboxError
from ._files import HostWorkspaceIO
from ._paths import WORKSPACE
from ._pump import OutputCollector
from ._session import RunResult, Session, check_command

RESTRICTIONS = ("network-denied", "write-contained", "process-contained", "secrets-hidden")
DEFAULT_EXECUTABLES: Mapping[str, str] = {"shell": "/usr/bin/sh"}
FORBIDDEN = ErrorCode.FORBIDDEN.value
INSUFFICIENT_CODE = ErrorCode.SANDBOX_INSUFFICIENT
INSUFFICIENT = INSUFFICIENT_CODE.value
EDIT_NO_MATCH = "EDIT_NO_MATCH"
EDIT_AMBIGUOUS = "EDIT_AMBIGUOUS"
EDIT_STALE = "EDIT_STALE"
UNAVAILABLE_REASON = "the sandbox could not prepare this operation"
# The tool name on_tool_error gets for a failure while the tools are made.
CREATING_TOOLS = "create_sandbox_coding_tools"
# How many invalid UTF-8 sequences a read_file result locates.
INVALID_OFFSETS_SHOWN = 5
# A cancelled tool call's command gets this long between SIGTERM and SIGKILL.
CANCEL_GRACE = 0.2
# Failures of a command the model can act on; any other is the sandbox's.
REFUSED_AS_IS = frozenset(
    {
        ErrorCode.SANDBOX_NOT_FOUND,
        ErrorCode.SANDBOX_INVALID_ARGUMENT,
        ErrorCode.SANDBOX_BUSY,
        ErrorCode.SANDBOX_LIMIT,
    }
)
# Failures of the probe the caller can act on (wait for a slot, use a live
# session); any other means the sandbox could not be checked.
PROBE_REFUSED_AS_IS = frozenset({ErrorCode.SANDBOX_BUSY, ErrorCode.SANDBOX_STOPPED})

logger = logging.getLogger("sandboxns.coding")


@dataclass(frozen=True)
class CodingLimits:
    max_path_bytes: int = 4096
    max_read_bytes: int = 256 * 1024
    max_write_bytes: int = 256 * 1024
    shell_timeout: float = 10.0
    max_shell_output_bytes: int = 64 * 1024
    max_args: int = 128
    max_args_bytes: int = 64 * 1024
    max_list_entries: int = 500
    max_search_results: int = 100
    max_search_files: int = 10_000
    max_search_depth: int = 32
    max_hashed_file_bytes: int = 64 * 1024 * 1024
    max_artifact_bytes: int = 8 * 1024 * 1024
    max_artifacts: int = 64
    max_artifact_store_bytes: int = 64 * 1024 * 1024
    max_pattern_chars: int = 1000
    search_seconds: float = 5.0


@dataclass(frozen=True)
class CodingHooks:
    """``on_tool_error(tool_name, exception)`` gets the real cause of a
    refusal the model only sees as a fixed reason (SANDBOX_UNAVAILABLE);
    ``tool_name`` is "create_sandbox_coding_tools" for a failure while the
    tools are made (the restriction probe)."""

    on_tool_error: Callable[[str, BaseException], object] | None = None


# The operations ``authorize`` is asked about, one type per kind.
@dataclass(frozen=True)
class ReadOperation:
    path: str
    offset: int
    max_bytes: int
    kind: str = "read"


@dataclass(frozen=True)
class WriteOperation:
    path: str
    bytes: int
    overwrite: bool
    creates_directories: tuple[str, ...]
    kind: str = "write"


@dataclass(frozen=True)
class EditOperation:
    path: str
    base_sha256: str
    result_sha256: str
    replacements: int
    dry_run: bool
    kind: str = "edit"


@dataclass(frozen=True)
class ListOperation:
    path: str
    kind: str = "list"


@dataclass(frozen=True)
class GlobOperation:
    path: str
    pattern: str
    kind: str = "glob"


@dataclass(frozen=True)
class SearchOperation:
    path: str
    query: str
    regex: bool
    include: str | None
    kind: str = "search"


@dataclass(frozen=True)
class ShellOperation:
    executable: str
    args: tuple[str, ...]
    cwd: str
    kind: str = "shell"


@dataclass(frozen=True)
class ArtifactOperation:
    reference: str
    kind: str  # "artifact-read" or "artifact-search"


Operation = (
    ReadOperation | WriteOperation | EditOperation | ListOperation | GlobOperation | SearchOperation
    | ShellOperation | ArtifactOperation
)  # fmt: skip


# What a model can do about a refusal, when the refusal has no hint of its own.
DEFAULT_HINTS = {
    ErrorCode.SANDBOX_INVALID_ARGUMENT.value: "fix the arguments to match the tool's schema",
    ErrorCode.SANDBOX_PATH_REFUSED.value: "use a relative path, or one under /workspace, without '..'",
    ErrorCode.SANDBOX_NOT_FOUND.value: "list the directory to see what exists",
    ErrorCode.SANDBOX_LIMIT.value: "ask for less: a smaller range, shorter content or fewer results",
    ErrorCode.SANDBOX_BUSY.value: "try again shortly",
    ErrorCode.SANDBOX_UNAVAILABLE.value: "try again; if it persists, report it to the user",
    ErrorCode.SANDBOX_STOPPED.value: "the sandbox has stopped; report it to the user",
    ErrorCode.SANDBOX_POLICY_REFUSED.value: "the sandbox's policy does not allow this; do without it",
    FORBIDDEN: "the host does not allow this; do something else or ask the user",
    EDIT_NO_MATCH: "read the file again and copy old_text exactly",
    EDIT_AMBIGUOUS: "include more surrounding lines in old_text, or set replace_all",
    EDIT_STALE: "read the file again",
    INSUFFICIENT: "the sandbox no longer gives this tool what it needs; report it to the user",
    ErrorCode.SANDBOX_STATE_MISMATCH.value: "the sandbox's stored state is not usable; report it to the user",
}


class ToolRefusal(Exception):
    """A tool call that did not happen, as the model is told: the code, what
    was wrong, and what to do about it (a default for the code unless the
    refusal says better)."""

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = str(code)
        self.message = message
        self.hint = hint or DEFAULT_HINTS.get(self.code, "")

    def as_result(self) -> dict:
        return {"error": self.code, "message": self.message, "hint": self.hint}


@dataclass
class Artifact:
    stdout: bytes
    stderr: bytes
    truncated: bool


class ArtifactStore:
    """Command output too long for a tool result, kept in host memory (never
    in the workspace) for the model to page through. Bounded: the oldest
    artifacts are dropped beyond ``max_artifacts``."""

    def __init__(
        self,
        max_artifacts: int = CodingLimits.max_artifacts,
        max_total_bytes: int = CodingLimits.max_artifact_store_bytes,
    ) -> None:
        self._items: dict[str, Artifact] = {}
        self._max = max_artifacts
        self._max_bytes = max_total_bytes
        self._bytes = 0

    def add(self, artifact: Artifact) -> str:
        reference = f"out-{secrets.token_hex(6)}"
        self._items[reference] = artifact
        self._bytes += len(artifact.stdout) + len(artifact.stderr)
        while len(self._items) > self._max or (self._bytes > self._max_bytes and len(self._items) > 1):
            dropped = self._items.pop(next(iter(self._items)))
            self._bytes -= len(dropped.stdout) + len(dropped.stderr)
        return reference

    def get(self, reference: str) -> Artifact:
        try:
            return self._items[reference]
        except (KeyError, TypeError):
            raise ToolRefusal(
                ErrorCode.SANDBOX_NOT_FOUND, f"no output {reference!r}", "only references from run_command results work"
            ) from None


def preview(data: bytes, budget: int) -> tuple[str, int, int]:
    """Head and tail of ``data`` within ``budget`` bytes, cut on character
    boundaries; returns the text and the head and tail sizes."""
    if len(data) <= budget:
        return data.decode("utf-8", "replace"), len(data), 0
    marker = "\n[... output omitted; page it with read_output ...]\n"
    room = max(0, budget - len(marker))
    head_end = room // 2
    while 0 < head_end < len(data) and (data[head_end] & 0xC0) == 0x80:
        head_end -= 1
    tail_start = len(data) - (room - head_end)
    while tail_start < len(data) and (data[tail_start] & 0xC0) == 0x80:
        tail_start += 1
    head, tail = data[:head_end], data[tail_start:]
    return head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace"), len(head), len(tail)


@dataclass
class Tool:
    """One tool: what a model sees (name, description, JSON schema) and the
    host-side call."""

    name: str
    description: str
    input_schema: dict
    call: Callable[[dict], Awaitable[dict]] = field(repr=False)

    def __reduce__(self):
        raise TypeError("coding tools hold a live sandbox binding and cannot be serialised")


class CodingTools:
    """The coding tools of one session handle."""

    def __init__(self, tools: list[Tool], binding: _Binding) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._binding = binding

    def __iter__(self):
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __reduce__(self):
        raise TypeError("coding tools hold a live sandbox binding and cannot be serialised")

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def as_openai_tools(self) -> list[dict]:
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in self
        ]

    def as_anthropic_tools(self) -> list[dict]:
        return [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in self]

    async def dispatch(self, name: str, arguments: Mapping[str, Any] | None) -> dict:
        """Run one call; always returns a JSON-serialisable dict: the result,
        or ``{"error": CODE, "message": ..., "hint": ...}``."""
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return ToolRefusal(
                ErrorCode.SANDBOX_INVALID_ARGUMENT, f"no tool {name!r}", f"tools: {self.names}"
            ).as_result()
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping):
            return ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "arguments must be an object").as_result()
        try:
            return await tool.call(dict(arguments))
        except ToolRefusal as refusal:
            return refusal.as_result()
        except SandboxError as exc:
            return ToolRefusal(exc.code.value, exc.message).as_result()
        except Exception as exc:  # noqa: BLE001 - a bug is the host's to see, never the model's
            return self._binding.unavailable(name, exc).as_result()


@dataclass(frozen=True)
class CapturedCommand:
    """A run_command, checked and authorized, as the session runs it:
    output captured up to ``capture_limit`` bytes, SIGTERM then SIGKILL
    ``cancel_grace`` seconds apart if cancelled, and refused unless the
    network policy is still of ``network_generation``."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    timeout: float
    capture_limit: int
    cancel_grace: float
    network_generation: int


@dataclass(frozen=True)
class CapturedRun:
    """What a CapturedCommand gave: its result, or None if the session was
    stopped under it (then the output is what it wrote until then)."""

    result: RunResult | None
    stdout: bytes
    stderr: bytes
    truncated: bool


# The functions of _coding_files the tools run over a workspace (and all a
# session on another node will run for them).
WORKSPACE_OPERATIONS = frozenset(
    {
        files.read_slice,
        files.read_whole,
        files.missing_directories,
        files.write_atomically,
        files.list_directory,
        files.walk,
        files.search_contents,
    }
)


class WorkspaceTarget:
    """What the coding tools need of a session, for a session of this
    process: its handle's liveness, its network policy, its workspace (the
    host's contained view of it, _coding_files' functions taking its
    directory fd) and its commands. A session on another node has a proxy
    of the same methods (sandboxns.ray), whose calls this class serves on
    that node."""

    def __init__(self, handle: Any, session: Session) -> None:
        self.handle = handle
        self.session = session

    def check_live(self) -> None:
        """SANDBOX_STOPPED once the handle was stopped; the driver's own
        refusal once it is closed (or taken over)."""
        if not getattr(self.handle, "live", True):
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the sandbox session is stopped")
        self.session.check_usable()

    async def environment(self) -> dict[str, str]:
        return dict(self.session.environment)

    async def run_probe(self) -> RunResult:
        """The restriction probe's run (see _grade)."""
        # The host's home goes in on stdin: an argument would show in /proc.
        return await self.session.run(
            "/bin/sh", ["-c", _PROBE], env={}, stdin=os.path.expanduser("~") + "\n", timeout=10
        )

    async def network_state(self) -> tuple[str, int]:
        """The policy's kind and generation (bumped by every change)."""
        self.check_live()
        return self.session.network.kind, self.session.network_generation

    async def workspace_call(self, function: Callable, *args: Any) -> Any:
        self.check_live()
        return await self.session.workspace_call(function, *args)

    async def execute(self, command: CapturedCommand) -> CapturedRun:
        # Checked with no await before the command is admitted, so no
        # policy change or stop slips in between.
        self.check_live()
        if self.session.network_generation != command.network_generation:
            raise SandboxError(INSUFFICIENT_CODE, "the network policy changed while the command was prepared")
        capture = OutputCollector(command.capture_limit, stop_when_full=True)
        try:
            result = await self.session.execute(
                command.argv[0],
                command.argv[1:],
                env=command.env,
                cwd=command.cwd,
                timeout=command.timeout,
                output=capture,
                cancel_grace=command.cancel_grace,
            )
        except SandboxError as exc:
            if exc.code != ErrorCode.SANDBOX_STOPPED:
                raise
            # The session was stopped under the command: it was killed,
            # and what it wrote so far (maybe nothing) is worth showing.
            return CapturedRun(None, capture.output("stdout"), capture.output("stderr"), capture.truncated)
        return CapturedRun(result, result.stdout_bytes, result.stderr_bytes, capture.truncated)


class _Binding:
    """The host-only link from tools to a session: never shown to a model."""

    def __init__(self, target: Any, hooks: CodingHooks) -> None:
        self.target = target
        self.hooks = hooks
        self.grade: dict[str, bool] = {}
        self.edit_lock = trio.Lock()

    def check_live(self) -> None:
        """Refuse once the handle was stopped or the driver is closed (or
        taken over): old tools never touch a session that moved on."""
        try:
            self.target.check_live()
        except SandboxError as exc:
            raise ToolRefusal(exc.code.value, exc.message, "create new tools from a new handle") from None

    def report(self, tool: str, cause: BaseException) -> None:
        """Give the host the real cause of a fixed reason."""
        if self.hooks.on_tool_error is not None:
            try:
                self.hooks.on_tool_error(tool, cause)
            except Exception:  # a host hook must not break the tool
                logger.exception("on_tool_error raised")

    def unavailable(self, tool: str, cause: BaseException) -> ToolRefusal:
        self.report(tool, cause)
        return ToolRefusal(ErrorCode.SANDBOX_UNAVAILABLE, UNAVAILABLE_REASON)


# The probe: what the guest can actually see and do, checked for real.
_PROBE = r"""
interfaces=$(awk -F: 'NR>2 {gsub(/ /, "", $1); print $1}' /proc/net/dev | grep -v '^lo$' | wc -l)
echo "interfaces=$interfaces"
touch /probe-root 2>/dev/null && echo "root-writable=1" || echo "root-writable=0"
touch /usr/probe-usr 2>/dev/null && echo "usr-writable=1" || echo "usr-writable=0"
test -w /workspace && echo "workspace-writable=1" || echo "workspace-writable=0"
echo "shell-pid=$$"
echo "processes=$(ls /proc | grep -c '^[0-9]')"
echo "environment=$(env | grep -v '^PWD=' | wc -l)"
read -r home
test -e "$home" && echo "host-home=1" || echo "host-home=0"
"""


def _grade(result: RunResult) -> dict[str, bool]:
    """The restrictions the probe's run shows."""
    facts = dict(line.split("=", 1) for line in result.stdout.split() if "=" in line)
    if result.exit_code != 0 or len(facts) != 8:
        raise RuntimeError(f"restriction probe failed: {result.exit_code} {result.stderr.strip()[:200]}")
    return {
        "network-denied": facts["interfaces"] == "0",
        "write-contained": facts["root-writable"] == "0" and facts["usr-writable"] == "0"
        and facts["workspace-writable"] == "1",
        # Its own pid namespace: the shell is pid 2 or so, and the host's
        # processes are nowhere in /proc.
        "process-contained": int(facts["shell-pid"]) <= 3 and int(facts["processes"]) <= 10,
        "secrets-hidden": facts["environment"] == "0" and facts["host-home"] == "0",
    }  # fmt: skip


def _missing(required: Sequence[str], grade: Mapping[str, bool], policy_kind: str) -> list[str]:
    """The required restrictions the probe did not see, or the current
    policy no longer gives."""
    return [
        restriction for restriction in required
        if not grade.get(restriction) or restriction == "network-denied" and policy_kind != "deny-all"
    ]  # fmt: skip


# Argument checking: the model's input is untrusted.
def _argument(arguments: dict, name: str, kind: type | tuple, default: Any = ...) -> Any:
    if name not in arguments:
        if default is ...:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"missing argument {name!r}")
        return default
    value = arguments[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must be {expected}")
    if isinstance(value, str):
        _check_text(value, name)
    return value


def _check_text(value: str, name: str) -> None:
    """Refuse what cannot be UTF-8 (lone surrogates from JSON's \\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} is not valid Unicode text") from None


def check_tool_path(path: object, limits: CodingLimits, name: str = "path") -> str:
    """A workspace-relative or /workspace/... path, in canonical guest form.
    Stricter than the session's paths: no backslash, no empty, '.' or '..'
    segment, nothing that needs normalising."""
    if not isinstance(path, str) or not path:
        raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must be a non-empty string")
    _check_text(path, name)
    if len(path.encode()) > limits.max_path_bytes:
        raise ToolRefusal(ErrorCode.SANDBOX_LIMIT, f"{name} is longer than {limits.max_path_bytes} bytes")
    if "\\" in path or "\0" in path:
        raise ToolRefusal(ErrorCode.SANDBOX_PATH_REFUSED, f"{name} must not contain backslashes or NUL")
    if path in (".", WORKSPACE, WORKSPACE + "/"):
        return WORKSPACE
    relative = path[len(WORKSPACE) + 1 :] if path.startswith(WORKSPACE + "/") else path
    if path.startswith("/") and relative is path:
        raise ToolRefusal(
            ErrorCode.SANDBOX_PATH_REFUSED, f"{name} must be inside {WORKSPACE}", "use a path relative to the workspace"
        )
    segments = relative.removesuffix("/").split("/")  # one trailing slash, as for a directory
    if any(segment in ("", ".", "..") for segment in segments):
        raise ToolRefusal(ErrorCode.SANDBOX_PATH_REFUSED, f"{name} has an empty, '.' or '..' segment")
    return f"{WORKSPACE}/{'/'.join(segments)}"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def create_sandbox_coding_tools(
    handle: Any,
    *,
    authorize: Callable[[Operation], bool | Awaitable[bool]],
    authorize_path: Callable[[str], bool | Awaitable[bool]] | None = None,
    executables: Mapping[str, str] = DEFAULT_EXECUTABLES,
    environment: Mapping[str, str] | None = None,
    required_restrictions: Sequence[str] = RESTRICTIONS,
    limits: CodingLimits = CodingLimits(),
    hooks: CodingHooks = CodingHooks(),
    artifacts: ArtifactStore | None = None,
) -> CodingTools:
    """The coding tools for a session handle (or a :class:`Session`); see
    the module docstring and the README."""
    coding_target = getattr(handle, "coding_target", None)
    if callable(coding_target):
        target = coding_target()  # a session elsewhere (sandboxns.ray)
    else:
        session = handle.session if hasattr(handle, "session") else handle
        if not isinstance(session, Session) or not isinstance(session.driver, HostWorkspaceIO):
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE, "this sandbox has no host-side workspace binding for coding tools"
            )
        target = WorkspaceTarget(handle, session)
    if not callable(authorize) or (authorize_path is not None and not callable(authorize_path)):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "authorize and authorize_path must be callables")
    unknown = set(required_restrictions) - set(RESTRICTIONS)
    if unknown:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"unknown restrictions {sorted(unknown)}")
    if (
        not isinstance(executables, Mapping)
        or not executables
        or not all(isinstance(k, str) and isinstance(v, str) and v.startswith("/") for k, v in executables.items())
    ):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "executables must map aliases to absolute guest paths")
    binding = _Binding(target, hooks)
    binding.check_live()
    env = await target.environment() if environment is None else dict(environment)
    try:
        binding.grade = _grade(await target.run_probe())
        policy_kind, _ = await target.network_state()
    except Exception as exc:  # whatever broke, the host's hook hears of it
        if isinstance(exc, SandboxError) and exc.code in PROBE_REFUSED_AS_IS:
            raise
        binding.report(CREATING_TOOLS, exc)
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, UNAVAILABLE_REASON) from exc
    missing = _missing(required_restrictions, binding.grade, policy_kind)
    if missing:
        raise SandboxError(ErrorCode.SANDBOX_INSUFFICIENT, f"the session does not provide {', '.join(missing)}")
    implementation = _Implementation(
        binding, authorize, authorize_path, dict(executables), env, tuple(required_restrictions), limits,
        artifacts or ArtifactStore(limits.max_artifacts, limits.max_artifact_store_bytes),
    )  # fmt: skip
    return CodingTools(implementation.tools(), binding)


class _Implementation:
    def __init__(
        self,
        binding: _Binding,
        authorize: Callable,
        authorize_path: Callable | None,
        executables: dict[str, str],
        environment: dict[str, str],
        required: tuple[str, ...],
        limits: CodingLimits,
        artifacts: ArtifactStore,
    ) -> None:
        self.binding = binding
        self._authorize = authorize
        self._authorize_path = authorize_path
        self.executables = executables
        self.environment = environment
        self.required = required
        self.limits = limits
        self.artifacts = artifacts

    # -- authorization ---------------------------------------------------
    async def authorize(self, operation: Operation) -> None:
        if await _maybe_await(self._authorize(operation)) is not True:
            raise ToolRefusal(FORBIDDEN, f"the host does not allow this {operation.kind}")

    async def path_allowed(self, guest_path: str) -> bool:
        """authorize_path for each ancestor, then the path itself."""
        if self._authorize_path is None or guest_path == WORKSPACE:
            return True
        parts = guest_path[len(WORKSPACE) + 1 :].split("/")
        for i in range(1, len(parts) + 1):
            if await _maybe_await(self._authorize_path(f"{WORKSPACE}/{'/'.join(parts[:i])}")) is not True:
                return False
        return True

    async def require_path(self, guest_path: str) -> None:
        if not await self.path_allowed(guest_path):
            raise ToolRefusal(FORBIDDEN, f"the host does not allow {guest_path}")

    async def call_files(self, function, *args):
        self.binding.check_live()
        # Activity, and refused during a snapshot, as the Session's own file methods are.
        return await self.binding.target.workspace_call(function, *args)

    # -- tools -------------------------------------------------------------
    def tools(self) -> list[Tool]:
        path = {"type": "string", "description": "workspace-relative path, or /workspace/..."}
        return [
            Tool("read_file", "Read a text file of the workspace, a slice at a time. Bytes that are not UTF-8 "
                 "are shown as U+FFFD; the result then has replaced_invalid_utf8: true and invalid_utf8_offsets "
                 f"(the file offsets of the first {INVALID_OFFSETS_SHOWN} such sequences).", _schema(
                {"path": path, "offset": {"type": "integer", "minimum": 0, "default": 0},
                 "max_bytes": {"type": "integer", "minimum": 1, "maximum": self.limits.max_read_bytes}},
                ["path"]), self.read_file),
            Tool("write_file", "Create a file (and its parent directories), or replace one with overwrite=true.",
                 _schema({"path": path, "content": {"type": "string"}, "overwrite": {"type": "boolean", "default": False}},
                         ["path", "content"]), self.write_file),
            Tool("edit_file", "Replace an exact snippet of a file (once, or every occurrence with replace_all).",
                 _schema({"path": path, "old_text": {"type": "string"}, "new_text": {"type": "string"},
                          "replace_all": {"type": "boolean", "default": False},
                          "expected_sha256": {"type": "string", "description": "sha256 from read_file; refuse if the file changed"},
                          "dry_run": {"type": "boolean", "default": False}},
                         ["path", "old_text", "new_text"]), self.edit_file),
            Tool("list_directory", "List a workspace directory.", _schema({"path": {**path, "default": "."}}, []),
                 self.list_directory),
            Tool("glob", "Find workspace paths matching a glob (** spans directories).",
                 _schema({"pattern": {"type": "string"}, "path": {**path, "default": "."}}, ["pattern"]), self.glob),
            Tool("search_files", "Search file contents (or paths) for a literal string or a regular expression.",
                 _schema({"query": {"type": "string"}, "regex": {"type": "boolean", "default": False},
                          "path": {**path, "default": "."}, "include": {"type": "string", "description": "glob of files to search"},
                          "search_paths": {"type": "boolean", "default": False},
                          "context_lines": {"type": "integer", "minimum": 0, "maximum": 10, "default": 0}},
                         ["query"]), self.search_files),
            Tool("run_command", f"Run a command in the sandbox. executable is one of: {', '.join(self.executables)}.",
                 _schema({"executable": {"type": "string", "enum": list(self.executables)},
                          "args": {"type": "array", "items": {"type": "string"}},
                          "cwd": {**path, "default": "."}}, ["executable"]), self.run_command),
            Tool("read_output", "Page through the full output of an earlier run_command.",
                 _schema({"reference": {"type": "string"}, "stream": {"type": "string", "enum": ["stdout", "stderr"]},
                          "offset": {"type": "integer", "minimum": 0, "default": 0},
                          "max_bytes": {"type": "integer", "minimum": 1, "maximum": self.limits.max_read_bytes}},
                         ["reference"]), self.read_output),
            Tool("search_output", "Search the full output of an earlier run_command.",
                 _schema({"reference": {"type": "string"}, "query": {"type": "string"},
                          "regex": {"type": "boolean", "default": False}}, ["reference", "query"]), self.search_output),
        ]  # fmt: skip

    async def read_file(self, arguments: dict) -> dict:
        guest_path = check_tool_path(arguments.get("path"), self.limits)
        offset = _argument(arguments, "offset", int, 0)
        max_bytes = min(_argument(arguments, "max_bytes", int, self.limits.max_read_bytes), self.limits.max_read_bytes)
        if offset < 0 or max_bytes < 1:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "offset must be >= 0 and max_bytes >= 1")
        await self.require_path(guest_path)
        await self.authorize(ReadOperation(guest_path, offset, max_bytes))
        result = await self.call_files(
            files.read_slice, guest_path, offset, max_bytes, self.limits.max_hashed_file_bytes
        )
        reply = {
            "path": guest_path,
            "text": result.data.decode("utf-8", "replace"),
            "bytes": len(result.data),
            "offset": result.offset,
            "size": result.size,
            "sha256": result.sha256,
            "truncated": result.next_offset is not None,
            "next_offset": result.next_offset,
        }
        invalid = files.invalid_utf8_offsets(result.data, INVALID_OFFSETS_SHOWN)
        if invalid:  # the model must not take a U+FFFD for the file's content
            reply["replaced_invalid_utf8"] = True
            reply["invalid_utf8_offsets"] = [result.offset + position for position in invalid]
        return reply

    async def write_file(self, arguments: dict) -> dict:
        guest_path = check_tool_path(arguments.get("path"), self.limits)
        content = _argument(arguments, "content", str).encode("utf-8")
        overwrite = _argument(arguments, "overwrite", bool, False)
        if guest_path == WORKSPACE:
            raise ToolRefusal(ErrorCode.SANDBOX_PATH_REFUSED, "the workspace itself is not a file")
        if len(content) > self.limits.max_write_bytes:
            raise ToolRefusal(ErrorCode.SANDBOX_LIMIT, f"content is over {self.limits.max_write_bytes} bytes")
        await self.require_path(guest_path)
        creates = tuple(await self.call_files(files.missing_directories, guest_path))
        await self.authorize(WriteOperation(guest_path, len(content), overwrite, creates))
        try:
            created = await self.call_files(files.write_atomically, guest_path, content, overwrite, None, creates)
        except files.StaleError:
            raise ToolRefusal(
                EDIT_STALE, f"the directories above {guest_path} changed while the write was authorized", "call again"
            ) from None
        return {"path": guest_path, "bytes": len(content), "created_directories": created,
                "sha256": hashlib.sha256(content).hexdigest()}  # fmt: skip

    async def edit_file(self, arguments: dict) -> dict:
        guest_path = check_tool_path(arguments.get("path"), self.limits)
        old_text = _argument(arguments, "old_text", str)
        new_text = _argument(arguments, "new_text", str)
        replace_all = _argument(arguments, "replace_all", bool, False)
        expected = _argument(arguments, "expected_sha256", str, None)
        dry_run = _argument(arguments, "dry_run", bool, False)
        if not old_text:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "old_text must not be empty")
        await self.require_path(guest_path)
        # An edit reads the file, and its refusals (no match, ambiguous,
        # stale) tell about its content: the host must allow the read first.
        await self.authorize(ReadOperation(guest_path, 0, self.limits.max_write_bytes))
        # One edit at a time per tools object, and a re-check of the base
        # just before the rename, so two edits from one base never both land.
        async with self.binding.edit_lock:
            base = await self.call_files(files.read_whole, guest_path, self.limits.max_write_bytes)
            base_sha = hashlib.sha256(base).hexdigest()
            if expected is not None and expected != base_sha:
                raise ToolRefusal(EDIT_STALE, f"{guest_path} changed since it was read", "read it again")
            try:
                text = base.decode("utf-8")
            except UnicodeDecodeError:
                raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} is not UTF-8 text") from None
            count = text.count(old_text)
            if count == 0:
                raise ToolRefusal(EDIT_NO_MATCH, f"old_text does not occur in {guest_path}", "read the file again")
            if count > 1 and not replace_all:
                raise ToolRefusal(
                    EDIT_AMBIGUOUS, f"old_text occurs {count} times in {guest_path}",
                    "add surrounding lines to make it unique, or pass replace_all=true",
                )  # fmt: skip
            result = text.replace(old_text, new_text) if replace_all else text.replace(old_text, new_text, 1)
            data = result.encode("utf-8")
            if len(data) > self.limits.max_write_bytes:
                raise ToolRefusal(ErrorCode.SANDBOX_LIMIT, f"the result is over {self.limits.max_write_bytes} bytes")
            result_sha = hashlib.sha256(data).hexdigest()
            replacements = count if replace_all else 1
            await self.authorize(EditOperation(guest_path, base_sha, result_sha, replacements, dry_run))
            if not dry_run:
                try:
                    await self.call_files(files.write_atomically, guest_path, data, True, base_sha)
                except files.StaleError:
                    raise ToolRefusal(EDIT_STALE, f"{guest_path} changed during the edit", "read it again") from None
        return {"path": guest_path, "replacements": replacements, "dry_run": dry_run,
                "base_sha256": base_sha, "sha256": result_sha}  # fmt: skip

    async def list_directory(self, arguments: dict) -> dict:
        guest_path = check_tool_path(arguments.get("path", "."), self.limits)
        await self.require_path(guest_path)
        await self.authorize(ListOperation(guest_path))
        entries = await self.call_files(files.list_directory, guest_path)
        limit = self.limits.max_list_entries
        shown, denied = [], []
        for entry in entries[: limit + 1]:  # the host is asked about no more than can be shown
            if await self.path_allowed(entry.path):
                shown.append({"name": entry.path.rsplit("/", 1)[1], "kind": entry.kind, "size": entry.size})
            else:
                denied.append(entry.path.rsplit("/", 1)[1])
        truncated = len(entries) > limit
        return {"path": guest_path, "entries": shown[:limit], "truncated": truncated, "denied": denied}

    async def _walk(self, guest_path: str) -> tuple[list[files.Entry], list[str]]:
        """Entries under a directory the host allows (denied ones listed
        apart), bounded by the search limits."""
        allowed_cache: dict[str, bool] = {}
        denied: list[str] = []
        # The walk runs in a worker thread; authorize_path (maybe async) is
        # asked afterwards, and a denied directory hides all beneath it.
        entries = await self.call_files(
            files.walk, guest_path, self.limits.max_search_depth, self.limits.max_search_files
        )
        kept = []
        for entry in entries:
            parent = entry.path.rsplit("/", 1)[0]
            if parent != guest_path and not allowed_cache.get(parent, True):
                allowed_cache[entry.path] = False
                continue
            ok = await self.path_allowed(entry.path)
            allowed_cache[entry.path] = ok
            if ok:
                kept.append(entry)
            else:
                denied.append(entry.path)
        return kept, denied

    async def glob(self, arguments: dict) -> dict:
        pattern = self._pattern(arguments, "pattern")
        guest_path = check_tool_path(arguments.get("path", "."), self.limits)
        await self.require_path(guest_path)
        await self.authorize(GlobOperation(guest_path, pattern))
        entries, denied = await self._walk(guest_path)
        prefix = len(guest_path) + 1
        matches = [e.path for e in entries if e.kind != "symlink" and files.glob_match(pattern, e.path[prefix:])]
        limit = self.limits.max_search_results
        return {"path": guest_path, "matches": matches[:limit], "truncated": len(matches) > limit, "denied": denied}

    def _pattern(self, arguments: dict, name: str, required: bool = True) -> str | None:
        value = _argument(arguments, name, str) if required else _argument(arguments, name, str, None)
        if value is not None and (not value or len(value) > self.limits.max_pattern_chars):
            raise ToolRefusal(
                ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must have 1 to {self.limits.max_pattern_chars} characters"
            )
        return value

    def _compile(self, query: str, use_regex: bool):
        try:
            return regex.compile(query if use_regex else regex.escape(query))
        except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"bad regular expression: {exc}") from None

    async def _search(self, function, *args):
        """Run a search in a worker thread against the search time budget."""
        deadline = files.Deadline.after(self.limits.search_seconds)
        try:
            return await function(*args, deadline)
        except files.SearchTimeout:
            raise ToolRefusal(
                ErrorCode.SANDBOX_LIMIT, f"the search took over {self.limits.search_seconds:g} s",
                "use a simpler expression or a narrower path",
            ) from None  # fmt: skip

    async def search_files(self, arguments: dict) -> dict:
        query = self._pattern(arguments, "query")
        use_regex = _argument(arguments, "regex", bool, False)
        include = self._pattern(arguments, "include", required=False)
        search_paths = _argument(arguments, "search_paths", bool, False)
        context = _argument(arguments, "context_lines", int, 0)
        guest_path = check_tool_path(arguments.get("path", "."), self.limits)
        if not 0 <= context <= 10:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "context_lines must be 0 to 10")
        pattern = self._compile(query, use_regex)
        await self.require_path(guest_path)
        await self.authorize(SearchOperation(guest_path, query, use_regex, include))
        entries, denied = await self._walk(guest_path)
        prefix = len(guest_path) + 1
        candidates = [
            e.path for e in entries
            if e.kind == "file" and (include is None or files.glob_match(include, e.path[prefix:])
                                     or files.glob_match(include, e.path.rsplit("/", 1)[1]))
        ]  # fmt: skip
        limit = self.limits.max_search_results
        if search_paths:

            async def by_path(deadline: float) -> list[dict]:
                names = "\n".join(path[prefix:] for path in candidates)
                found = await trio.to_thread.run_sync(
                    lambda: [n for n, _ in files.search_lines(names, pattern, limit + 1, deadline)]
                )
                return [{"path": candidates[n]} for n in found]

            results = await self._search(by_path)
        else:

            async def by_content(deadline: float) -> list[dict]:
                found = await self.call_files(
                    files.search_contents, candidates, pattern, context, limit, deadline, self.limits.max_read_bytes
                )
                return [vars(match) for match in found]

            results = await self._search(by_content)
        return {"path": guest_path, "matches": results[:limit], "truncated": len(results) > limit, "denied": denied}

    async def run_command(self, arguments: dict) -> dict:
        alias = _argument(arguments, "executable", str)
        args = _argument(arguments, "args", list, [])
        guest_cwd = check_tool_path(arguments.get("cwd", "."), self.limits, "cwd")
        if alias not in self.executables:
            raise ToolRefusal(
                ErrorCode.SANDBOX_NOT_FOUND, f"no executable {alias!r}", f"use one of: {', '.join(self.executables)}"
            )
        for arg in args:
            if not isinstance(arg, str):
                raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "args must be strings")
            _check_text(arg, "args")
        if len(args) > self.limits.max_args or sum(len(a.encode()) + 1 for a in args) > self.limits.max_args_bytes:
            raise ToolRefusal(
                ErrorCode.SANDBOX_LIMIT, f"at most {self.limits.max_args} args of {self.limits.max_args_bytes} bytes"
            )
        # The session's own checks (NUL, sizes) and its environment rule (PWD).
        argv, env, _, timeout = check_command(
            self.executables[alias], args, self.environment, guest_cwd, self.limits.shell_timeout
        )
        binding = self.binding
        binding.check_live()
        policy_kind, generation = await binding.target.network_state()
        missing = _missing(self.required, binding.grade, policy_kind)
        if missing:
            raise ToolRefusal(INSUFFICIENT, f"the session no longer provides {', '.join(missing)}")
        await self.require_path(guest_cwd)
        await self.authorize(ShellOperation(alias, tuple(args), guest_cwd))
        # A stop or policy change while the host decided is a refusal
        # (nothing ran: execute checks both first); from there on, a stop
        # is one under the command.
        command = CapturedCommand(
            argv, env, guest_cwd, timeout, self.limits.max_artifact_bytes, CANCEL_GRACE, generation
        )
        started = trio.current_time()
        try:
            captured = await binding.target.execute(command)
        except SandboxError as exc:
            if exc.code == INSUFFICIENT_CODE:
                raise ToolRefusal(INSUFFICIENT, exc.message, "call again") from None
            if exc.code == ErrorCode.SANDBOX_STOPPED:
                raise ToolRefusal(exc.code.value, exc.message, "create new tools from a new handle") from None
            if exc.code in REFUSED_AS_IS:
                raise ToolRefusal(exc.code.value, exc.message) from None
            raise binding.unavailable("run_command", exc) from exc
        result = captured.result
        shown = self._shape_output(captured.stdout, captured.stderr, captured.truncated)
        if result is None:
            duration = round(trio.current_time() - started, 3)
            return {"exit_code": None, "signal": 9, "outcome": "cancelled", "duration": duration, **shown}
        outcome = "timeout" if result.timed_out else "output-limit" if captured.truncated else "exited"
        duration = round(result.duration, 3)
        return {
            "exit_code": result.exit_code,
            "signal": result.signal,
            "outcome": outcome,
            "duration": duration,
            **shown,
        }

    def _shape_output(self, stdout: bytes, stderr: bytes, truncated: bool) -> dict:
        budget = self.limits.max_shell_output_bytes
        if len(stdout) + len(stderr) <= budget and not truncated:
            return {"stdout": stdout.decode("utf-8", "replace"), "stderr": stderr.decode("utf-8", "replace"),
                    "artifact": None}  # fmt: skip
        stderr_budget = (
            min(len(stderr), budget // 4) if len(stdout) > budget // 2 else budget - min(len(stdout), budget // 2)
        )
        stdout_budget = budget - min(len(stderr), stderr_budget)
        out_text, out_head, out_tail = preview(stdout, stdout_budget)
        err_text, err_head, err_tail = preview(stderr, budget - stdout_budget)
        reference = self.artifacts.add(Artifact(stdout, stderr, truncated))
        total = len(stdout) + len(stderr)
        head, tail = out_head + err_head, out_tail + err_tail
        return {
            "stdout": out_text, "stderr": err_text,
            "artifact": {"reference": reference, "bytes": total, "truncated": truncated,
                         "head_bytes": head, "tail_bytes": tail, "omitted_bytes": total - head - tail},
        }  # fmt: skip

    async def read_output(self, arguments: dict) -> dict:
        reference = _argument(arguments, "reference", str)
        stream = _argument(arguments, "stream", str, "stdout")
        offset = _argument(arguments, "offset", int, 0)
        max_bytes = min(_argument(arguments, "max_bytes", int, self.limits.max_read_bytes), self.limits.max_read_bytes)
        if stream not in ("stdout", "stderr") or offset < 0 or max_bytes < 1:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "stream is stdout or stderr; offset >= 0")
        artifact = self.artifacts.get(reference)
        await self.authorize(ArtifactOperation(reference, "artifact-read"))
        data = getattr(artifact, stream)
        window = data[offset : offset + files.utf8_window(max_bytes)]
        start, end = files.utf8_slice(window, max_bytes)
        next_offset = offset + end if offset + end < len(data) else None
        return {"reference": reference, "stream": stream, "offset": offset + start,
                "text": window[start:end].decode("utf-8", "replace"), "size": len(data),
                "next_offset": next_offset, "truncated": artifact.truncated}  # fmt: skip

    async def search_output(self, arguments: dict) -> dict:
        reference = _argument(arguments, "reference", str)
        query = self._pattern(arguments, "query")
        use_regex = _argument(arguments, "regex", bool, False)
        pattern = self._compile(query, use_regex)
        artifact = self.artifacts.get(reference)
        await self.authorize(ArtifactOperation(reference, "artifact-search"))
        limit = self.limits.max_search_results

        def scan(deadline: float) -> list[dict]:
            matches = []
            for stream in ("stdout", "stderr"):
                text = getattr(artifact, stream).decode("utf-8", "replace")
                for number, lines in files.search_lines(text, pattern, limit + 1 - len(matches), deadline):
                    matches.append({"stream": stream, "line": number + 1, "text": lines[number][:500]})
                if len(matches) > limit:
                    break
            return matches

        async def in_worker(deadline: float) -> list[dict]:
            return await trio.to_thread.run_sync(scan, deadline)

        matches = await self._search(in_worker)
        return {"reference": reference, "matches": matches[:limit], "truncated": len(matches) > limit}


def _schema(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
