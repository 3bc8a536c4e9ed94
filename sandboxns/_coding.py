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

This module holds what the tools share and what their callers see (limits,
hooks, operations, refusals, the tool set, the workspace they act on); the
tools themselves, by family, are in _coding_tools.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from . import _coding_files as files
from ._errors import ErrorCode, SandboxError
from ._paths import WORKSPACE
from ._pump import OutputCollector
from ._session import RunResult, Session

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

    def __init__(self, tools: list[Tool], binding: ToolBinding) -> None:
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
        """The restriction probe's run (see grade_probe)."""
        # The host's home goes in on stdin: an argument would show in /proc.
        return await self.session.run(
            "/bin/sh", ["-c", PROBE], env={}, stdin=os.path.expanduser("~") + "\n", timeout=10
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


class ToolBinding:
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
PROBE = r"""
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


def grade_probe(result: RunResult) -> dict[str, bool]:
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


def missing_restrictions(required: Sequence[str], grade: Mapping[str, bool], policy_kind: str) -> list[str]:
    """The required restrictions the probe did not see, or the current
    policy no longer gives."""
    return [
        restriction for restriction in required
        if not grade.get(restriction) or restriction == "network-denied" and policy_kind != "deny-all"
    ]  # fmt: skip


def check_text(value: str, name: str) -> None:
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
    check_text(path, name)
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
