"""The structural task-sandbox adapters, with real git repositories."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from conftest import refused

from sandboxns import ErrorCode, SandboxError, adapters
from sandboxns._layers import remove_tree

pytestmark = [pytest.mark.smoke, pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")]

TASK = "Task #7: fix the parser!"


def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    git(path, "config", "user.name", "Host User")
    git(path, "config", "user.email", "host@example.com")
    (path / "parser.py").write_text("def parse(): pass\n")
    git(path, "add", "parser.py")
    git(path, "commit", "-qm", "initial")
    return path


async def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return await trio.run_process(
        argv, capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, **(env or {})}
    )


def test_slugs_are_readable_deterministic_and_distinct():
    assert adapters.slug_for(TASK) == adapters.slug_for(TASK)
    assert adapters.slug_for(TASK).startswith("task-7-fix-the-parser-")
    assert adapters.slug_for("a b") != adapters.slug_for("a-b")
    with pytest.raises(SandboxError):
        adapters.slug_for("")


async def test_git_works_inside_a_worktree_sandbox(driver_name, repo, tmp_path):
    sandbox = adapters.worktree_sandbox(repo, branch_prefix="agent", root=tmp_path / "trees", driver=driver_name)
    first = await sandbox.workspace(TASK)
    assert first == await sandbox.workspace(TASK)  # idempotent
    assert first["cwd"] == "/workspace"
    assert (tmp_path / "trees" / adapters.slug_for(TASK)).samefile(first["host_path"])
    assert (Path(first["host_path"]) / "parser.py").read_text() == "def parse(): pass\n"
    branch = f"agent/{adapters.slug_for(TASK)}"
    assert git(repo, "rev-parse", branch) == git(repo, "rev-parse", "main")

    script = (
        "git status --porcelain && echo '# fixed' >> parser.py && git status --porcelain && git diff --stat && "
        "git add -A && git commit -qm 'fix from the sandbox' && git log --format='%s by %an' -2"
    )
    done = await run(sandbox.wrap(["sh", "-c", script], id=TASK))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines() == [
        " M parser.py",
        " parser.py | 1 +",
        " 1 file changed, 1 insertion(+)",
        "fix from the sandbox by Host User",
        "initial by Host User",
    ]
    # The commit reaches the task's branch in the repository when collected.
    assert git(repo, "log", "--format=%s", "-1", branch).strip() == "initial"
    collected = await sandbox.collect(TASK)
    assert collected["imported"] and collected["branch"] == branch
    assert git(repo, "log", "--format=%s", "-1", branch).strip() == "fix from the sandbox"
    assert git(repo, "log", "--format=%s", "-1", "main").strip() == "initial"
    assert not (await sandbox.collect(TASK))["imported"]  # nothing new since

    # Inside, the task's git config and hooks are read-only, and the
    # repository's own store is out of reach.
    for attempt in (
        "git config core.hooksPath /workspace",
        "echo '[core] fsmonitor = evil' >> /run/sandboxns-git/config",
        "echo evil > /run/sandboxns-git/hooks/post-checkout",
        "touch /run/sandboxns-git-objects/planted",
        f"ls {repo}",
    ):
        refused_write = await run(sandbox.wrap(["sh", "-c", attempt], id=TASK))
        assert refused_write.returncode != 0, attempt


async def test_what_a_guest_plants_in_git_never_runs_on_the_host(repo, tmp_path):
    # The review's attacks: a commondir file leading to a config with
    # core.fsmonitor, and a nested repository (reached as a submodule) with
    # the same. The host must never run git where the guest could write.
    marker = tmp_path / "host-ran-guest-code"
    evil = f"touch {marker}; false"
    sandbox = adapters.worktree_sandbox(repo, root=tmp_path / "trees")
    await sandbox.workspace(TASK)
    plant = (
        "mkdir -p /run/sandboxns-git/evil/objects /run/sandboxns-git/evil/refs && "
        "echo 'ref: refs/heads/x' > /run/sandboxns-git/evil/HEAD && "
        f"printf '[core]\\n\\trepositoryformatversion = 0\\n\\tfsmonitor = \"{evil}\"\\n' > /run/sandboxns-git/evil/config && "
        "echo evil > /run/sandboxns-git/commondir; "
        'git init -q sub && git -C sub config core.fsmonitor "$EVIL" && '
        "git -C sub commit -q --allow-empty -m sub && git add sub && git commit -qm 'with a gitlink'; "
        "echo untracked > loose.txt"
    )
    done = await run(sandbox.wrap(["sh", "-c", plant], env={"EVIL": evil}, id=TASK), env={"EVIL": evil})
    assert done.returncode == 0 or b"commondir" in done.stderr, done.stderr
    refused_cleanup = await sandbox.cleanup(TASK)  # git inside is broken or the tree dirty: refuses
    assert refused_cleanup["removed"] is False
    with contextlib.suppress(SandboxError):  # the guest may have broken its own git directory
        await sandbox.collect(TASK)
    assert (await sandbox.cleanup(TASK, force=True))["removed"] is True
    git(repo, "status")
    git(repo, "log", "--all")
    assert not marker.exists()


async def test_wrap_passes_names_not_values_and_maps_host_paths(driver_name, repo, tmp_path):
    sandbox = adapters.worktree_sandbox(repo, root=tmp_path / "trees", driver=driver_name)
    await refused(ErrorCode.SANDBOX_NOT_FOUND, trio.to_thread.run_sync(lambda: sandbox.wrap(["true"], id="new")))
    workspace = await sandbox.workspace("task")
    (tmp_path / "trees" / adapters.slug_for("task") / "sub").mkdir()
    argv = sandbox.wrap(
        ["sh", "-c", "pwd; echo $API_KEY"],
        cwd=os.path.join(workspace["host_path"], "sub"),
        env={"API_KEY": "value-not-in-argv"},
        id="task",
    )
    assert "value-not-in-argv" not in " ".join(argv) and argv[0] == sys.executable
    done = await run(argv, env={"API_KEY": "value-not-in-argv"})
    assert done.stdout.decode() == "/workspace/sub\nvalue-not-in-argv\n", done.stderr
    with pytest.raises(SandboxError) as error:
        sandbox.wrap(["true"], cwd=str(tmp_path), id="task")
    assert error.value.code == ErrorCode.SANDBOX_PATH_REFUSED


async def test_cleanup_keeps_the_branch_and_refuses_a_dirty_worktree(repo, tmp_path):
    sandbox = adapters.worktree_sandbox(repo, root=tmp_path / "trees")
    assert await sandbox.cleanup("never-made") == {"removed": False, "dirty": False, "detail": "nothing to clean up"}
    workspace = await sandbox.workspace(TASK)
    commit = await run(sandbox.wrap(["sh", "-c", "echo one >> parser.py && git commit -qam one"], id=TASK))
    assert commit.returncode == 0, commit.stderr
    done = await run(sandbox.wrap(["sh", "-c", "echo change >> parser.py"], id=TASK))
    assert done.returncode == 0, done.stderr
    dirty = await sandbox.cleanup(TASK)
    assert (dirty["removed"], dirty["dirty"]) == (False, True) and "parser.py" in dirty["detail"]
    assert os.path.isdir(workspace["host_path"])
    forced = await sandbox.cleanup(TASK, force=True)
    assert (forced["removed"], forced["dirty"]) == (True, True), forced
    assert not os.path.exists(workspace["host_path"])
    # The branch stays, with the committed work (not the uncommitted).
    assert git(repo, "log", "--format=%s", "-1", sandbox.branch_for(TASK)).strip() == "one"
    assert os.listdir(sandbox.state_directory / "sessions") == []
    again = await sandbox.cleanup(TASK)
    assert again["removed"] is False and again["detail"] == "nothing to clean up"
    # The same task id gets its branch back, with its commits.
    again_workspace = await sandbox.workspace(TASK)
    assert (Path(again_workspace["host_path"]) / "parser.py").read_text().endswith("one\n")


async def test_collect_never_overwrites_a_branch_moved_in_the_repository(repo, tmp_path):
    sandbox = adapters.worktree_sandbox(repo, root=tmp_path / "trees")
    await sandbox.workspace(TASK)
    commit = await run(sandbox.wrap(["sh", "-c", "echo one >> parser.py && git commit -qam one"], id=TASK))
    assert commit.returncode == 0, commit.stderr
    # Someone on the host moves the task's branch meanwhile.
    (repo / "other.txt").write_text("host work\n")
    git(repo, "add", "other.txt")
    git(repo, "commit", "-qm", "host work")
    branch = sandbox.branch_for(TASK)
    git(repo, "branch", "-f", branch, "main")
    moved = git(repo, "rev-parse", branch)
    await refused(ErrorCode.SANDBOX_STATE_MISMATCH, sandbox.collect(TASK))
    assert git(repo, "rev-parse", branch) == moved


async def test_stop_kills_a_running_command(repo, tmp_path):
    sandbox = adapters.namespace_sandbox(tmp_path / "tasks")
    await sandbox.workspace("long")
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            sandbox.wrap(["sh", "-c", "echo started; exec sleep 1000"], id="long"), stdout=subprocess.PIPE
        )
        nursery.cancel_scope.deadline = trio.current_time() + 20
        assert await process.stdout.receive_some(100) == b"started\n"
        # The running command holds the session's lease: another waits its turn.
        second = await run(sandbox.wrap(["true"], id="long"))
        assert second.returncode == 125 and b"is in use by process" in second.stderr, second.stderr
        await sandbox.stop("long")
        assert await process.wait() == 125
    assert not nursery.cancel_scope.cancelled_caught


async def test_namespace_sandbox_workspaces_and_cleanup(tmp_path):
    sandbox = adapters.namespace_sandbox(tmp_path / "tasks")
    workspace = await sandbox.workspace("t1")
    done = await run(sandbox.wrap(["sh", "-c", "echo result > out.txt"], id="t1"))
    assert done.returncode == 0, done.stderr
    assert (Path(workspace["host_path"]) / "out.txt").read_text() == "result\n"
    assert (await sandbox.cleanup("t1"))["removed"] is True
    assert not os.path.exists(workspace["host_path"])
    assert (await sandbox.cleanup("t1"))["removed"] is False


async def test_a_wrapped_command_runs_until_the_sandboxes_timeout(tmp_path):
    # A wrapped command is usually a whole agent run: a day by default, not
    # a tool call's 30 s, and what the host chose otherwise.
    default = adapters.namespace_sandbox(tmp_path / "default")
    await default.workspace("t")
    argv = default.wrap(["true"], id="t")
    assert argv[argv.index("--timeout") + 1] == repr(adapters.WRAPPED_TIMEOUT) == "86400.0"
    short = adapters.namespace_sandbox(tmp_path / "short", timeout=0.5)
    await short.workspace("t")
    done = await run(short.wrap(["sleep", "30"], id="t"))
    assert done.returncode == 124 and b"timed out after 0.5s" in done.stderr, done
    for bad in (0, -1, float("inf"), "1"):
        with pytest.raises(SandboxError) as error:
            adapters.namespace_sandbox(tmp_path / "bad", timeout=bad)
        assert error.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert not (tmp_path / "bad").exists()


def test_endpoints_exist_only_where_the_network_reaches_the_host(tmp_path):
    with pytest.raises(SandboxError) as error:
        adapters.namespace_sandbox(tmp_path / "a").endpoint_for(8080)
    assert error.value.code == ErrorCode.SANDBOX_POLICY_REFUSED
    assert adapters.namespace_sandbox(tmp_path / "b", network="allow-all").endpoint_for(8080) == "127.0.0.1:8080"


def test_worktrees_live_outside_the_repository(repo):
    with pytest.raises(SandboxError) as error:
        adapters.worktree_sandbox(repo, root=repo / "trees")
    assert error.value.code == ErrorCode.SANDBOX_PATH_REFUSED


async def test_collect_refuses_a_tree_git_would_refuse_from_a_remote(repo, tmp_path):
    # A ".." entry lets a later fetch or checkout reach outside the tree;
    # git tolerates it in a bundle unless told to check strictly.
    sandbox = adapters.worktree_sandbox(repo, root=tmp_path / "trees")
    await sandbox.workspace(TASK)
    branch = sandbox.branch_for(TASK)
    craft = (
        "blob=$(echo x | git hash-object -w --stdin) && "
        "inner=$(printf '100644 blob %s\\tfile\\n' $blob | git mktree) && "
        "outer=$(printf '040000 tree %s\\t..\\n' $inner | git mktree) && "
        f"commit=$(git commit-tree -p HEAD -m escape $outer) && git update-ref refs/heads/{branch} $commit"
    )
    done = await run(sandbox.wrap(["sh", "-c", craft], id=TASK))
    assert done.returncode == 0, done.stderr
    before = git(repo, "rev-parse", branch)
    with pytest.raises(SandboxError):
        await sandbox.collect(TASK)
    assert git(repo, "rev-parse", branch) == before


async def test_cleanup_removes_trees_nested_deeper_than_any_path(tmp_path):
    sandbox = adapters.namespace_sandbox(tmp_path / "tasks")
    workspace = await sandbox.workspace("deep")
    nest = (
        "import os\nfd = os.open('.', os.O_DIRECTORY)\nfor _ in range(3000):\n"
        "    os.mkdir('d', dir_fd=fd)\n    parent, fd = fd, os.open('d', os.O_DIRECTORY, dir_fd=fd)\n"
        "    os.close(parent)\n"
    )
    try:
        done = await run(sandbox.wrap(["python3", "-c", nest], id="deep"))
        assert done.returncode == 0, done.stderr
        assert (await sandbox.cleanup("deep"))["removed"] is True
        assert not os.path.exists(workspace["host_path"])
    finally:  # pytest's own clean-up of old runs would trip over it
        remove_tree(Path(workspace["host_path"]))
