"""Declarative sandbox specs: one file says what a sandbox is.

A spec is TOML, JSON, or the YAML front matter of a ``SANDBOX.md`` file::

    id = "py-agent"
    driver = "native"
    image = "images/python"         # optional: a digest (sha256:...), or an OCI layout or root filesystem to import
    [template]
    files = "template"              # a directory next to the spec, or a table of inline files
    [env]
    vars = { LANG = "C.UTF-8" }
    passthrough = ["GIT_AUTHOR_NAME"]  # host variables copied in when the sandbox is built
    auto_passthrough = true         # and those of the builder's credential_env the host has
    [network]
    egress = [{ origin = "https://api.example.com", headers = { authorization = { env = "API_TOKEN", prefix = "Bearer " } } }]
    [limits]
    timeout = 30
    processes = 512                 # rlimits, /tmp and workspace sizes, see sandboxns.Confinement
    tmp_size = 268435456
    workspace_size = 1073741824     # a template's sessions only
    [seccomp]
    allow = ["ptrace"]              # lift groups of the default filter; deny = [...] adds syscalls
    [install]
    pip = ["requests==2.32.3"]      # into the venv /workspace/.venv, when the sandbox is built
    npm = ["typescript@5"]          # npm install --global, its prefix /workspace/.npm-global
    [lifecycle]
    idle_timeout = 900
    destroy_on = ["idle"]           # delete, not stop, when: "close" (any close), "idle" (its idle timeout)
    retain_stopped = 86400          # a stopped session is deleted a day later

Loading never raises for what a file says: :meth:`SandboxSpec.validate`
lists every problem, each with the path of its field. Secrets never appear in
a spec: header values are references to host environment variables, resolved
when the sandbox is built and held only in memory from then on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import trio
import yaml

from ._backend import (
    DEFAULT_MAX_CONCURRENT_COMMANDS,
    MAX_CONCURRENT_COMMANDS_LIMIT,
    Backend,
    open_backend,
)
from ._confinement import Confinement, ResourceLimits, SeccompPolicy
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._handle import SessionHandle
from ._network import AllowedOrigin, NetworkPolicy, Origin, check_network_policy, header_name_problem, parse_origin
from ._registry import DRIVERS
from ._rootfs_images import check_digest
from ._routing import Refusal, route_request, route_tunnel
from ._session import (
    DEFAULT_ENV,
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_TIMEOUT,
    MAX_FILE_BYTES,
    MAX_FILE_BYTES_LIMIT,
    MAX_OUTPUT_BYTES_LIMIT,
    RunResult,
    Session,
)
from ._state import default_state_directory
from ._templates import check_template_files

SPEC_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)^---[ \t]*\r?$", re.DOTALL | re.MULTILINE)
_FIELDS = (
    "id",
    "description",
    "driver",
    "template",
    "workspace",
    "image",
    "env",
    "network",
    "limits",
    "seccomp",
    "install",
    "lifecycle",
)
_RESOURCE_LIMITS = tuple(field.name for field in fields(ResourceLimits))
# The Confinement fields a spec sets under [limits], in bytes.
_SIZES = ("tmp_size", "workspace_size")
_LIFECYCLE = ("idle_timeout", "destroy_on", "destroy_on_close", "retain_stopped")
# What lifecycle.destroy_on may list: "close" deletes the session whenever it
# is closed (destroy_on_close), "idle" only when its idle timeout closes it.
_DESTROY_EVENTS = ("close", "idle")
_INSTALL = ("pip", "npm", "pip_index_url", "npm_registry", "timeout")
# Per tool: at most this many packages, each at most this long, so that one
# tool's command line stays well inside a command's limit.
MAX_INSTALL_PACKAGES = 256
MAX_INSTALL_PACKAGE_LENGTH = 256
DEFAULT_INSTALL_TIMEOUT = 600.0
DEFAULT_PIP_INDEX_URL = "https://pypi.org/simple/"
DEFAULT_NPM_REGISTRY = "https://registry.npmjs.org/"
# Where installs go: in the workspace, so they last as long as the session.
# A venv that every command runs in (what an agent expects of .venv), and
# npm's global prefix where npm's docs put it for a user without root
# (~/.npm-global, HOME being the workspace), so a later "npm i -g" works too.
VENV = "/workspace/.venv"
NPM_PREFIX = "/workspace/.npm-global"
# What of each tool's output is kept, and how much of its end a failure's
# message quotes.
INSTALL_OUTPUT_BYTES = DEFAULT_MAX_OUTPUT_BYTES
_QUOTED_LINES = 15
_QUOTED_CHARACTERS = 2000
# Each tool runs as "sh -c SCRIPT TOOL SOURCE PACKAGE...". The venv has no
# pip of its own (ensurepip takes seconds) but sees the system's
# site-packages, so its python runs the system's pip, which installs into
# the venv, and sees what the system python does. A .venv already there
# (a bound project's) is used as it is, never recreated. Caches would fill
# the workspace (HOME): pip keeps none, npm's lives in the command's /tmp.
_PIP_SCRIPT = f"""index=$1; shift
[ -e {VENV} ] || python3 -m venv --system-site-packages --without-pip {VENV} || exit
[ -x {VENV}/bin/python ] || {{ echo "{VENV} has no bin/python that runs here" >&2; exit 1; }}
exec {VENV}/bin/python -m pip install --no-input --disable-pip-version-check --no-cache-dir --progress-bar off \
    --index-url "$index" -- "$@"
"""
_NPM_SCRIPT = f"""registry=$1; shift
exec npm install --global --prefix {NPM_PREFIX} --registry "$registry" --cache /tmp/npm-cache \
    --no-audit --no-fund --no-update-notifier --logs-max 0 -- "$@"
"""


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a spec: the field's path (``limits.timeout``,
    ``network.egress[0].origin``; empty for the document itself) and what
    is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(frozen=True)
class SpecLimits:
    """A spec's limits: each command's default deadline (seconds) and
    output cap, the per-call file I/O limit, and the backend's admission
    limit."""

    timeout: float
    max_output_bytes: int
    max_file_bytes: int
    max_concurrent_commands: int


_MAX_LIMITS = {
    "timeout": math.inf,
    "max_output_bytes": MAX_OUTPUT_BYTES_LIMIT,
    "max_file_bytes": MAX_FILE_BYTES_LIMIT,
    "max_concurrent_commands": MAX_CONCURRENT_COMMANDS_LIMIT,
}
_DEFAULT_LIMITS = {
    "timeout": DEFAULT_TIMEOUT,
    "max_output_bytes": DEFAULT_MAX_OUTPUT_BYTES,
    "max_file_bytes": MAX_FILE_BYTES,
    "max_concurrent_commands": DEFAULT_MAX_CONCURRENT_COMMANDS,
}


class _Checker:
    """Walks a parsed document, collecting problems instead of stopping at
    the first."""

    def __init__(self) -> None:
        self.problems: list[SpecProblem] = []

    def problem(self, field: str, message: str) -> None:
        self.problems.append(SpecProblem(field, message))

    def table(self, value: object, field: str, known: tuple[str, ...] | None) -> Mapping[str, Any]:
        """A table with the ``known`` fields (or, for None, any string
        keys); returns only its entries with string keys."""
        if not isinstance(value, Mapping):
            self.problem(field, f"must be a table, not {_kind(value)}")
            return {}
        checked = {}
        for key in value:
            if not isinstance(key, str):
                self.problem(field, f"has a key that is not a string: {_short(key)}")
            elif known is not None and key not in known:
                self.problem(_join(field, key), f"is not a known field (known: {', '.join(known)})")
            else:
                checked[key] = value[key]
        return checked

    def string(self, value: object, field: str) -> str | None:
        if not isinstance(value, str):
            self.problem(field, f"must be a string, not {_kind(value)}")
            return None
        if "\0" in value:
            self.problem(field, "must not contain NUL")
            return None
        return value

    def number(self, value: object, field: str, *, integer: bool, minimum: float, maximum: float) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            self.problem(field, f"must be {'an integer' if integer else 'a number'}, not {_kind(value)}")
            return None
        try:
            in_range = math.isfinite(value) and minimum <= value <= maximum
        except OverflowError:  # an integer too large for a float
            in_range = False
        if not in_range:
            self.problem(field, f"must be from {minimum:g} to {maximum:g}, not {_short(value)}")
            return None
        return value

    def boolean(self, value: object, field: str) -> bool | None:
        if not isinstance(value, bool):
            self.problem(field, f"must be true or false, not {_kind(value)}")
            return None
        return value


def _short(value: object) -> str:
    """A value as a message may quote it: a document can make its repr
    enormous (YAML aliases), so only its start."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list"}
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a table"
    return names.get(type(value), type(value).__name__)


def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


class SandboxSpec:
    """A sandbox described by a document. Build one with :meth:`load` (a
    file) or :meth:`from_dict`; check it with :meth:`validate`; start it
    with :meth:`build`."""

    def __init__(self, document: object, *, base: Path, source: str = "<dict>", load_problem: str = "") -> None:
        self._document = document
        self._base = base
        self._source = source
        self._load_problem = load_problem
        # Checked once, now: a spec is a value, and everything it says is
        # read from what this found.
        try:
            self._problems, self._resolved = self._examine()
        except OSError as exc:  # a directory it names cannot be looked at
            self._problems, self._resolved = [SpecProblem("", f"cannot check what the spec names: {exc}")], None

    def __reduce__(self):
        # What it was made from; the checked value is made again.
        return _spec_again, (self._document, self._base, self._source, self._load_problem)

    @property
    def document(self) -> object:
        """The document as given (parsed from its file); the spec was
        resolved from it when made, so changing it later changes nothing."""
        return self._document

    @property
    def base(self) -> Path:
        """Where the spec's relative template and workspace paths start."""
        return self._base

    @property
    def source(self) -> str:
        """The spec's file, or "<dict>"."""
        return self._source

    def __repr__(self) -> str:
        spec_id = self.document.get("id") if isinstance(self.document, Mapping) else None
        return f"SandboxSpec(id={spec_id!r}, source={self.source!r})"

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], *, base: str | os.PathLike[str] = ".") -> SandboxSpec:
        """A spec from an already parsed document; relative paths in it are
        relative to ``base``."""
        return cls(document, base=Path(base).absolute())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SandboxSpec:
        """Read a spec: ``.toml``, ``.json``, or a Markdown file (such as
        ``SANDBOX.md``) whose YAML front matter is the spec. Never raises
        for what the file says (see :meth:`validate`); a file that cannot be
        read is SANDBOX_NOT_FOUND."""
        if not isinstance(path, (str, os.PathLike)):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"path must be a path, not {path!r}")
        file = Path(path).absolute()
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"cannot read the spec {file}: {exc}") from None
        try:
            document, problem = _parse(data.decode("utf-8"), file.suffix.lower())
        except UnicodeDecodeError as exc:  # what the file says, so a problem like any other
            document, problem = None, f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})"
        return cls(document, base=file.parent, source=str(file), load_problem=problem)

    def validate(self) -> list[SpecProblem]:
        """Every problem with the spec (empty when it is valid), including
        what in a template directory is not a directory or regular file.
        (Building reads that directory once, refusing the same things,
        before it starts anything.)"""
        problems, resolved = list(self._problems), self._resolved
        if resolved is not None and isinstance(resolved.template, Path) and resolved.template.is_dir():
            problems += [SpecProblem("template.files", problem) for problem in _template_problems(resolved.template)]
        return problems

    def _examine(self) -> tuple[list[SpecProblem], _Resolved | None]:
        if self._load_problem:
            return [SpecProblem("", self._load_problem)], None
        if not isinstance(self.document, Mapping):
            return [SpecProblem("", f"a spec must be a table of fields, not {_kind(self.document)}")], None
        return _check(self.document, self.base)

    def _checked(self) -> _Resolved:
        if self._problems:
            listing = "; ".join(map(str, self._problems))
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"invalid sandbox spec {self.source}: {listing}")
        assert self._resolved is not None
        return self._resolved

    @property
    def id(self) -> str:
        return self._checked().id

    @property
    def driver(self) -> str:
        return self._checked().driver

    @property
    def limits(self) -> SpecLimits:
        return self._checked().limits

    @property
    def confinement(self) -> Confinement:
        """The rlimits, /tmp size and seccomp changes its sessions start with."""
        return self._checked().confinement

    def environment(
        self, host_env: Mapping[str, str] | None = None, *, credential_env: Sequence[str] = ()
    ) -> dict[str, str]:
        """The commands' environment: the defaults, ``env.vars``, and the
        ``env.passthrough`` variables' values taken from ``host_env``
        (default: this process's environment), with what makes the
        ``install`` packages found (the venv active, npm's global prefix on
        PATH and NODE_PATH). A passthrough variable the host does not have
        is SANDBOX_INVALID_ARGUMENT.

        ``credential_env`` names the variables that hold the caller's
        credentials (such as ``ANTHROPIC_API_KEY``). With
        ``env.auto_passthrough``, each of them the host has is passed
        through as well, unless ``env.vars`` sets it; one it lacks is
        skipped. Without it they are ignored."""
        return self._environment(host_env, credential_env, DEFAULT_ENV)

    def _environment(
        self, host_env: Mapping[str, str] | None, credential_env: Sequence[str], base: Mapping[str, str]
    ) -> dict[str, str]:
        """:meth:`environment` over ``base``: sandboxns's defaults, or a
        session's on an image (the image's Env)."""
        resolved = self._checked()
        credentials = _check_credential_env(credential_env)
        host = os.environ if host_env is None else host_env
        missing = [name for name in resolved.passthrough if name not in host]
        if missing:
            raise SandboxError(
                ErrorCode.SANDBOX_INVALID_ARGUMENT,
                f"env.passthrough names host variables that are not set: {', '.join(missing)}",
            )
        automatic = [name for name in credentials if name in host and name not in resolved.vars]
        passthrough = (*resolved.passthrough, *(automatic if resolved.auto_passthrough else ()))
        environment = {**base, **resolved.vars, **{name: host[name] for name in passthrough}}
        return {**environment, **_install_environment(resolved.install, environment)}

    def network_policy(self, host_env: Mapping[str, str] | None = None) -> NetworkPolicy:
        """``network.egress`` as a checked policy for :meth:`Backend.create`,
        with header references resolved from ``host_env`` (default: this
        process's environment)."""
        resolved = self._checked()
        if isinstance(resolved.egress, str):
            return check_network_policy(resolved.egress)
        host = os.environ if host_env is None else host_env
        missing = sorted({ref.env for entry in resolved.egress for ref in entry.headers.values()} - set(host))
        if missing:
            raise SandboxError(
                ErrorCode.SANDBOX_INVALID_ARGUMENT,
                f"network.egress header references host variables that are not set: {', '.join(missing)}",
            )
        # The origins and header names were checked with the spec; the
        # values come from the host now, and are checked as any policy's.
        return check_network_policy(
            {
                "allow": [
                    {
                        "origin": entry.origin,
                        "headers": {name: ref.prefix + host[ref.env] for name, ref in entry.headers.items()},
                    }
                    for entry in resolved.egress
                ]
            }
        )

    def template_files(self) -> dict[str, bytes] | None:
        """The template's files (None when the spec binds a workspace)."""
        resolved = self._checked()
        if resolved.workspace is not None:
            return None
        if isinstance(resolved.template, Path):
            return _read_directory(resolved.template)
        return {path: text.encode("utf-8") for path, text in resolved.template.items()}

    def build(
        self,
        *,
        state_directory: str | os.PathLike[str] | None = None,
        host_env: Mapping[str, str] | None = None,
        credential_env: Sequence[str] = (),
        nursery: trio.Nursery | None = None,
        **backend_options: Any,
    ) -> _Building:
        """Start the sandbox: a backend over ``state_directory`` (default:
        the user's state directory) and one session in it, configured from
        the spec, with the environment :meth:`environment` gives for
        ``host_env`` and ``credential_env``. Nothing starts for an invalid
        spec.

        Use ``async with spec.build() as sandbox:`` (the backend lives in
        the block), or ``sandbox = await spec.build(nursery=nursery)`` and
        later ``await sandbox.aclose()``: the backend then lives in
        ``nursery``, and is shut down should that nursery be cancelled
        first. An awaited build without a nursery keeps its backend in a
        trio system task (an awaited call returns, so nothing of the
        caller's can hold it) until :meth:`SpecSandbox.aclose` or the end of
        ``trio.run``.

        The ``install`` packages are installed in the new session before it
        is handed out, through its network policy; the sandbox's
        :attr:`~SpecSandbox.installs` keep each tool's output. A tool that
        fails is SANDBOX_UNAVAILABLE naming the packages and quoting its
        last lines, and the session is deleted (a host directory it was
        bound to keeps what the tool wrote there)."""
        if nursery is not None and not isinstance(nursery, trio.Nursery):
            raise invalid_argument(f"nursery must be a trio.Nursery or None, not {nursery!r}")
        return _Building(self, state_directory, host_env, credential_env, nursery, backend_options)

    async def create_session(
        self, backend: Backend, *, host_env: Mapping[str, str] | None = None, credential_env: Sequence[str] = ()
    ) -> SessionHandle:
        """A session of this spec in an already open ``backend`` (whose
        driver must be the spec's), its ``install`` packages installed (see
        :meth:`build`)."""
        resolved = self._checked()
        if backend.name != resolved.driver:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"the spec wants driver {resolved.driver!r}, the backend is {backend.name!r}",
            )
        self.environment(host_env, credential_env=credential_env)  # fails before anything starts
        network = self.network_policy(host_env)
        files = await trio.to_thread.run_sync(self.template_files)
        handle, _ = await self._create_session(backend, resolved, files, network, host_env, credential_env)
        return handle

    async def _create_session(
        self,
        backend: Backend,
        resolved: _Resolved,
        files: dict[str, bytes] | None,
        network: NetworkPolicy,
        host_env: Mapping[str, str] | None,
        credential_env: Sequence[str],
    ) -> tuple[SessionHandle, tuple[InstallResult, ...]]:
        """A new session of the spec, configured, its packages installed."""
        image = resolved.image
        if isinstance(image, Path):
            image = (await backend.import_image(image)).digest
        lifecycle = {
            "idle_timeout": resolved.idle_timeout,
            "destroy_on_close": resolved.destroy_on_close,
            "destroy_on_idle": resolved.destroy_on_idle,
            "retention": resolved.retain_stopped,
            "confinement": resolved.confinement,
        }
        if resolved.workspace is not None:
            handle = await backend.create(workspace=resolved.workspace, network=network, image=image, **lifecycle)
        else:
            template = await backend.prewarm(template=resolved.id, files=files or {}, image=image)
            handle = await backend.create(template=template.template_key, network=network, **lifecycle)
        try:
            # Over the session's own defaults: an image's Env, if it runs on one.
            environment = self._environment(host_env, credential_env, handle.session.environment)
            _configure(handle.session, resolved.limits, environment)
            installs = await _install(handle.session, resolved.install)
        except BaseException:
            # Nobody has seen it yet, so nothing half-installed is kept; the
            # delete is shielded from a cancellation that ends the build.
            with trio.CancelScope(shield=True):
                await handle.delete()
            raise
        return handle, installs

    def configure_session(
        self, session: Session, *, host_env: Mapping[str, str] | None = None, credential_env: Sequence[str] = ()
    ) -> None:
        """Give ``session`` the spec's command environment and limits: for
        a session of this spec resumed elsewhere (``sandboxns exec --spec``).
        Nothing is installed: the session has its packages from its build.
        The environment is over the session's defaults (an image's Env, for
        a session on one), so call this before anything else configures it."""
        environment = self._environment(host_env, credential_env, session.environment)
        _configure(session, self._checked().limits, environment)


def _check_credential_env(names: object) -> tuple[str, ...]:
    """The names a builder gave as ``credential_env``; a lone string is
    refused rather than read as its letters."""
    if (
        isinstance(names, (str, bytes))
        or not isinstance(names, Sequence)
        or not all(isinstance(name, str) and ENV_NAME.fullmatch(name) for name in names)
    ):
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT,
            f"credential_env must be a list or tuple of environment variable names, not {_short(names)}",
        )
    return tuple(names)


def _configure(session: Session, limits: SpecLimits, environment: Mapping[str, str]) -> None:
    session.configure(
        environment=environment,
        timeout=limits.timeout,
        max_output_bytes=limits.max_output_bytes,
        max_file_bytes=limits.max_file_bytes,
    )


async def _install(session: Session, install: _Install) -> tuple[InstallResult, ...]:
    """Run each tool that has packages to install in ``session``, with the
    session's environment (so through its proxy); one that fails is
    SANDBOX_UNAVAILABLE."""
    results = []
    for tool, script, source, packages in (
        ("pip", _PIP_SCRIPT, install.pip_index_url, install.pip),
        ("npm", _NPM_SCRIPT, install.npm_registry, install.npm),
    ):
        if not packages:
            continue
        # The packages are the script's arguments, never read by the shell.
        result = await session.run(
            "sh",
            ["-c", script, tool, source, *packages],
            timeout=install.timeout,
            max_output_bytes=INSTALL_OUTPUT_BYTES,
        )
        results.append(InstallResult(tool, packages, result))
        if result.exit_code != 0:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, _install_failure(results[-1], install.timeout))
    return tuple(results)


def _install_failure(install: InstallResult, timeout: float) -> str:
    result = install.result
    if result.timed_out:
        how = f"timed out after {timeout:g} s"
    elif result.signal is not None:
        how = f"was killed by signal {result.signal}"
    else:
        how = f"exited with status {result.exit_code}"
    # The tools say what went wrong on stderr; stdout has their progress.
    lines = (result.stderr.strip() or result.stdout.strip()).splitlines()[-_QUOTED_LINES:]
    said = "\n".join(lines)[-_QUOTED_CHARACTERS:] if lines else "(it printed nothing)"
    return f"installing {', '.join(install.packages)} with {install.tool} failed: {install.tool} {how}:\n{said}"


def _install_environment(install: _Install, environment: Mapping[str, str]) -> dict[str, str]:
    """What makes the installed packages found by every command: the venv
    active (first on PATH, VIRTUAL_ENV), npm's global prefix on PATH and
    NODE_PATH (for require) and named as its prefix (for a later npm i -g)."""
    paths, added = [], {}
    if install.pip:
        paths.append(f"{VENV}/bin")
        added["VIRTUAL_ENV"] = VENV
    if install.npm:
        paths.append(f"{NPM_PREFIX}/bin")
        added["NODE_PATH"] = _search_path(f"{NPM_PREFIX}/lib/node_modules", environment.get("NODE_PATH", ""))
        added["npm_config_prefix"] = NPM_PREFIX
    if paths:
        added["PATH"] = _search_path(*paths, environment.get("PATH", ""))
    return added


def _search_path(*entries: str) -> str:
    # An empty entry would mean the working directory.
    return ":".join(entry for entry in entries if entry)


@dataclass(frozen=True)
class InstallResult:
    """One tool's install when a spec sandbox was built: the tool (``pip``
    or ``npm``), the packages it was given, and how its command ended, with
    its output (at most 1 MiB, see :class:`~sandboxns.RunResult`)."""

    tool: str
    packages: tuple[str, ...]
    result: RunResult


@dataclass(frozen=True)
class _HeaderReference:
    env: str
    prefix: str


@dataclass(frozen=True)
class _Egress:
    origin: str
    headers: Mapping[str, _HeaderReference]


@dataclass(frozen=True)
class _Install:
    pip: tuple[str, ...]
    npm: tuple[str, ...]
    pip_index_url: str
    npm_registry: str
    timeout: float


@dataclass(frozen=True)
class _Resolved:
    """A valid spec's values, defaults filled in; nothing in it changes."""

    id: str
    driver: str
    template: Path | Mapping[str, str]
    workspace: Path | None
    image: str | Path | None  # a digest, or what to import
    vars: Mapping[str, str]
    passthrough: tuple[str, ...]
    auto_passthrough: bool
    egress: str | tuple[_Egress, ...]
    limits: SpecLimits
    confinement: Confinement
    install: _Install
    idle_timeout: float | None
    destroy_on_close: bool
    destroy_on_idle: bool
    retain_stopped: float | None


def _parse(text: str, suffix: str) -> tuple[object, str]:
    """The document in ``text`` and, if it could not be parsed, why."""
    try:
        if suffix == ".toml":
            return tomllib.loads(text), ""
        if suffix == ".json":
            return json.loads(text), ""
        if suffix in (".md", ".markdown"):
            match = _FRONT_MATTER.match(text)
            if match is None:
                return None, "the file has no YAML front matter (a first line '---' and a closing '---')"
            return yaml.safe_load(match.group(1)), ""
    except (ValueError, yaml.YAMLError) as exc:  # TOML's and JSON's errors are ValueErrors
        return None, f"cannot parse the spec: {_short(str(exc))[1:-1]}"
    except (TypeError, KeyError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors fail this way on tags like "!!bool maybe".
        return None, f"cannot parse the spec: {type(exc).__name__}: {_short(str(exc))[1:-1]}"
    return None, f"unknown spec format {suffix or '(no suffix)'!r}; use .toml, .json or a SANDBOX.md file"


def _check(document: object, base: Path) -> tuple[list[SpecProblem], _Resolved]:
    c = _Checker()
    top = c.table(document, "", _FIELDS)
    spec_id = c.string(top.get("id"), "id") if "id" in top else c.problem("id", "is required")
    if spec_id is not None and not SPEC_ID.fullmatch(spec_id):
        c.problem(
            "id", f"must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, not {spec_id!r}"
        )
    if "description" in top:
        c.string(top["description"], "description")
    driver = top.get("driver", "native")
    if not isinstance(driver, str) or driver not in DRIVERS:
        c.problem("driver", f"must be one of {', '.join(DRIVERS)}, not {_short(driver)}")
        driver = "native"

    template: Path | dict[str, str] = {}
    workspace = None
    if "template" in top and "workspace" in top:
        c.problem("workspace", "give either template or workspace, not both")
    if "template" in top:
        files = c.table(top["template"], "template", ("files",)).get("files", {})
        if isinstance(files, str):
            if c.string(files, "template.files") is not None:
                template = (base / files).resolve()
                if not template.is_dir():
                    c.problem("template.files", f"directory {template} does not exist")
        elif isinstance(files, Mapping):
            template = {}
            for path, content in c.table(files, "template.files", None).items():
                field = f"template.files[{json.dumps(path)}]"
                if c.string(content, field) is None:
                    continue
                try:  # the same rules as Backend.prewarm: inside the workspace...
                    check_template_files("spec", {path: b""})
                except SandboxError as exc:
                    c.problem(field, exc.message)
                else:
                    template[path] = content
            try:  # ...and no clashes between them
                check_template_files("spec", dict.fromkeys(template, b""))
            except SandboxError as exc:
                c.problem("template.files", exc.message)
        else:
            c.problem("template.files", f"must be a directory path or a table of files, not {_kind(files)}")
    if "workspace" in top and (path := c.string(top["workspace"], "workspace")) is not None:
        workspace = (base / path).resolve()
        if not workspace.is_dir():
            c.problem("workspace", f"directory {workspace} does not exist")

    image: str | Path | None = None
    if "image" in top and (text := c.string(top["image"], "image")) is not None:
        if text.startswith("sha256:"):
            try:
                image = check_digest(text)
            except SandboxError as exc:
                c.problem("image", exc.message)
        elif not (image := (base / text).resolve()).exists():
            c.problem("image", f"{image} does not exist (give an image digest, or an OCI layout or root filesystem)")

    env = c.table(top.get("env", {}), "env", ("vars", "passthrough", "auto_passthrough"))
    variables: dict[str, str] = {}
    for name, value in c.table(env.get("vars", {}), "env.vars", None).items():
        field = f"env.vars.{name}"
        if not ENV_NAME.fullmatch(name):
            c.problem(field, "is not a valid environment variable name")
        elif (text := c.string(value, field)) is not None:
            variables[name] = text
    passthrough = env.get("passthrough", [])
    if not isinstance(passthrough, list):
        c.problem("env.passthrough", f"must be a list of variable names, not {_kind(passthrough)}")
        passthrough = []
    for index, name in enumerate(passthrough):
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            c.problem(f"env.passthrough[{index}]", f"is not a valid environment variable name: {_short(name)}")
        elif name in variables:
            c.problem(f"env.passthrough[{index}]", f"{name} is also set in env.vars")

    auto_passthrough = c.boolean(env.get("auto_passthrough", False), "env.auto_passthrough") or False

    egress = _check_egress(c, c.table(top.get("network", {}), "network", ("egress",)).get("egress", "deny-all"))

    limits_table = c.table(top.get("limits", {}), "limits", (*_DEFAULT_LIMITS, *_RESOURCE_LIMITS, *_SIZES))
    limits = {}
    for name, default in _DEFAULT_LIMITS.items():
        value = limits_table.get(name, default)
        integer = name != "timeout"
        checked = c.number(
            value, f"limits.{name}", integer=integer, minimum=1 if integer else 0.001, maximum=_MAX_LIMITS[name]
        )
        limits[name] = default if checked is None else checked
    confinement = _check_confinement(c, limits_table, c.table(top.get("seccomp", {}), "seccomp", ("allow", "deny")))
    if workspace is not None and confinement.workspace_size is not None:
        c.problem("limits.workspace_size", "a host directory (workspace) cannot be capped, only a template's sessions")

    lifecycle = c.table(top.get("lifecycle", {}), "lifecycle", _LIFECYCLE)
    idle_timeout, retain_stopped = (
        c.number(lifecycle[name], f"lifecycle.{name}", integer=False, minimum=0.001, maximum=math.inf)
        if name in lifecycle
        else None
        for name in ("idle_timeout", "retain_stopped")
    )
    destroy_on_close, destroy_on_idle = _check_destroy(c, lifecycle)

    install = _check_install(c, c.table(top.get("install", {}), "install", _INSTALL), egress)

    resolved = _Resolved(
        id=spec_id or "",
        driver=driver,
        template=template if isinstance(template, Path) else MappingProxyType(template),
        workspace=workspace,
        image=image,
        vars=MappingProxyType(variables),
        passthrough=tuple(name for name in passthrough if isinstance(name, str)),
        auto_passthrough=auto_passthrough,
        egress=egress,
        limits=SpecLimits(**limits),
        confinement=confinement,
        install=install,
        idle_timeout=idle_timeout,
        destroy_on_close=destroy_on_close,
        destroy_on_idle=destroy_on_idle,
        retain_stopped=retain_stopped,
    )
    return c.problems, resolved


def _check_install(c: _Checker, install: Mapping[str, Any], egress: str | tuple[_Egress, ...]) -> _Install:
    """Each tool's packages and where it fetches them, which
    ``network.egress`` must let it reach."""
    packages, sources = {}, {}
    for tool, name, default in (
        ("pip", "pip_index_url", DEFAULT_PIP_INDEX_URL),
        ("npm", "npm_registry", DEFAULT_NPM_REGISTRY),
    ):
        packages[tool] = _check_packages(c, install.get(tool, []), f"install.{tool}")
        source = _check_source(c, install[name], f"install.{name}") if name in install else default
        if packages[tool] and source is not None and (problem := _egress_problem(egress, source, tool)) is not None:
            c.problem(f"install.{name}" if name in install else f"install.{tool}", problem)
        sources[tool] = source or default
    timeout = (
        c.number(install["timeout"], "install.timeout", integer=False, minimum=0.001, maximum=math.inf)
        if "timeout" in install
        else None
    )
    return _Install(
        pip=packages["pip"],
        npm=packages["npm"],
        pip_index_url=sources["pip"],
        npm_registry=sources["npm"],
        timeout=timeout or DEFAULT_INSTALL_TIMEOUT,
    )


def _check_packages(c: _Checker, listed: object, field: str) -> tuple[str, ...]:
    """Package specifications for a tool's command line: each one argument
    that cannot be read as an option."""
    if not isinstance(listed, list):
        c.problem(field, f"must be a list of package specifications, not {_short(listed)}")
        return ()
    if len(listed) > MAX_INSTALL_PACKAGES:
        c.problem(field, f"lists {len(listed)} packages; at most {MAX_INSTALL_PACKAGES}")
        return ()
    packages = []
    for index, package in enumerate(listed):
        where = f"{field}[{index}]"
        if (text := c.string(package, where)) is None:
            continue
        if not text:
            c.problem(where, "must not be empty")
        elif len(text) > MAX_INSTALL_PACKAGE_LENGTH:
            c.problem(where, f"is {len(text)} characters long; at most {MAX_INSTALL_PACKAGE_LENGTH}")
        elif _spaced(text):
            c.problem(where, f"must be one package specification, without white space or control characters: {text!r}")
        elif text.startswith("-"):
            c.problem(where, f"must not start with '-': {text!r} would be read as an option")
        else:
            packages.append(text)
    return tuple(packages)


def _spaced(text: str) -> bool:
    """Whether ``text`` would not be one clean word on a command line."""
    return any(character.isspace() or not character.isprintable() for character in text)


def _check_source(c: _Checker, value: object, field: str) -> str | None:
    """An index or registry URL: http(s), one host, and no credentials."""
    if (url := c.string(value, field)) is None:
        return None
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        c.problem(field, f"is not a URL: {exc}")
        return None
    if "@" in parts.netloc:  # not quoted: it would be a credential
        c.problem(field, "must not hold user information; a spec never holds a credential")
        return None
    if _spaced(url):
        c.problem(field, f"must not contain white space or control characters: {_short(url)}")
        return None
    try:
        origin = _origin_of(url)
    except SandboxError as exc:
        c.problem(field, exc.message)
        return None
    if origin.is_pattern:
        c.problem(field, f"must name one host, not the pattern {origin.host}")
        return None
    return url


def _origin_of(url: str) -> Origin:
    parts = urlsplit(url)
    return parse_origin(f"{parts.scheme}://{parts.netloc}", "its origin")


def _egress_problem(egress: str | tuple[_Egress, ...], source: str, tool: str) -> str | None:
    """Why ``tool`` cannot reach ``source`` under ``egress``, or None if it
    can: judged as the proxy judges it (an https URL is a CONNECT tunnel,
    intercepted when its origin gets headers; an http one a plain request),
    with no header values."""
    if egress in ("internet", "allow-all"):
        return None
    origin = _origin_of(source)
    blocked = f"{tool} fetches from {origin}, which network.egress"
    if egress == "deny-all":
        return f"{blocked} ('deny-all') does not allow; allow it there"
    policy = NetworkPolicy(
        "allow",
        tuple(
            AllowedOrigin(parse_origin(entry.origin), tuple(dict.fromkeys(entry.headers, "").items()))
            for entry in egress
        ),
    )
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    try:
        if origin.scheme == "https":
            route_tunnel(policy, f"{host}:{origin.port}")
        else:
            route_request(policy, origin.host_header, f"{origin}/")
    except Refusal:
        return f"{blocked} does not allow; allow it there"
    return None


def _check_destroy(c: _Checker, lifecycle: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether closing deletes the session, and whether its idle timeout
    does: ``destroy_on``, or the older ``destroy_on_close`` (both may be
    given if they agree)."""
    events = []
    listed = lifecycle.get("destroy_on", [])
    if not isinstance(listed, list):
        c.problem("lifecycle.destroy_on", f"must be a list drawn from 'close' and 'idle', not {_short(listed)}")
        listed = []
    for index, event in enumerate(listed):
        if event not in _DESTROY_EVENTS:
            c.problem(f"lifecycle.destroy_on[{index}]", f"must be 'close' or 'idle', not {_short(event)}")
        elif event in events:
            c.problem(f"lifecycle.destroy_on[{index}]", f"{event!r} is listed twice")
        else:
            events.append(event)
    if "idle" in events and "idle_timeout" not in lifecycle:
        c.problem("lifecycle.destroy_on", "'idle' needs a lifecycle.idle_timeout")
    close = "close" in events
    if "destroy_on_close" in lifecycle:
        flag = c.boolean(lifecycle["destroy_on_close"], "lifecycle.destroy_on_close")
        # Compared only with a destroy_on that is all valid, or the one
        # mistake would be reported twice.
        if flag is not None and "destroy_on" in lifecycle and len(events) == len(listed) and flag != close:
            c.problem(
                "lifecycle.destroy_on_close",
                f"is {str(flag).lower()} but lifecycle.destroy_on {'lists' if close else 'does not list'} 'close';"
                " give one of them",
            )
        close = close if flag is None else flag
    return close, "idle" in events


def _check_confinement(c: _Checker, limits: Mapping[str, Any], seccomp: Mapping[str, Any]) -> Confinement:
    """The rlimits, /tmp and workspace sizes and seccomp changes of
    ``limits`` and ``seccomp``; each problem is reported under its own
    field, once."""

    def accepted(field: str, make: Callable[..., object], **options: Any) -> bool:
        try:
            make(**options)
        except SandboxError as exc:
            c.problem(field, exc.message)
            return False
        return True

    options: dict[str, Any] = {}
    for name in (*_RESOURCE_LIMITS, *_SIZES):
        if name in limits:
            field = f"limits.{name}"
            value = c.number(limits[name], field, integer=True, minimum=1, maximum=2**63 - 1)
            make = Confinement if name in _SIZES else ResourceLimits
            if value is not None and accepted(field, make, **{name: value}):
                options[name] = value
    names = {}
    for key in ("allow", "deny"):
        value = seccomp.get(key, [])
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            c.problem(f"seccomp.{key}", f"must be a list of names, not {_short(value)}")
        elif accepted(f"seccomp.{key}", SeccompPolicy, **{key: value}):
            names[key] = value
    sizes = {name: options.pop(name) for name in _SIZES if name in options}
    return Confinement(limits=ResourceLimits(**options), seccomp=SeccompPolicy(**names), **sizes)


def _check_egress(c: _Checker, egress: object) -> str | tuple[_Egress, ...]:
    if egress in ("deny-all", "internet", "allow-all"):
        return egress
    if not isinstance(egress, list):
        c.problem(
            "network.egress",
            f"must be 'deny-all', 'internet', 'allow-all' or a list of allowed origins, not {_short(egress)}",
        )
        return "deny-all"
    entries = []
    seen = set()
    for index, entry in enumerate(egress):
        field = f"network.egress[{index}]"
        table = c.table(entry, field, ("origin", "headers"))
        origin = None
        if "origin" not in table:
            c.problem(f"{field}.origin", "is required")
        else:
            try:
                origin = str(parse_origin(table["origin"], "the origin"))
            except SandboxError as exc:
                c.problem(f"{field}.origin", exc.message)
            if origin is not None and origin in seen:
                c.problem(f"{field}.origin", f"{origin} is listed twice")
            seen.add(origin)
        headers = {}
        for name, reference in c.table(table.get("headers", {}), f"{field}.headers", None).items():
            where = f"{field}.headers.{name}"
            if (problem := header_name_problem(name)) is not None:
                c.problem(where, problem)
            elif name.lower() in headers:
                c.problem(where, f"{name} is given twice (header names are case-insensitive)")
            if not isinstance(reference, Mapping):
                c.problem(
                    where,
                    'must be a reference to a host variable like {env = "API_TOKEN", prefix = "Bearer "}; '
                    "a spec never holds a credential itself",
                )
                continue
            ref = c.table(reference, where, ("env", "prefix"))
            env_name = (
                c.string(ref.get("env"), f"{where}.env") if "env" in ref else c.problem(f"{where}.env", "is required")
            )
            prefix = c.string(ref.get("prefix", ""), f"{where}.prefix")
            if env_name is not None and not ENV_NAME.fullmatch(env_name):
                c.problem(f"{where}.env", f"is not a valid environment variable name: {env_name!r}")
            elif env_name is not None and prefix is not None:
                headers[name.lower()] = _HeaderReference(env_name, prefix)
        if origin is not None:
            entries.append(_Egress(origin, MappingProxyType(headers)))
    return tuple(entries)


def _template_problems(root: Path) -> list[str]:
    """What in a template directory is not a directory or regular file."""
    problems = []
    for directory, subdirectories, names in os.walk(root):
        for name in [*names, *subdirectories]:
            path = Path(directory, name)
            if path.is_symlink():
                problems.append(f"{path} is a symlink; a template holds regular files")
            elif name in names and not path.is_file():
                problems.append(f"{path} is not a regular file")
    return problems


def _read_directory(root: Path) -> dict[str, bytes]:
    """A template directory's regular files, by relative path; checked
    here, as the directory may have changed since validation."""
    problems = _template_problems(root)
    if problems:
        raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"template file {problems[0]}")
    return {
        str(path.relative_to(root)): path.read_bytes()
        for directory, _, names in os.walk(root)
        for path in (Path(directory, name) for name in names)
    }


def _spec_again(document: object, base: Path, source: str, load_problem: str) -> SandboxSpec:
    return SandboxSpec(document, base=base, source=source, load_problem=load_problem)


class SpecSandbox:
    """A running sandbox built from a spec: its backend, its session handle,
    and the spec's command environment and limits already applied to
    :attr:`session`. Closing it stops the session (keeping its files,
    resumable) or deletes it when the spec's lifecycle destroys it on close."""

    def __init__(
        self, spec: SandboxSpec, backend: Backend, handle: SessionHandle, installs: tuple[InstallResult, ...]
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.handle = handle
        self.installs = installs  # each tool's install when it was built, in order
        self._close: Callable[[], Awaitable[None]] = handle.aclose

    @property
    def session(self) -> Session:
        return self.handle.session

    async def aclose(self) -> None:
        await self._close()


class _Building:
    """What :meth:`SandboxSpec.build` returns: use it once, as an async
    context manager or by awaiting it."""

    def __init__(self, spec: SandboxSpec, state_directory, host_env, credential_env, nursery, backend_options) -> None:
        self._spec = spec
        self._state_directory = state_directory
        self._host_env = host_env
        self._credential_env = credential_env
        self._nursery = nursery
        self._backend_options = backend_options
        self._used = False
        self._context: contextlib.AbstractAsyncContextManager[SpecSandbox] | None = None

    def _claim(self) -> None:
        if self._used:
            raise SandboxError(
                ErrorCode.SANDBOX_INVALID_ARGUMENT, "this build() was used already; call spec.build() for another"
            )
        self._used = True

    @contextlib.asynccontextmanager
    async def _opened(self) -> AsyncIterator[SpecSandbox]:
        spec = self._spec
        resolved = spec._checked()
        # Resolve host variables and read the template before anything starts.
        spec.environment(self._host_env, credential_env=self._credential_env)
        network = spec.network_policy(self._host_env)
        files = await trio.to_thread.run_sync(spec.template_files)
        async with open_backend(
            driver=resolved.driver,
            state_directory=self._state_directory or default_state_directory(),
            max_concurrent_commands=resolved.limits.max_concurrent_commands,
            **self._backend_options,
        ) as backend:
            handle, installs = await spec._create_session(
                backend, resolved, files, network, self._host_env, self._credential_env
            )
            try:
                yield SpecSandbox(spec, backend, handle, installs)
            finally:
                await handle.aclose()

    async def __aenter__(self) -> SpecSandbox:
        if self._nursery is not None:
            raise invalid_argument(
                "nursery= is for 'await spec.build(...)'; 'async with' keeps the backend in its block"
            )
        self._claim()
        self._context = self._opened()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc_info: object) -> bool | None:
        assert self._context is not None
        return await self._context.__aexit__(*exc_info)

    def __await__(self):
        self._claim()
        return self._detached().__await__()

    async def _detached(self) -> SpecSandbox:
        """The awaited form. The backend's own nursery cannot be opened in
        the caller's task and left open when this returns (the caller's
        cancel scopes would then nest wrongly around it), so it lives in a
        task of the caller's nursery, or else a trio system task, until
        :meth:`SpecSandbox.aclose`."""
        ready, release, done = trio.Event(), trio.Event(), trio.Event()
        outcome: dict[str, Any] = {}

        async def keep() -> None:
            try:
                async with self._opened() as sandbox:
                    outcome["sandbox"] = sandbox
                    ready.set()
                    await release.wait()
            except Exception as exc:  # noqa: BLE001 - handed to whoever awaits build() or aclose()
                outcome["error"] = exc
            finally:
                ready.set()
                done.set()

        async def close() -> None:
            release.set()
            with trio.CancelScope(shield=True):
                await done.wait()
            if "error" in outcome:
                raise outcome.pop("error")

        if self._nursery is None:
            trio.lowlevel.spawn_system_task(keep)
        else:
            try:
                self._nursery.start_soon(keep)
            except RuntimeError:  # trio's word for a nursery that has ended
                raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the nursery given to build() has ended") from None
        try:
            await ready.wait()
        except BaseException:
            await close()
            raise
        if "error" in outcome:
            raise outcome.pop("error")
        if "sandbox" not in outcome:  # the given nursery was cancelled while it started
            raise SandboxError(
                ErrorCode.SANDBOX_STOPPED, "the nursery given to build() was cancelled before the sandbox started"
            )
        sandbox = outcome["sandbox"]
        sandbox._close = close
        return sandbox
