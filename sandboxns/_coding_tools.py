"""The coding tools themselves, by family (files, search, commands), and
create_sandbox_coding_tools, which probes a session and assembles them (see
_coding for what they share: operations, refusals, the workspace target)."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import regex
import trio

from . import _coding_files as files
from ._coding import (
    CANCEL_GRACE,
    CREATING_TOOLS,
    DEFAULT_EXECUTABLES,
    EDIT_AMBIGUOUS,
    EDIT_NO_MATCH,
    EDIT_STALE,
    FORBIDDEN,
    INSUFFICIENT,
    INSUFFICIENT_CODE,
    INVALID_OFFSETS_SHOWN,
    PROBE_REFUSED_AS_IS,
    REFUSED_AS_IS,
    RESTRICTIONS,
    UNAVAILABLE_REASON,
    Artifact,
    ArtifactOperation,
    ArtifactStore,
    CapturedCommand,
    CodingHooks,
    CodingLimits,
    CodingTools,
    EditOperation,
    GlobOperation,
    ListOperation,
    Operation,
    ReadOperation,
    SearchOperation,
    ShellOperation,
    Tool,
    ToolBinding,
    ToolRefusal,
    WorkspaceTarget,
    WriteOperation,
    check_text,
    check_tool_path,
    grade_probe,
    missing_restrictions,
    preview,
)
from ._errors import ErrorCode, SandboxError
from ._files import HostWorkspaceIO
from ._paths import WORKSPACE
from ._session import Session, check_command

DEFAULT_LIMITS = CodingLimits()
NO_HOOKS = CodingHooks()

# The model's input is untrusted: each tool's arguments are declared once,
# as _Param values, which give both the JSON schema the model sees and the
# checks its arguments go through before the tool runs.
_REQUIRED = object()
_PATH_DESCRIPTION = "workspace-relative path, or /workspace/..."


@dataclass(frozen=True)
class _Param:
    """One argument of a tool. ``kind`` is "text" (any string), "pattern"
    (1 to max_pattern_chars characters), "path" (see check_tool_path),
    "integer" (at least ``minimum``; larger than ``maximum`` is taken as
    ``maximum``), "boolean" or "strings" (a list of them). A "text" with
    ``choices`` must be one of them."""

    kind: str
    default: Any = _REQUIRED
    description: str | None = None
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] | None = None

    def schema(self) -> dict:
        kinds = {"integer": "integer", "boolean": "boolean", "strings": "array"}
        schema: dict[str, Any] = {"type": kinds.get(self.kind, "string")}
        if self.kind == "strings":
            schema["items"] = {"type": "string"}
        description = _PATH_DESCRIPTION if self.kind == "path" else self.description
        if description is not None:
            schema["description"] = description
        if self.choices is not None:
            schema["enum"] = list(self.choices)
        for key in ("minimum", "maximum"):
            if getattr(self, key) is not None:
                schema[key] = getattr(self, key)
        if self.default is not _REQUIRED and self.default is not None:
            schema["default"] = self.default
        return schema

    def parse(self, name: str, value: Any, limits: CodingLimits) -> Any:
        """The checked value of argument ``name`` (``_REQUIRED`` if absent)."""
        if value is _REQUIRED:
            if self.default is _REQUIRED:
                raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"missing argument {name!r}")
            value = self.default
            if value is None:
                return None
        if self.kind == "path":
            return check_tool_path(value, limits, name)
        expected = {"integer": int, "boolean": bool, "strings": list}.get(self.kind, str)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            noun = {"integer": "an integer", "boolean": "true or false", "strings": "a list of strings"}
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must be {noun.get(self.kind, 'a string')}")
        if self.kind == "strings":
            for item in value:
                if not isinstance(item, str):
                    raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must be a list of strings")
                check_text(item, name)
        elif isinstance(value, str):
            check_text(value, name)
        if self.kind == "integer":
            if self.minimum is not None and value < self.minimum:
                raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must be at least {self.minimum}")
            if self.maximum is not None:
                value = min(value, self.maximum)
        if self.kind == "pattern" and not 1 <= len(value) <= limits.max_pattern_chars:
            raise ToolRefusal(
                ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{name} must have 1 to {limits.max_pattern_chars} characters"
            )
        if self.choices is not None and value not in self.choices:
            raise ToolRefusal(
                ErrorCode.SANDBOX_NOT_FOUND, f"no {name} {value!r}", f"use one of: {', '.join(self.choices)}"
            )
        return value


def _tool(
    name: str, description: str, params: Mapping[str, _Param], limits: CodingLimits, run: Callable[..., Awaitable[dict]]
) -> Tool:
    """A tool whose arguments are checked against ``params`` and handed to
    ``run`` by name."""
    required = [key for key, param in params.items() if param.default is _REQUIRED]
    schema = {
        "type": "object",
        "properties": {key: param.schema() for key, param in params.items()},
        "required": required,
        "additionalProperties": False,
    }

    async def call(arguments: dict) -> dict:
        unknown = sorted(map(str, set(arguments) - set(params)))
        if unknown:
            raise ToolRefusal(
                ErrorCode.SANDBOX_INVALID_ARGUMENT,
                f"{name} has no argument {', '.join(map(repr, unknown))}",
                f"its arguments: {', '.join(params)}",
            )
        checked = {key: param.parse(key, arguments.get(key, _REQUIRED), limits) for key, param in params.items()}
        return await run(**checked)

    return Tool(name, description, schema, call)


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
    limits: CodingLimits = DEFAULT_LIMITS,
    hooks: CodingHooks = NO_HOOKS,
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
    binding = ToolBinding(target, hooks)
    binding.check_live()
    env = await target.environment() if environment is None else dict(environment)
    try:
        binding.grade = grade_probe(await target.run_probe())
        policy_kind, _ = await target.network_state()
    except Exception as exc:  # whatever broke, the host's hook hears of it
        if isinstance(exc, SandboxError) and exc.code in PROBE_REFUSED_AS_IS:
            raise
        binding.report(CREATING_TOOLS, exc)
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, UNAVAILABLE_REASON) from exc
    missing = missing_restrictions(required_restrictions, binding.grade, policy_kind)
    if missing:
        raise SandboxError(ErrorCode.SANDBOX_INSUFFICIENT, f"the session does not provide {', '.join(missing)}")
    host = _Host(binding, authorize, authorize_path, limits)
    commands = _CommandTools(
        host, dict(executables), env, tuple(required_restrictions),
        artifacts or ArtifactStore(limits.max_artifacts, limits.max_artifact_store_bytes),
    )  # fmt: skip
    return CodingTools([*_FileTools(host).tools(), *_SearchTools(host).tools(), *commands.tools()], binding)


class _Host:
    """What every family of tools shares: the session they work on, the
    host's say over each operation and path, and the limits."""

    def __init__(
        self,
        binding: ToolBinding,
        authorize: Callable,
        authorize_path: Callable | None,
        limits: CodingLimits,
    ) -> None:
        self.binding = binding
        self._authorize = authorize
        self._authorize_path = authorize_path
        self.limits = limits

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


def _compile(query: str, use_regex: bool):
    try:
        return regex.compile(query if use_regex else regex.escape(query))
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
        raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"bad regular expression: {exc}") from None


async def _within_search_time(limits: CodingLimits, function, *args):
    """Run a search (in a worker thread) against the search time budget."""
    deadline = files.Deadline.after(limits.search_seconds)
    try:
        return await function(*args, deadline)
    except files.SearchTimeout:
        raise ToolRefusal(
            ErrorCode.SANDBOX_LIMIT, f"the search took over {limits.search_seconds:g} s",
            "use a simpler expression or a narrower path",
        ) from None  # fmt: skip


class _ToolFamily:
    """Tools that belong together, over the host's say and limits."""

    def __init__(self, host: _Host) -> None:
        self.host = host
        self.limits = host.limits


class _FileTools(_ToolFamily):
    """read_file, write_file, edit_file."""

    def tools(self) -> list[Tool]:
        limits = self.limits
        max_bytes = _Param("integer", limits.max_read_bytes, minimum=1, maximum=limits.max_read_bytes)
        return [
            _tool("read_file", "Read a text file of the workspace, a slice at a time. Bytes that are not UTF-8 "
                  "are shown as U+FFFD; the result then has replaced_invalid_utf8: true and invalid_utf8_offsets "
                  f"(the file offsets of the first {INVALID_OFFSETS_SHOWN} such sequences).",
                  {"path": _Param("path"), "offset": _Param("integer", 0, minimum=0), "max_bytes": max_bytes},
                  limits, self.read_file),
            _tool("write_file", "Create a file (and its parent directories), or replace one with overwrite=true.",
                  {"path": _Param("path"), "content": _Param("text"), "overwrite": _Param("boolean", False)},
                  limits, self.write_file),
            _tool("edit_file", "Replace an exact snippet of a file (once, or every occurrence with replace_all).",
                  {"path": _Param("path"), "old_text": _Param("text"), "new_text": _Param("text"),
                   "replace_all": _Param("boolean", False),
                   "expected_sha256": _Param("text", None, "sha256 from read_file; refuse if the file changed"),
                   "dry_run": _Param("boolean", False)},
                  limits, self.edit_file),
        ]  # fmt: skip

    async def read_file(self, path: str, offset: int, max_bytes: int) -> dict:
        host = self.host
        await host.require_path(path)
        await host.authorize(ReadOperation(path, offset, max_bytes))
        result = await host.call_files(files.read_slice, path, offset, max_bytes, self.limits.max_hashed_file_bytes)
        reply = {
            "path": path,
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

    async def write_file(self, path: str, content: str, overwrite: bool) -> dict:
        host = self.host
        data = content.encode("utf-8")
        if path == WORKSPACE:
            raise ToolRefusal(ErrorCode.SANDBOX_PATH_REFUSED, "the workspace itself is not a file")
        if len(data) > self.limits.max_write_bytes:
            raise ToolRefusal(ErrorCode.SANDBOX_LIMIT, f"content is over {self.limits.max_write_bytes} bytes")
        await host.require_path(path)
        creates = tuple(await host.call_files(files.missing_directories, path))
        await host.authorize(WriteOperation(path, len(data), overwrite, creates))
        try:
            created = await host.call_files(files.write_atomically, path, data, overwrite, None, creates)
        except files.StaleError:
            raise ToolRefusal(
                EDIT_STALE, f"the directories above {path} changed while the write was authorized", "call again"
            ) from None
        return {"path": path, "bytes": len(data), "created_directories": created,
                "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip

    async def edit_file(
        self, path: str, old_text: str, new_text: str, replace_all: bool, expected_sha256: str | None, dry_run: bool
    ) -> dict:
        host, limit = self.host, self.limits.max_write_bytes
        if not old_text:
            raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, "old_text must not be empty")
        await host.require_path(path)
        # An edit reads the file, and its refusals (no match, ambiguous,
        # stale) tell about its content: the host must allow the read first.
        await host.authorize(ReadOperation(path, 0, limit))
        # One edit at a time per tools object, and a re-check of the base
        # just before the rename, so two edits from one base never both land.
        async with host.binding.edit_lock:
            base = await host.call_files(files.read_whole, path, limit)
            base_sha = hashlib.sha256(base).hexdigest()
            if expected_sha256 is not None and expected_sha256 != base_sha:
                raise ToolRefusal(EDIT_STALE, f"{path} changed since it was read", "read it again")
            try:
                text = base.decode("utf-8")
            except UnicodeDecodeError:
                raise ToolRefusal(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{path} is not UTF-8 text") from None
            count = text.count(old_text)
            if count == 0:
                raise ToolRefusal(EDIT_NO_MATCH, f"old_text does not occur in {path}", "read the file again")
            if count > 1 and not replace_all:
                raise ToolRefusal(
                    EDIT_AMBIGUOUS, f"old_text occurs {count} times in {path}",
                    "add surrounding lines to make it unique, or pass replace_all=true",
                )  # fmt: skip
            result = text.replace(old_text, new_text) if replace_all else text.replace(old_text, new_text, 1)
            data = result.encode("utf-8")
            if len(data) > limit:
                raise ToolRefusal(ErrorCode.SANDBOX_LIMIT, f"the result is over {limit} bytes")
            result_sha = hashlib.sha256(data).hexdigest()
            replacements = count if replace_all else 1
            await host.authorize(EditOperation(path, base_sha, result_sha, replacements, dry_run))
            if not dry_run:
                try:
                    await host.call_files(files.write_atomically, path, data, True, base_sha)
                except files.StaleError:
                    raise ToolRefusal(EDIT_STALE, f"{path} changed during the edit", "read it again") from None
        return {"path": path, "replacements": replacements, "dry_run": dry_run,
                "base_sha256": base_sha, "sha256": result_sha}  # fmt: skip


class _SearchTools(_ToolFamily):
    """list_directory, glob, search_files."""

    def tools(self) -> list[Tool]:
        limits = self.limits
        here = _Param("path", ".")
        return [
            _tool("list_directory", "List a workspace directory.", {"path": here}, limits, self.list_directory),
            _tool("glob", "Find workspace paths matching a glob (** spans directories).",
                  {"pattern": _Param("pattern"), "path": here}, limits, self.glob),
            _tool("search_files", "Search file contents (or paths) for a literal string or a regular expression.",
                  {"query": _Param("pattern"), "regex": _Param("boolean", False), "path": here,
                   "include": _Param("pattern", None, "glob of files to search"),
                   "search_paths": _Param("boolean", False),
                   "context_lines": _Param("integer", 0, minimum=0, maximum=10)},
                  limits, self.search_files),
        ]  # fmt: skip

    async def list_directory(self, path: str) -> dict:
        host = self.host
        await host.require_path(path)
        await host.authorize(ListOperation(path))
        entries = await host.call_files(files.list_directory, path)
        limit = self.limits.max_list_entries
        shown, denied = [], []
        for entry in entries[: limit + 1]:  # the host is asked about no more than can be shown
            if await host.path_allowed(entry.path):
                shown.append({"name": entry.path.rsplit("/", 1)[1], "kind": entry.kind, "size": entry.size})
            else:
                denied.append(entry.path.rsplit("/", 1)[1])
        truncated = len(entries) > limit
        return {"path": path, "entries": shown[:limit], "truncated": truncated, "denied": denied}

    async def _walk(self, guest_path: str) -> tuple[list[files.Entry], list[str]]:
        """Entries under a directory the host allows (denied ones listed
        apart), bounded by the search limits."""
        allowed_cache: dict[str, bool] = {}
        denied: list[str] = []
        # The walk runs in a worker thread; authorize_path (maybe async) is
        # asked afterwards, and a denied directory hides all beneath it.
        entries = await self.host.call_files(
            files.walk, guest_path, self.limits.max_search_depth, self.limits.max_search_files
        )
        kept = []
        for entry in entries:
            parent = entry.path.rsplit("/", 1)[0]
            if parent != guest_path and not allowed_cache.get(parent, True):
                allowed_cache[entry.path] = False
                continue
            ok = await self.host.path_allowed(entry.path)
            allowed_cache[entry.path] = ok
            if ok:
                kept.append(entry)
            else:
                denied.append(entry.path)
        return kept, denied

    async def glob(self, pattern: str, path: str) -> dict:
        await self.host.require_path(path)
        await self.host.authorize(GlobOperation(path, pattern))
        entries, denied = await self._walk(path)
        prefix = len(path) + 1
        matches = [e.path for e in entries if e.kind != "symlink" and files.glob_match(pattern, e.path[prefix:])]
        limit = self.limits.max_search_results
        return {"path": path, "matches": matches[:limit], "truncated": len(matches) > limit, "denied": denied}

    async def search_files(
        self, query: str, regex: bool, path: str, include: str | None, search_paths: bool, context_lines: int
    ) -> dict:
        host = self.host
        pattern = _compile(query, regex)
        await host.require_path(path)
        await host.authorize(SearchOperation(path, query, regex, include))
        entries, denied = await self._walk(path)
        prefix = len(path) + 1
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

            results = await _within_search_time(self.limits, by_path)
        else:

            async def by_content(deadline: float) -> list[dict]:
                found = await host.call_files(
                    files.search_contents, candidates, pattern, context_lines, limit, deadline,
                    self.limits.max_read_bytes,
                )  # fmt: skip
                return [vars(match) for match in found]

            results = await _within_search_time(self.limits, by_content)
        return {"path": path, "matches": results[:limit], "truncated": len(results) > limit, "denied": denied}


class _CommandTools(_ToolFamily):
    """run_command, and read_output and search_output over what a command
    printed beyond what its result showed."""

    def __init__(
        self,
        host: _Host,
        executables: dict[str, str],
        environment: dict[str, str],
        required: tuple[str, ...],
        artifacts: ArtifactStore,
    ) -> None:
        super().__init__(host)
        self.executables = executables
        self.environment = environment
        self.required = required
        self.artifacts = artifacts

    def tools(self) -> list[Tool]:
        limits = self.limits
        reference = _Param("text")
        return [
            _tool("run_command", f"Run a command in the sandbox. executable is one of: {', '.join(self.executables)}.",
                  {"executable": _Param("text", choices=tuple(self.executables)), "args": _Param("strings", []),
                   "cwd": _Param("path", ".")},
                  limits, self.run_command),
            _tool("read_output", "Page through the full output of an earlier run_command.",
                  {"reference": reference, "stream": _Param("text", "stdout", choices=("stdout", "stderr")),
                   "offset": _Param("integer", 0, minimum=0),
                   "max_bytes": _Param("integer", limits.max_read_bytes, minimum=1, maximum=limits.max_read_bytes)},
                  limits, self.read_output),
            _tool("search_output", "Search the full output of an earlier run_command.",
                  {"reference": reference, "query": _Param("pattern"), "regex": _Param("boolean", False)},
                  limits, self.search_output),
        ]  # fmt: skip

    async def run_command(self, executable: str, args: list[str], cwd: str) -> dict:
        host, limits = self.host, self.limits
        if len(args) > limits.max_args or sum(len(a.encode()) + 1 for a in args) > limits.max_args_bytes:
            raise ToolRefusal(
                ErrorCode.SANDBOX_LIMIT, f"at most {limits.max_args} args of {limits.max_args_bytes} bytes"
            )
        # The session's own checks (NUL, sizes) and its environment rule (PWD).
        argv, env, _, timeout = check_command(
            self.executables[executable], args, self.environment, cwd, limits.shell_timeout
        )
        binding = host.binding
        binding.check_live()
        policy_kind, generation = await binding.target.network_state()
        missing = missing_restrictions(self.required, binding.grade, policy_kind)
        if missing:
            raise ToolRefusal(INSUFFICIENT, f"the session no longer provides {', '.join(missing)}")
        await host.require_path(cwd)
        await host.authorize(ShellOperation(executable, tuple(args), cwd))
        # A stop or policy change while the host decided is a refusal
        # (nothing ran: execute checks both first); from there on, a stop
        # is one under the command.
        command = CapturedCommand(argv, env, cwd, timeout, limits.max_artifact_bytes, CANCEL_GRACE, generation)
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
        return {
            "exit_code": result.exit_code,
            "signal": result.signal,
            "outcome": outcome,
            "duration": round(result.duration, 3),
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

    async def read_output(self, reference: str, stream: str, offset: int, max_bytes: int) -> dict:
        artifact = self.artifacts.get(reference)
        await self.host.authorize(ArtifactOperation(reference, "artifact-read"))
        data = getattr(artifact, stream)
        window = data[offset : offset + files.utf8_window(max_bytes)]
        start, end = files.utf8_slice(window, max_bytes)
        next_offset = offset + end if offset + end < len(data) else None
        return {"reference": reference, "stream": stream, "offset": offset + start,
                "text": window[start:end].decode("utf-8", "replace"), "size": len(data),
                "next_offset": next_offset, "truncated": artifact.truncated}  # fmt: skip

    async def search_output(self, reference: str, query: str, regex: bool) -> dict:
        pattern = _compile(query, regex)
        artifact = self.artifacts.get(reference)
        await self.host.authorize(ArtifactOperation(reference, "artifact-search"))
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

        matches = await _within_search_time(self.limits, in_worker)
        return {"reference": reference, "matches": matches[:limit], "truncated": len(matches) > limit}
