"""Sandboxes in the structural shape orchestrators of agent harnesses use.

An orchestrator that runs a harness (an agent CLI) per task needs five
things from a sandbox, and accepts any object that has them:

- ``await workspace(id) -> {"cwd": ...}``: the task's workspace, made on
  first use (idempotent). ``cwd`` is where the harness runs, as the sandbox
  sees it; ``host_path`` is the same directory on the host.
- ``wrap(cmd, *, cwd=None, env=None, id) -> argv``: a command line that runs
  ``cmd`` inside the task's sandbox (``sandboxns exec``). Only the *names*
  of ``env`` appear in it: spawn it with those variables in its
  environment, so no value shows in a process list.
- ``endpoint_for(port) -> str``: how a process in the sandbox reaches a
  host port (only where the network policy lets it).
- ``await stop(id)``: best effort: kill whatever runs in the task's sandbox.
- ``await cleanup(id, force=False) -> {"removed", "dirty", "detail"}``: the
  terminal teardown; idempotent.

:func:`namespace_sandbox` gives each task a fresh directory;
:func:`image_sandbox` does too, its sandbox running on a root filesystem
image (what a container runtime would run the harness in, with no daemon);
:func:`worktree_sandbox` gives each task a working tree of a git repository
on its own branch, in which git works inside the sandbox.

How the worktree kind keeps the host safe. Whatever a guest can write, the
host must never run git *on*: git executes what a repository's config says
(``core.fsmonitor``, hooks, a ``commondir`` file that swaps in another
config, a nested repository's config reached through a submodule), so a
guest that could write any of it into a place where the host later runs
git would run code on the host. So each task gets its own git directory,
separate from the repository's: its objects come from the repository's
object store, bound read-only, through an ``alternates`` file; commits go
to the task's own store and refs. The host runs git only in the repository
itself and never into submodules: the task's commits come back as a bundle
(made by git inside the sandbox) whose objects ``git index-pack --strict``
checks before the task's branch moves, and "is the worktree dirty?" is
asked of git inside the sandbox. A task can read every object of the
repository (every branch), and write only its own branch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import trio

from ._backend import open_backend
from ._driver import Mount
from ._errors import ErrorCode, SandboxError
from ._handle import SessionHandle
from ._layers import remove_tree
from ._lease import clear_lease, lease_status
from ._network import check_network_policy
from ._paths import WORKSPACE, normalize_path
from ._rootfs_images import check_digest
from ._session import RunResult, check_seconds
from ._state import stored_session_state

__all__ = [
    "ImageSandbox",
    "NamespaceSandbox",
    "WorktreeSandbox",
    "image_sandbox",
    "namespace_sandbox",
    "slug_for",
    "worktree_sandbox",
]

GUEST_GIT_DIR = "/run/sandboxns-git"
GUEST_OBJECTS = "/run/sandboxns-git-objects"
_SLUG_UNSAFE = re.compile(r"[^a-z0-9]+")
_OBJECT_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# A task's git work is small; these bound what a guest can make it cost.
GUEST_GIT_TIMEOUT = 60.0
HOST_GIT_TIMEOUT = 600.0
MAX_BUNDLE_BYTES = 1024**3
# Git's environment inside a task sandbox: no system or global config, so
# only the task's own read-only config applies.
_GUEST_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}


def slug_for(task_id: str) -> str:
    """A task's directory and branch name: readable, and the same for the
    same id every time (a digest keeps ids that read alike apart)."""
    if not isinstance(task_id, str) or not task_id or "\0" in task_id:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"a task id must be a non-empty string, not {task_id!r}")
    readable = _SLUG_UNSAFE.sub("-", task_id.lower()).strip("-")[:40].strip("-") or "task"
    return f"{readable}-{hashlib.sha256(task_id.encode()).hexdigest()[:8]}"


# How long a wrapped command may run by default: a day.
WRAPPED_TIMEOUT = 24 * 3600.0


class _TaskSandboxes:
    """What both kinds share: a backend state directory, one session per
    task (recorded by slug), and the structural methods over them."""

    def __init__(self, root: Path, *, driver: str, network: object, timeout: float) -> None:
        self._policy = check_network_policy(network)
        # What one wrapped command may take: it is usually a whole agent run,
        # so the default is a day, not a tool call's 30 s.
        self.timeout = check_seconds(timeout)
        if self._policy.needs_gateway:
            raise SandboxError(
                ErrorCode.SANDBOX_POLICY_REFUSED,
                "task sandboxes take 'deny-all' or 'allow-all': an allow-list holds credentials, which a wrapped "
                "command line cannot carry",
            )
        self._root = root
        self._records = root / ".sandboxns"
        self.state_directory = self._records / "state"
        self._driver = driver
        # The image task sandboxes run on (a digest, or what to import), or None.
        self._image: str | Path | None = None

    def _workspace_path(self, task_id: str) -> Path:
        return self._root / slug_for(task_id)

    def _record_path(self, task_id: str) -> Path:
        return self._records / f"{slug_for(task_id)}.json"

    def _record(self, task_id: str) -> dict | None:
        try:
            return json.loads(self._record_path(task_id).read_text())
        except FileNotFoundError:
            return None

    def _save_record(self, task_id: str, record: dict) -> None:
        path = self._record_path(task_id)
        staging = path.with_suffix(".new")
        staging.write_text(json.dumps({"task": task_id, **record}))
        os.replace(staging, path)

    def _session_id(self, task_id: str) -> str | None:
        record = self._record(task_id)
        return None if record is None else record["session"]

    async def _create_session(self, workspace: Path, mounts: Sequence[Mount], setup: Sequence[str] = ()) -> str:
        """A new session over ``workspace``; ``setup`` runs in it once. The
        session is stopped again: each wrapped command takes its lease."""
        async with open_backend(driver=self._driver, state_directory=self.state_directory) as backend:
            if isinstance(self._image, Path):  # imported once, into the sandboxes' own state directory
                self._image = (await backend.import_image(self._image)).digest
            handle = await backend.create(workspace=workspace, network=self._policy, mounts=mounts, image=self._image)
            try:
                if setup:
                    _check_ran(await handle.session.run(setup[0], setup[1:], env=self._guest_env()), "setting up")
            except BaseException:
                await handle.delete()
                raise
            await handle.stop()
        return handle.session_id

    def _guest_env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKSPACE, "LANG": "C.UTF-8", **_GUEST_GIT_ENV}

    async def _in_session(self, task_id: str, argv: Sequence[str]) -> RunResult:
        """Run ``argv`` in the task's session (taking its lease meanwhile)."""
        async with self._resumed(task_id) as handle:
            return await handle.session.run(argv[0], argv[1:], env=self._guest_env(), timeout=GUEST_GIT_TIMEOUT)

    @contextlib.asynccontextmanager
    async def _resumed(self, task_id: str) -> AsyncIterator[SessionHandle]:
        """The task's stored session, resumed (and its lease held) for the
        block."""
        session_id = self._session_id(task_id)
        if session_id is None:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"task {task_id!r} has no workspace")
        state = stored_session_state(self.state_directory, session_id)
        async with open_backend(driver=state["backend"], state_directory=self.state_directory) as backend:
            handle = await backend.create(state=state, template=state["template"], network=self._policy)
            try:
                yield handle
            finally:
                await handle.shutdown()

    def wrap(
        self,
        cmd: Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        id: str,
    ) -> list[str]:
        """The argv running ``cmd`` in task ``id``'s sandbox (after
        :meth:`workspace`). ``cwd`` is a guest path or a host path inside
        the task's workspace. Run it with ``env`` in its environment."""
        session_id = self._session_id(id)
        if session_id is None:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"task {id!r} has no workspace yet; call workspace() first")
        if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(arg, str) for arg in cmd):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "cmd must be a non-empty list of strings")
        # -P: the sandboxns on sys.path, not a directory of that name where
        # the orchestrator happens to run it.
        argv = [sys.executable, "-P", "-m", "sandboxns", "exec", "--state-dir", str(self.state_directory)]
        argv += ["--session", session_id, "--cwd", self._guest_cwd(id, cwd), "--timeout", repr(self.timeout)]
        for name in env or {}:
            if not isinstance(name, str) or not name or "=" in name:
                raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"invalid environment variable name {name!r}")
            argv += ["--env", name]
        if self._policy.shares_host_network:
            argv += ["--network", "allow-all"]
        return [*argv, "--", *cmd]

    def _guest_cwd(self, task_id: str, cwd: str | os.PathLike[str] | None) -> str:
        if cwd is None:
            return WORKSPACE
        text = os.fspath(cwd)
        if text == WORKSPACE or text.startswith(WORKSPACE + "/") or not os.path.isabs(text):
            return normalize_path(text)
        host = self._workspace_path(task_id).resolve()
        path = Path(text).resolve()
        if path != host and host not in path.parents:
            raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{text} is not inside the task's workspace {host}")
        return normalize_path(str(path.relative_to(host)))

    def endpoint_for(self, port: int) -> str:
        """``host:port`` at which a process in a sandbox reaches the host's
        ``port``: only with the ``allow-all`` network, which shares the
        host's; ``deny-all`` has no route to the host at all."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"port must be 1-65535, not {port!r}")
        if not self._policy.shares_host_network:
            raise SandboxError(
                ErrorCode.SANDBOX_POLICY_REFUSED,
                f"the {self._policy.kind} network has no route to the host; use network='allow-all' to reach host ports",
            )
        return f"127.0.0.1:{port}"

    async def stop(self, id: str) -> None:
        """Kill whatever runs in the task's sandbox (the wrapped command
        then exits with 125). Nothing to do if nothing runs."""
        if self._in_use(id):
            await clear_lease(self.state_directory / "sessions" / self._session_id(id), force=True)

    def _in_use(self, task_id: str) -> bool:
        """Whether someone (a wrapped command) holds the task's session."""
        session_id = self._session_id(task_id)
        session_dir = self.state_directory / "sessions" / str(session_id)
        return session_id is not None and session_dir.is_dir() and lease_status(session_dir).locked

    async def _delete_session(self, task_id: str) -> None:
        session_id = self._session_id(task_id)
        if session_id is None:
            return
        await self.stop(task_id)
        try:
            async with self._resumed(task_id) as handle:
                await handle.delete()
        except SandboxError as exc:
            if exc.code != ErrorCode.SANDBOX_NOT_FOUND:
                raise
        self._record_path(task_id).unlink(missing_ok=True)


def _check_ran(result: RunResult, what: str) -> RunResult:
    if result.exit_code != 0:
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE,
            f"{what} in the task's sandbox failed ({result.exit_code or result.signal}): {result.stderr.strip()}",
        )
    return result


class NamespaceSandbox(_TaskSandboxes):
    """Each task gets a new, empty directory (``root/<slug>``) as its
    sandbox's workspace. See the module docstring for the methods."""

    async def workspace(self, id: str) -> dict:
        path = self._workspace_path(id)
        if self._record(id) is None:
            path.mkdir(parents=True, exist_ok=True)
            self._save_record(id, {"session": await self._create_session(path, ())})
        return {"cwd": WORKSPACE, "host_path": str(path)}

    async def cleanup(self, id: str, force: bool = False) -> dict:
        """Delete the task's session and directory (a namespace workspace
        is never "dirty": nothing in it is meant to outlive the task; keep
        results elsewhere). Refused while a command runs there, unless
        ``force``, which kills it."""
        path = self._workspace_path(id)
        if self._record(id) is None and not path.exists():
            return {"removed": False, "dirty": False, "detail": "nothing to clean up"}
        if not force and self._in_use(id):
            return {"removed": False, "dirty": False, "detail": "a command runs there; stop it first or force"}
        await self._delete_session(id)
        await trio.to_thread.run_sync(remove_tree, path)
        return {"removed": True, "dirty": False, "detail": f"removed {path}"}


class ImageSandbox(NamespaceSandbox):
    """Each task gets a new, empty directory (``root/<slug>``) as the
    workspace of a sandbox whose root filesystem is an image's, never the
    host's; its commands get the image's Env. See the module docstring for
    the methods."""

    def __init__(self, image: str | Path, root: Path, *, driver: str, network: object, timeout: float) -> None:
        super().__init__(root, driver=driver, network=network, timeout=timeout)
        self._image = image

    @property
    def image(self) -> str | None:
        """The image's digest, once the first workspace imported it."""
        return self._image if isinstance(self._image, str) else None


class WorktreeSandbox(_TaskSandboxes):
    """Each task gets a working tree of ``repo`` on branch
    ``<branch_prefix>/<slug>``, in ``root/<slug>``, with a git directory of
    its own (see the module docstring). Besides the structural methods,
    :meth:`collect` brings a task's commits onto its branch."""

    def __init__(
        self, repo: Path, branch_prefix: str, root: Path, *, driver: str, network: object, timeout: float
    ) -> None:
        super().__init__(root, driver=driver, network=network, timeout=timeout)
        self.repo = repo
        self.branch_prefix = branch_prefix

    def branch_for(self, task_id: str) -> str:
        return f"{self.branch_prefix}/{slug_for(task_id)}"

    def _git_dir(self, task_id: str) -> Path:
        return self._records / f"{slug_for(task_id)}.git"

    async def _git(self, *args: str, stdin: int | None = None) -> str:
        """git in the repository itself (never in a task's directories),
        never recursing into submodules."""
        with trio.fail_after(HOST_GIT_TIMEOUT):
            result = await trio.run_process(
                ["git", "-C", str(self.repo), "-c", "submodule.recurse=false", *args],
                stdin=stdin,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        if result.returncode != 0:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"git {' '.join(args)} failed: {result.stderr.decode(errors='replace').strip()}",
            )
        return result.stdout.decode(errors="replace").strip()

    async def workspace(self, id: str) -> dict:
        path = self._workspace_path(id)
        if self._record(id) is not None:
            return {"cwd": WORKSPACE, "host_path": str(path)}
        branch = self.branch_for(id)
        try:
            base = await self._git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}")
        except SandboxError:
            base = await self._git("rev-parse", "--verify", "HEAD^{commit}")
            await self._git("branch", branch, base)
        mounts = await self._prepare_git_dir(id, branch, base)
        await trio.to_thread.run_sync(remove_tree, path)  # leftovers of an interrupted attempt
        path.mkdir(parents=True)
        session_id = await self._create_session(path, mounts, setup=("git", "reset", "--hard", "--quiet"))
        self._save_record(id, {"session": session_id, "base": base})
        return {"cwd": WORKSPACE, "host_path": str(path)}

    async def _prepare_git_dir(self, task_id: str, branch: str, base: str) -> list[Mount]:
        """The task's own git directory, written by the host from scratch:
        HEAD on the task's branch at ``base``, the repository's objects as
        an alternate, the repository's identity (user.name, user.email)."""
        objects = Path(await self._git("rev-parse", "--path-format=absolute", "--git-path", "objects"))
        object_format = await self._git("rev-parse", "--show-object-format")
        identity = []
        for key in ("user.name", "user.email"):
            try:
                identity.append((key.split(".")[1], await self._git("config", "--get", key)))
            except SandboxError:
                pass
        git_dir = self._git_dir(task_id)
        await trio.to_thread.run_sync(remove_tree, git_dir)
        for sub in ("objects/info", "objects/pack", "refs/tags", "hooks", "info"):
            (git_dir / sub).mkdir(parents=True, exist_ok=True)
        ref = git_dir / "refs" / "heads" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(base + "\n")
        (git_dir / "HEAD").write_text(f"ref: refs/heads/{branch}\n")
        (git_dir / "objects" / "info" / "alternates").write_text(GUEST_OBJECTS + "\n")
        config = ["[core]", "\trepositoryformatversion = 1", "\tfilemode = true", "\tbare = false"]
        config += ["[extensions]", f"\tobjectformat = {object_format}"]
        if identity:
            config += ["[user]", *(f"\t{key} = {_config_value(value)}" for key, value in identity)]
        (git_dir / "config").write_text("\n".join(config) + "\n")
        gitfile = self._records / f"{slug_for(task_id)}.gitfile"
        gitfile.write_text(f"gitdir: {GUEST_GIT_DIR}\n")
        return [
            Mount(git_dir, GUEST_GIT_DIR, writable=True),
            Mount(git_dir / "config", f"{GUEST_GIT_DIR}/config"),
            Mount(git_dir / "hooks", f"{GUEST_GIT_DIR}/hooks"),
            Mount(objects, GUEST_OBJECTS),
            Mount(gitfile, f"{WORKSPACE}/.git"),
        ]

    async def collect(self, id: str) -> dict:
        """Bring the task's commits onto its branch in the repository:
        ``{"branch", "commit", "imported"}``. The branch takes whatever
        the task made of it (it is the task's), checked like a fetch from
        an untrusted remote."""
        record = self._record(id)
        if record is None:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"task {id!r} has no workspace")
        branch, base = self.branch_for(id), record["base"]
        bundle = f"{GUEST_GIT_DIR}/sandboxns.bundle"
        tip_probe = ("git", "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}^{{commit}}")
        tip = _check_ran(await self._in_session(id, tip_probe), "reading the task's branch").stdout.strip()
        if not _OBJECT_ID.fullmatch(tip):
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the task's branch names no commit: {tip[:100]!r}")
        if tip == base:
            return {"branch": branch, "commit": tip, "imported": False}
        make_bundle = ("git", "bundle", "create", "--quiet", bundle, f"refs/heads/{branch}", f"^{base}")
        _check_ran(await self._in_session(id, make_bundle), "bundling the task's commits")
        with tempfile.TemporaryDirectory(prefix="sandboxns-bundle-") as private:
            host_bundle = Path(private) / "task.bundle"
            _take_regular_file(self._git_dir(id) / "sandboxns.bundle", host_bundle)
            imported = await self._import_bundle(host_bundle, branch, base)
        self._save_record(id, {**record, "base": imported})
        return {"branch": branch, "commit": imported, "imported": True}

    async def _import_bundle(self, bundle: Path, branch: str, base: str) -> str:
        """Point the branch at the bundle's tip, after git has checked every
        object in it strictly. Not ``git fetch``: it would recurse into
        submodules the bundle names (running git in directories a guest
        made), and on this git it does not fsck what a bundle holds."""
        ref = f"refs/heads/{branch}".encode()
        tip = None
        # Unbuffered, so the fd's offset is exactly where the header ends
        # (a private host file; the header is a few short lines).
        with open(bundle, "rb", buffering=0) as reader:  # noqa: ASYNC230
            if reader.readline(64) not in (b"# v2 git bundle\n", b"# v3 git bundle\n"):
                raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the task's bundle is not a git bundle")
            while (line := reader.readline(4096)) != b"\n":
                if not line.endswith(b"\n"):
                    raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the task's bundle has a malformed header")
                oid, _, name = line[:-1].partition(b" ")
                if name == ref and _OBJECT_ID.fullmatch(oid.decode("ascii", "replace")):
                    tip = oid.decode()
            if tip is None:
                raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the task's bundle does not hold {branch}")
            # index-pack reads the pack from where the header ends.
            await self._git(
                "-c", "fsck.hasDot=error", "-c", "fsck.hasDotdot=error", "-c", "fsck.hasDotgit=error",
                "index-pack", "--stdin", "--fix-thin", "--strict", stdin=reader.fileno(),
            )  # fmt: skip
        # Every object the new history needs is here, and the tip is a commit.
        await self._git("rev-list", "--objects", "--quiet", tip, "--not", base)
        if await self._git("cat-file", "-t", tip) != "commit":
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the task's branch does not name a commit")
        try:  # only from where the task started: never over a move made in the repository meanwhile
            await self._git("update-ref", f"refs/heads/{branch}", tip, base)
        except SandboxError as exc:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"branch {branch} is no longer at {base}, where the task's work started; left as it is ({exc.message})",
            ) from None
        return tip

    async def cleanup(self, id: str, force: bool = False) -> dict:
        """Bring the task's commits onto its branch, then remove its working
        tree, git directory and session; the branch stays. A working tree
        with uncommitted changes, or one where a command runs, is left alone
        unless ``force``."""
        path = self._workspace_path(id)
        changes, kept = "", f"branch {self.branch_for(id)} kept"
        if self._record(id) is None:
            if not path.exists() and not self._git_dir(id).exists():
                return {"removed": False, "dirty": False, "detail": "nothing to clean up"}
            # Only a half-made workspace: nothing of the task's to keep.
        else:
            if self._in_use(id):
                if not force:
                    return {"removed": False, "dirty": False, "detail": "a command runs there; stop it first or force"}
                await self.stop(id)
            status = await self._in_session(id, ("git", "status", "--porcelain"))
            changes = status.stdout.strip() if status.exit_code == 0 else f"git status failed: {status.stderr.strip()}"
            if changes and not force:
                return {
                    "removed": False,
                    "dirty": True,
                    "detail": f"uncommitted changes in {path}; commit them or clean up with force=True:\n{changes}",
                }
            try:
                kept += f" at {(await self.collect(id))['commit'][:12]}"
            except SandboxError as exc:  # a guest can break its own git directory
                if not force:
                    return {
                        "removed": False,
                        "dirty": bool(changes),
                        "detail": f"the task's commits cannot be collected ({exc.message}); force=True discards them",
                    }
                kept += f"; the task's commits could not be collected: {exc.message}"
            await self._delete_session(id)
        for leftover in (path, self._git_dir(id)):
            await trio.to_thread.run_sync(remove_tree, leftover)
        (self._records / f"{slug_for(id)}.gitfile").unlink(missing_ok=True)
        return {"removed": True, "dirty": bool(changes), "detail": f"removed {path}; {kept}"}


def _take_regular_file(source: Path, target: Path) -> None:
    """Move a file a guest wrote to a host-private place: only a regular
    file, never through a symlink and never blocking on a FIFO it planted."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"the task's bundle cannot be read: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "the task's bundle is not a regular file")
        if info.st_size > MAX_BUNDLE_BYTES:
            raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"the task's bundle is over {MAX_BUNDLE_BYTES} bytes")
        with open(fd, "rb", closefd=False) as reader, open(target, "wb") as writer:
            shutil.copyfileobj(reader, writer)
    finally:
        os.close(fd)
        source.unlink(missing_ok=True)


def _config_value(value: str) -> str:
    """A value as git config syntax quotes it."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def namespace_sandbox(
    root: str | os.PathLike[str],
    *,
    driver: str = "native",
    network: object = "deny-all",
    timeout: float = WRAPPED_TIMEOUT,
) -> NamespaceSandbox:
    """Task sandboxes whose workspaces are new directories under ``root``;
    a wrapped command is killed after ``timeout`` seconds."""
    path = Path(root).absolute()
    sandbox = NamespaceSandbox(path, driver=driver, network=network, timeout=timeout)
    (path / ".sandboxns").mkdir(parents=True, exist_ok=True)
    return sandbox


def image_sandbox(
    root: str | os.PathLike[str],
    *,
    image: str | os.PathLike[str],
    driver: str = "native",
    network: object = "deny-all",
    timeout: float = WRAPPED_TIMEOUT,
) -> ImageSandbox:
    """Task sandboxes whose workspaces are new directories under ``root``,
    running on ``image``: an OCI image layout or a root filesystem (a
    directory or a tar: what ``skopeo copy ... oci:``, ``podman save
    --format oci-archive`` or ``docker export`` make), imported into the
    sandboxes' state directory on first use, or the digest of one imported
    there already. A wrapped command is killed after ``timeout`` seconds."""
    if isinstance(image, str) and image.startswith("sha256:"):
        chosen: str | Path = check_digest(image)
    elif isinstance(image, (str, os.PathLike)):
        chosen = Path(image).absolute()
        if not chosen.exists():
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no image at {chosen}")
    else:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"image must be a path or a digest, not {image!r}")
    path = Path(root).absolute()
    sandbox = ImageSandbox(chosen, path, driver=driver, network=network, timeout=timeout)
    (path / ".sandboxns").mkdir(parents=True, exist_ok=True)
    return sandbox


def worktree_sandbox(
    repo: str | os.PathLike[str],
    *,
    branch_prefix: str = "sandboxns",
    root: str | os.PathLike[str] | None = None,
    driver: str = "native",
    network: object = "deny-all",
    timeout: float = WRAPPED_TIMEOUT,
) -> WorktreeSandbox:
    """Task sandboxes whose workspaces are working trees of the git
    repository ``repo``, in ``root`` (default: ``<repo>-worktrees`` beside
    it), on branches ``<branch_prefix>/<slug>``; a wrapped command is killed
    after ``timeout`` seconds."""
    repo_path = Path(repo).resolve()
    if not (repo_path / ".git").exists():
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"{repo_path} is not a git repository's top directory")
    if not isinstance(branch_prefix, str) or not re.fullmatch(
        r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*", branch_prefix
    ):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"invalid branch prefix {branch_prefix!r}")
    path = Path(root).resolve() if root is not None else repo_path.with_name(f"{repo_path.name}-worktrees")
    if path == repo_path or repo_path in path.parents or path in repo_path.parents:
        raise SandboxError(
            ErrorCode.SANDBOX_PATH_REFUSED, f"task trees must live outside the repository, not in {path}"
        )
    sandbox = WorktreeSandbox(repo_path, branch_prefix, path, driver=driver, network=network, timeout=timeout)
    (path / ".sandboxns").mkdir(parents=True, exist_ok=True)
    return sandbox
