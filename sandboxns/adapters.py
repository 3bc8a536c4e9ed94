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
:func:`worktree_sandbox` gives each task a git worktree of a repository on
its own branch, in which ``git status``, ``diff`` and ``commit`` work inside
the sandbox while the repository's ``config`` and ``hooks`` stay read-only
there: the host runs git in that repository later, and a guest that could
change either would run code on the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import trio

from ._backend import open_backend, stored_session_state
from ._driver import Mount
from ._errors import ErrorCode, SandboxError
from ._files import WORKSPACE
from ._lease import clear_lease, lease_status
from ._network import check_network_policy
from ._session import normalize_path

__all__ = ["NamespaceSandbox", "WorktreeSandbox", "namespace_sandbox", "slug_for", "worktree_sandbox"]

GUEST_GIT_DIR = "/run/sandboxns-git"
_SLUG_UNSAFE = re.compile(r"[^a-z0-9]+")


def slug_for(task_id: str) -> str:
    """A task's directory and branch name: readable, and the same for the
    same id every time (a digest keeps ids that read alike apart)."""
    if not isinstance(task_id, str) or not task_id or "\0" in task_id:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"a task id must be a non-empty string, not {task_id!r}")
    readable = _SLUG_UNSAFE.sub("-", task_id.lower()).strip("-")[:40].strip("-") or "task"
    return f"{readable}-{hashlib.sha256(task_id.encode()).hexdigest()[:8]}"


class _TaskSandboxes:
    """What both kinds share: a backend state directory, one session per
    task (recorded by slug), and the structural methods over them."""

    def __init__(self, root: Path, *, driver: str, network: object) -> None:
        self._policy = check_network_policy(network)
        self._root = root
        self._records = root / ".sandboxns"
        self.state_directory = self._records / "state"
        self._driver = driver
        self._network = network

    def _record(self, task_id: str) -> Path:
        return self._records / f"{slug_for(task_id)}.json"

    def _session_id(self, task_id: str) -> str | None:
        try:
            return json.loads(self._record(task_id).read_text())["session"]
        except FileNotFoundError:
            return None

    async def _ensure_session(self, task_id: str, workspace: Path, mounts: Sequence[Mount]) -> None:
        """Create the task's session over ``workspace`` unless it exists,
        then let go of it: each wrapped command takes its lease."""
        if self._session_id(task_id) is not None:
            return
        async with open_backend(driver=self._driver, state_directory=self.state_directory) as backend:
            handle = await backend.create(workspace=workspace, network=self._network, mounts=mounts)
            await handle.stop()
        record = self._record(task_id)
        staging = record.with_suffix(".new")
        staging.write_text(json.dumps({"task": task_id, "session": handle.session_id}))
        os.replace(staging, record)

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
        argv += ["--session", session_id, "--cwd", self._guest_cwd(id, cwd)]
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
        host = self._workspace_path(task_id)
        if Path(text).is_absolute() and not text.startswith(WORKSPACE):
            path = Path(text).resolve()
            if path != host and host not in path.parents:
                raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{text} is not inside the task's workspace {host}")
            text = str(path.relative_to(host))
        return normalize_path(text)

    def _workspace_path(self, task_id: str) -> Path:
        return self._root / slug_for(task_id)

    def endpoint_for(self, port: int) -> str:
        """``host:port`` at which a process in a sandbox reaches the host's
        ``port``: only with the ``allow-all`` network, which shares the
        host's; other policies have no route to the host at all."""
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
        session_id = self._session_id(id)
        if session_id is None:
            return
        session_dir = self.state_directory / "sessions" / session_id
        if session_dir.is_dir() and lease_status(session_dir).locked:
            await clear_lease(session_dir, force=True)

    async def _delete_session(self, task_id: str) -> None:
        session_id = self._session_id(task_id)
        if session_id is None:
            return
        await self.stop(task_id)
        try:
            state = stored_session_state(self.state_directory, session_id)
        except SandboxError as exc:
            if exc.code != ErrorCode.SANDBOX_NOT_FOUND:
                raise
        else:
            async with open_backend(driver=state["backend"], state_directory=self.state_directory) as backend:
                handle = await backend.create(state=state, template=state["template"])
                await handle.delete()
        self._record(task_id).unlink(missing_ok=True)


class NamespaceSandbox(_TaskSandboxes):
    """Each task gets a new, empty directory (``root/<slug>``) as its
    sandbox's workspace. See the module docstring for the methods."""

    async def workspace(self, id: str) -> dict:
        path = self._workspace_path(id)
        path.mkdir(parents=True, exist_ok=True)
        await self._ensure_session(id, path, ())
        return {"cwd": WORKSPACE, "host_path": str(path)}

    async def cleanup(self, id: str, force: bool = False) -> dict:
        """Delete the task's session and directory (a namespace workspace
        is never "dirty": nothing in it is meant to outlive the task; keep
        results elsewhere). ``force`` is accepted for the shape's sake."""
        path = self._workspace_path(id)
        if self._session_id(id) is None and not path.exists():
            return {"removed": False, "dirty": False, "detail": "nothing to clean up"}
        await self._delete_session(id)
        await trio.to_thread.run_sync(shutil.rmtree, path, True)
        return {"removed": True, "dirty": False, "detail": f"removed {path}"}


class WorktreeSandbox(_TaskSandboxes):
    """Each task gets a git worktree of ``repo`` on branch
    ``<branch_prefix>/<slug>``, in ``root/<slug>``, as its sandbox's
    workspace. See the module docstring for the methods."""

    def __init__(self, repo: Path, branch_prefix: str, root: Path, *, driver: str, network: object) -> None:
        super().__init__(root, driver=driver, network=network)
        self.repo = repo
        self.branch_prefix = branch_prefix

    def branch_for(self, task_id: str) -> str:
        return f"{self.branch_prefix}/{slug_for(task_id)}"

    async def _git(self, *args: str, cwd: Path | None = None, check: bool = True) -> str:
        result = await trio.run_process(
            ["git", "-C", str(cwd or self.repo), *args], capture_stdout=True, capture_stderr=True, check=False
        )
        if check and result.returncode != 0:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE,
                f"git {' '.join(args)} failed: {result.stderr.decode(errors='replace').strip()}",
            )
        return result.stdout.decode(errors="replace")

    async def workspace(self, id: str) -> dict:
        path = self._workspace_path(id)
        if not path.exists():
            branch = self.branch_for(id)
            exists = await self._git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False)
            if exists:
                await self._git("worktree", "add", str(path), branch)
            else:
                await self._git("worktree", "add", "-b", branch, str(path), "HEAD")
        await self._ensure_session(id, path, await self._git_mounts(id, path))
        return {"cwd": WORKSPACE, "host_path": str(path)}

    async def _git_mounts(self, task_id: str, path: Path) -> list[Mount]:
        """The repository's git directory, writable (objects, refs, this
        worktree's index), under /run/sandboxns-git, except its config,
        hooks and submodule directories, which are read-only; and a
        ``.git`` file in the workspace that points there. (Writable refs
        mean a guest can move any branch, not only its own: review what a
        task leaves before pushing anything.)"""
        common = Path((await self._git("rev-parse", "--git-common-dir", cwd=path)).strip())
        common = (path / common).resolve()
        own = Path((await self._git("rev-parse", "--git-dir", cwd=path)).strip())
        own = (path / own).resolve()
        # Made if missing, so that they exist to be covered read-only: a
        # guest that could plant a submodule's git directory would have the
        # host run its config and hooks on the next `git submodule update`.
        (common / "hooks").mkdir(exist_ok=True)
        (common / "modules").mkdir(exist_ok=True)
        gitfile = self._records / f"{slug_for(task_id)}.gitfile"
        gitfile.write_text(f"gitdir: {GUEST_GIT_DIR}/{own.relative_to(common)}\n")
        mounts = [
            Mount(common, GUEST_GIT_DIR, writable=True),
            Mount(common / "config", f"{GUEST_GIT_DIR}/config"),
            Mount(common / "hooks", f"{GUEST_GIT_DIR}/hooks"),
            Mount(common / "modules", f"{GUEST_GIT_DIR}/modules"),
        ]
        if (own / "config.worktree").is_file():
            mounts.append(Mount(own / "config.worktree", f"{GUEST_GIT_DIR}/{own.relative_to(common)}/config.worktree"))
        return [*mounts, Mount(gitfile, f"{WORKSPACE}/.git")]

    async def cleanup(self, id: str, force: bool = False) -> dict:
        """Remove the task's worktree directory and session; the branch
        stays. A worktree with uncommitted changes is left alone unless
        ``force``."""
        path = self._workspace_path(id)
        if not path.exists():
            await self._delete_session(id)
            return {"removed": False, "dirty": False, "detail": "nothing to clean up"}
        await self.stop(id)
        changes = (await self._git("status", "--porcelain", cwd=path)).strip()
        if changes and not force:
            return {
                "removed": False,
                "dirty": True,
                "detail": f"uncommitted changes in {path}; commit them or clean up with force=True:\n{changes}",
            }
        await self._delete_session(id)
        await self._git("worktree", "remove", *(["--force"] if changes else []), str(path))
        (self._records / f"{slug_for(id)}.gitfile").unlink(missing_ok=True)
        return {
            "removed": True,
            "dirty": bool(changes),
            "detail": f"removed {path}; branch {self.branch_for(id)} kept",
        }


def namespace_sandbox(
    root: str | os.PathLike[str], *, driver: str = "native", network: object = "deny-all"
) -> NamespaceSandbox:
    """Task sandboxes whose workspaces are new directories under ``root``."""
    path = Path(root).absolute()
    (path / ".sandboxns").mkdir(parents=True, exist_ok=True)
    return NamespaceSandbox(path, driver=driver, network=network)


def worktree_sandbox(
    repo: str | os.PathLike[str],
    *,
    branch_prefix: str = "sandboxns",
    root: str | os.PathLike[str] | None = None,
    driver: str = "native",
    network: object = "deny-all",
) -> WorktreeSandbox:
    """Task sandboxes whose workspaces are git worktrees of ``repo``, in
    ``root`` (default: ``<repo>-worktrees`` beside it), on branches
    ``<branch_prefix>/<slug>``."""
    repo_path = Path(repo).resolve()
    if not (repo_path / ".git").exists():
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"{repo_path} is not a git repository's top directory")
    if not isinstance(branch_prefix, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]*", branch_prefix):
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"invalid branch prefix {branch_prefix!r}")
    path = Path(root).absolute() if root is not None else repo_path.with_name(f"{repo_path.name}-worktrees")
    if path == repo_path or repo_path in path.parents:
        raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"worktrees must live outside the repository, not in {path}")
    (path / ".sandboxns").mkdir(parents=True, exist_ok=True)
    return WorktreeSandbox(repo_path, branch_prefix.rstrip("/"), path, driver=driver, network=network)
