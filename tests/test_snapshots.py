"""Snapshots and forks, on both drivers: what each fork's guest sees, file by
file, after each fork's own writes, deletes, renames and mode changes; the
store's durability and its dependencies."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import trio
import trio.testing
from conftest import refused

import sandboxns
import sandboxns._backend
from sandboxns import ErrorCode, Snapshot
from sandboxns._snapshots import MAX_STACK_DEPTH

pytestmark = pytest.mark.smoke

# Lists the guest's /workspace as {path: [kind, mode, content or target]}.
LIST = r"""
import json, os, stat
seen = {}
for root, directories, files in os.walk("/workspace"):
    for name in directories + files:
        path = os.path.join(root, name)
        info = os.lstat(path)
        relative = os.path.relpath(path, "/workspace")
        mode = oct(stat.S_IMODE(info.st_mode))
        if stat.S_ISLNK(info.st_mode):
            seen[relative] = ["link", os.readlink(path)]
        elif stat.S_ISDIR(info.st_mode):
            seen[relative] = ["dir", mode]
        else:
            with open(path) as f:
                seen[relative] = ["file", mode, f.read()]
print(json.dumps(seen))
"""


async def listing(handle) -> dict:
    result = await handle.session.run("python3", ["-c", LIST], max_output_bytes=16 << 20, timeout=60)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


async def sh(handle, script: str):
    result = await handle.session.run("sh", ["-c", script], timeout=60)
    assert result.exit_code == 0, result
    return result


class Model:
    """What a workspace should hold: {path: [kind, mode, content]}, as
    LIST reports it."""

    def __init__(self, files: dict[str, str], mode: str = "0o644") -> None:
        self.entries: dict[str, list] = {}
        for path, content in files.items():
            self.write(path, content, mode)

    def write(self, path: str, content: str, mode: str = "0o644") -> None:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            self.entries.setdefault("/".join(parts[:depth]), ["dir", "0o755"])
        previous = self.entries.get(path)
        self.entries[path] = ["file", previous[1] if previous else mode, content]

    def remove(self, path: str) -> None:
        for existing in [p for p in self.entries if p == path or p.startswith(path + "/")]:
            del self.entries[existing]

    def rename(self, source: str, target: str) -> None:
        for existing in sorted(p for p in self.entries if p == source or p.startswith(source + "/")):
            self.entries[target + existing[len(source) :]] = self.entries.pop(existing)

    def chmod(self, path: str, mode: str) -> None:
        self.entries[path][1] = mode

    def copy(self) -> Model:
        model = Model({})
        model.entries = {path: list(entry) for path, entry in self.entries.items()}
        return model


TEMPLATE = {f"t/d{d:02}/f{f:03}": f"template {d} {f}\n" for d in range(50) for f in range(100)}
# The session's own 5,000 files, written by one command.
WRITE_OWN = (
    "for d in $(seq -w 0 49); do mkdir -p s/d$d; for f in $(seq -w 0 99); do echo own $d $f > s/d$d/f$f; done; done"
)
OWN = {f"s/d{d:02}/f{f:02}": f"own {d:02} {f:02}\n" for d in range(50) for f in range(100)}


def diverge(i: int, model: Model) -> str:
    """Fork i's commands, applied to model as they are to its workspace."""
    model.write("t/d00/f000", f"fork {i}\n")  # a template file overwritten
    model.remove("t/d00/f001")  # a template file deleted: a whiteout
    model.remove("s/d00/f02")  # a file of the snapshot's own layer deleted
    model.rename("t/d01/f000", f"moved-{i}")  # a file renamed
    model.rename("s/d02", f"s/d02-moved-{i}")  # a directory of a lower layer renamed
    model.chmod("s/d03/f00", "0o600")
    model.chmod("t/d04/f000", "0o700")
    model.remove("t/d05")  # a directory deleted, and one made again in its place: opaque
    model.write("t/d05/only", f"only {i}\n")
    model.write(f"own-{i}", f"fork {i}\n")
    return (
        f"echo fork {i} > t/d00/f000; rm t/d00/f001 s/d00/f02; mv t/d01/f000 moved-{i};"
        f" mv s/d02 s/d02-moved-{i}; chmod 600 s/d03/f00; chmod 700 t/d04/f000;"
        f" rm -r t/d05; mkdir t/d05; echo only {i} > t/d05/only; echo fork {i} > own-{i}"
    )


async def test_forks_of_a_large_workspace_each_see_their_own_writes_and_nothing_else(backend):
    template = await backend.prewarm(template="big", files={p: c.encode() for p, c in TEMPLATE.items()})
    model = Model(TEMPLATE)
    for path, content in OWN.items():
        model.write(path, content)
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, WRITE_OWN)
        forks = await origin.fork(2)
        try:
            # The origin goes on over the snapshot: the forks see none of this.
            await sh(origin, "echo later > later; rm s/d09/f09")
            expected = [model.copy(), model.copy()]
            for i, fork in enumerate(forks):
                await sh(fork, diverge(i, expected[i]))
            for i, fork in enumerate(forks):
                assert await listing(fork) == expected[i].entries, f"fork {i}"
            model.write("later", "later\n")
            model.remove("s/d09/f09")
            assert await listing(origin) == model.entries
            # The host's file API sees each fork's own workspace too.
            assert await forks[1].session.read_file("moved-1") == b"template 1 0\n"
            await refused(ErrorCode.SANDBOX_NOT_FOUND, forks[0].session.read_file("t/d00/f001"))
        finally:
            for fork in forks:
                await fork.delete()


async def test_what_shuts_its_owner_out_is_snapshotted_all_the_same(backend):
    # A guest's chmod 000 on a directory (made new over a template's, so
    # opaque) and on a file: a copy, a flattening merge and a fork read them
    # all the same, and keep the modes (as a non-root host, CI's smoke run).
    template = await backend.prewarm(template="locked", files={"locked/old": b"template\n"})
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, "rm -r locked; mkdir -p locked/inner; echo x > locked/inner/file; echo s > secret")
        await sh(origin, "ln locked/inner/file linked; chmod 000 locked/inner locked secret")
        forks = [await backend.create(snapshot=await origin.snapshot()) for _ in range(2)]
        if backend.name == "native":  # and once more, merged whole
            while (snapshot := await origin.snapshot()).depth > 1:
                pass
            forks.append(await backend.create(snapshot=snapshot))
        for fork in forks:
            script = (
                "stat -c %a locked secret; chmod 700 locked locked/inner secret; ls -A locked;"
                " cat locked/inner/file secret; test locked/inner/file -ef linked && echo linked"
            )
            shown = await sh(fork, script)
            assert shown.stdout.split() == ["0", "0", "inner", "x", "s", "linked"], shown
            await fork.delete()


async def test_a_fork_stopped_and_resumed_keeps_its_files(backend):
    template = await backend.prewarm(template="resume", files={"a": b"template\n"})
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, "echo origin > b")
        [fork] = await origin.fork(1)
        await sh(fork, "echo fork > c; rm a")
        state = fork.capture_state()
        await fork.stop()
    assert state["template"] == template.template_key
    async with await backend.create(state=state, template=template.template_key) as resumed:
        assert (await sh(resumed, "ls; cat b c")).stdout.split() == ["b", "c", "origin", "fork"]
        await resumed.delete()


async def test_snapshots_stack_and_flatten_past_the_depth_limit(backend):
    template = await backend.prewarm(template="deep", files={"base": b"0\n"})
    model = Model({"base": "0\n"})
    async with await backend.create(template=template.template_key) as session:
        snapshots = []
        for step in range(MAX_STACK_DEPTH + 2):
            await sh(session, f"echo {step} > step-{step}; echo {step} > base; rm -f step-{step - 1}")
            model.write(f"step-{step}", f"{step}\n")
            model.write("base", f"{step}\n")
            model.remove(f"step-{step - 1}")
            snapshots.append(await session.snapshot(f"step {step}"))
        assert await listing(session) == model.entries
        depths = [snapshot.depth for snapshot in snapshots]
        assert max(depths) <= MAX_STACK_DEPTH
        if backend.name == "native":
            # Each snapshot a layer more, until the stack is merged into one.
            assert depths[:3] == [2, 3, 4] and 1 in depths, depths
        else:
            assert set(depths) == {1}  # always a whole copy
        # Every snapshot in the stack still gives its own workspace.
        fork = await backend.create(snapshot=snapshots[-1])
        assert await listing(fork) == model.entries
        early = await backend.create(snapshot=snapshots[0].to_dict())
        assert (await sh(early, "ls; cat base")).stdout.split() == ["base", "step-0", "0"]
        for handle in (fork, early):
            await handle.delete()
        await session.delete()


async def test_a_snapshot_survives_its_owner_being_killed(driver_name, state_dir):
    script = f"""
import json, sys, trio, sandboxns
async def main():
    async with sandboxns.open_backend(driver={driver_name!r}, state_directory={str(state_dir)!r}) as backend:
        handle = await backend.create(template=(await backend.prewarm(template="t", files={{"a": b"1"}})).template_key)
        await handle.session.write_file("b", b"2")
        snapshot = await handle.snapshot("kept")
        await handle.session.write_file("c", b"3")
        print(json.dumps([snapshot.to_dict(), handle.capture_state()]), flush=True)
        await trio.sleep_forever()
trio.run(main)
"""
    owner = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        snapshot_dict, state = json.loads(owner.stdout.readline())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        assert [snapshot.to_dict() for snapshot in await backend.snapshots()] == [
            {**snapshot_dict, "bytes": 1 if driver_name == "native" else 2}
        ]
        async with await backend.create(snapshot=Snapshot.from_dict(snapshot_dict)) as fork:
            assert (await sh(fork, "ls")).stdout.split() == ["a", "b"]
        async with await backend.create(state=state, template=state["template"]) as origin:
            assert (await sh(origin, "ls")).stdout.split() == ["a", "b", "c"]


async def test_deleting_sessions_never_deletes_a_layer_in_use(backend, state_dir):
    template = await backend.prewarm(template="deps", files={"a": b"1"})
    origin = await backend.create(template=template.template_key)
    first = await origin.snapshot()
    fork = await backend.create(snapshot=first)
    await sh(fork, "echo 2 > b")
    second = await fork.snapshot()
    stacked = backend.name == "native"
    for snapshot in (first, second):
        if stacked:
            await refused(ErrorCode.SANDBOX_BUSY, backend.delete_snapshot(snapshot))
    await origin.delete()
    await fork.delete()
    # The sessions are gone; the snapshots (and what a fork of one sees) are not.
    async with await backend.create(snapshot=second, destroy_on_close=True) as again:
        assert (await sh(again, "ls")).stdout.split() == ["a", "b"]
        if stacked:
            await refused(ErrorCode.SANDBOX_BUSY, backend.delete_snapshot(second.id))
    if stacked:  # the second one stands on the first
        await refused(ErrorCode.SANDBOX_BUSY, backend.delete_snapshot(first.id))
    await backend.delete_snapshot(second.id)
    await backend.delete_snapshot(first)
    assert await backend.snapshots() == []
    assert [p.name for p in (state_dir / "snapshots").iterdir()] == ["lock"]
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.delete_snapshot(first))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(snapshot=first))


async def test_a_snapshot_while_a_command_runs_is_refused_and_leaves_nothing(backend, state_dir):
    template = await backend.prewarm(template="busy", files={"a": b"1"})
    async with await backend.create(template=template.template_key) as handle:
        record = (state_dir / "sessions" / handle.session_id / "session.json").read_bytes()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.session.run, "sleep", ["30"])
            await trio.testing.wait_all_tasks_blocked()  # the command runs
            assert handle.session.running == 1
            await refused(ErrorCode.SANDBOX_BUSY, handle.snapshot())
            await refused(ErrorCode.SANDBOX_BUSY, handle.fork(2))
            nursery.cancel_scope.cancel()
        assert not list((state_dir / "snapshots").glob("[!l]*"))
        assert (state_dir / "sessions" / handle.session_id / "session.json").read_bytes() == record
        assert len(list((state_dir / "sessions").iterdir())) == 1


async def test_a_bound_session_is_snapshotted_only_by_copy(backend, tmp_path):
    bound = tmp_path / "bound"
    bound.mkdir()
    (bound / "mine").write_text("host\n")
    async with await backend.create(workspace=bound) as handle:
        error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.snapshot())
        assert "copy=True" in error.message
        snapshot = await handle.snapshot(copy=True)
        assert snapshot.template is None and snapshot.depth == 1
        async with await backend.create(snapshot=snapshot) as fork:
            await sh(fork, "echo fork > mine; echo new > other")
            assert (await sh(fork, "cat mine other")).stdout == "fork\nnew\n"
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.fork(1))
        [forked] = await handle.fork(1, copy=True)
        await sh(forked, "echo forked > mine")
        await forked.delete()
        assert sorted(p.name for p in bound.iterdir()) == ["mine"]
        assert (bound / "mine").read_text() == "host\n"


async def test_file_operations_and_coding_tools_wait_for_no_snapshot(backend):
    # While a snapshot has the session to itself, what would write through
    # its old upper layer (soon a layer of the snapshot) is refused.
    template = await backend.prewarm(template="busy-files", files={"a": b"1"})
    async with await backend.create(template=template.template_key) as handle:
        tools = await sandboxns.create_sandbox_coding_tools(handle.session, authorize=lambda operation: True)
        with handle.session.exclusive("a snapshot"):
            await refused(ErrorCode.SANDBOX_BUSY, handle.session.write_file("b", b"2"))
            await refused(ErrorCode.SANDBOX_BUSY, handle.session.run("true"))
            written = await tools.dispatch("write_file", {"path": "c", "content": "3"})
            assert written["error"] == "SANDBOX_BUSY", written
        assert "error" not in await tools.dispatch("write_file", {"path": "c", "content": "3"})
        assert (await sh(handle, "ls")).stdout.split() == ["a", "c"]


async def test_bad_snapshot_arguments_are_refused(backend):
    template = await backend.prewarm(template="bad", files={"a": b"1"})
    async with await backend.create(template=template.template_key) as handle:
        for bad in ("", "x" * 300, 7, "line\nbreak"):
            await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.snapshot(bad))
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.snapshot(copy="yes"))
        for n in (0, -1, True, 2.0, 10**6):
            await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.fork(n))
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, handle.fork(1, network="sometimes"))
        snapshot = await handle.snapshot()
        for bad in ("../../etc", {"id": snapshot.id}, 5):
            await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(snapshot=bad))
        await refused(
            ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(snapshot=snapshot, template=template.template_key)
        )
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.delete_snapshot("nope"))
    await refused(ErrorCode.SANDBOX_STOPPED, handle.snapshot())


async def test_another_backends_snapshot_is_refused(driver_name, state_dir):
    other = "bwrap" if driver_name == "native" else "native"
    async with sandboxns.open_backend(driver=other, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="x", files={"a": b"1"})
        async with await backend.create(template=template.template_key) as handle:
            snapshot = await handle.snapshot()
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        await refused(ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(snapshot=snapshot))


@pytest.mark.parametrize(
    "crashed_at",
    ["before the move", "after the new upper was made", "after the move", "after the commit", "after the rename"],
)
async def test_a_snapshot_its_owner_died_taking_is_finished_or_undone(state_dir, crashed_at):
    # The states a process dying while it takes a snapshot leaves (between
    # _begin_freeze and _finish_freeze, or inside them), made by hand from a
    # real session: the next attach finishes or undoes each.
    async with sandboxns.open_backend(driver="native", state_directory=state_dir) as backend:
        template = await backend.prewarm(template="crash", files={"a": b"1"})
        handle = await backend.create(template=template.template_key)
        await sh(handle, "echo 2 > b")
        state = handle.capture_state()
        await handle.stop()
    session = state_dir / "sessions" / state["session"]
    record = json.loads((session / "session.json").read_text())
    pending = "ab" * 16
    record["pending_snapshot"] = pending
    (session / "session.json").write_text(json.dumps(record))
    staging = state_dir / "snapshots" / f".new-{pending}"
    staging.mkdir(parents=True)
    snapshot = {
        "format": 1, "id": pending, "name": None, "parent": None, "created": 1.0, "bytes": None,
        "backend": "native", "template": template.template_key, "layers": [pending], "on_template": True,
    }  # fmt: skip
    (staging / "snapshot.json").write_text(json.dumps(snapshot))
    finished = crashed_at not in ("before the move", "after the new upper was made")
    if crashed_at != "before the move":
        (session / "workspace.next").mkdir()
        (session / "overlay-work.next").mkdir()
    if finished:
        os.rename(session / "workspace", staging / "files")
    if crashed_at in ("after the commit", "after the rename"):
        os.rename(staging, state_dir / "snapshots" / pending)
    if crashed_at == "after the commit":  # a copy off an image leaves the emptied upper (here, not quite)
        (session / "workspace").mkdir()
        (session / "workspace" / "b").write_text("2\n")
    if crashed_at == "after the rename":
        os.rename(session / "workspace.next", session / "workspace")
    async with (
        sandboxns.open_backend(driver="native", state_directory=state_dir) as backend,
        await backend.create(state=state, template=template.template_key) as resumed,
    ):
        assert (await sh(resumed, "ls; cat b")).stdout.split() == ["a", "b", "2"]
        listed = [snapshot.id for snapshot in await backend.snapshots()]
        assert listed == ([pending] if finished else [])
        record = json.loads((session / "session.json").read_text())
        assert "pending_snapshot" not in record and record.get("layers", []) == ([pending] if finished else [])
        assert sorted(p.name for p in (session / "workspace").iterdir()) == ([] if finished else ["b"])
        assert not staging.exists()
        assert not (session / "workspace.next").exists() and not (session / "overlay-work.next").exists()


async def test_the_cli_lists_and_deletes_snapshots(backend, state_dir):
    template = await backend.prewarm(template="cli", files={"a": b"1"})
    async with await backend.create(template=template.template_key) as handle:
        snapshot = await handle.snapshot("named")

    def cli(*arguments: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-P", "-m", "sandboxns", "snapshot", *arguments, "--state-dir", str(state_dir)]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    listed = await trio.to_thread.run_sync(cli, "list")
    assert listed.returncode == 0 and snapshot.id in listed.stdout and "named" in listed.stdout, listed
    as_json = await trio.to_thread.run_sync(cli, "list", "--json")
    assert [entry["id"] for entry in json.loads(as_json.stdout)] == [snapshot.id]
    if backend.name == "native":  # the session stands on it
        busy = await trio.to_thread.run_sync(cli, "delete", snapshot.id)
        assert busy.returncode != 0 and f"snapshot {snapshot.id} is a layer of session" in busy.stderr, busy
        await (await backend.create(state=handle.capture_state(), template=template.template_key)).delete()
    deleted = await trio.to_thread.run_sync(cli, "delete", snapshot.id)
    assert deleted.returncode == 0, deleted
    assert (await trio.to_thread.run_sync(cli, "list")).stdout.strip() == ""
    missing = await trio.to_thread.run_sync(cli, "delete", snapshot.id)
    assert missing.returncode != 0 and f"no snapshot {snapshot.id}" in missing.stderr


async def test_a_fork_that_cannot_be_made_whole_leaves_no_fork(backend, state_dir):
    # A session that cannot start: the host path of a mount is gone by then
    # (the origin goes on: its holder takes the snapshot's layers in place).
    template = await backend.prewarm(template="half", files={"a": b"1"})
    gone = state_dir.parent / "gone"
    gone.mkdir()
    async with await backend.create(
        template=template.template_key, mounts=[sandboxns.Mount(host=str(gone), guest="/run/gone")]
    ) as origin:
        gone.rmdir()
        error = await refused(ErrorCode.SANDBOX_NOT_FOUND, origin.fork(4))
        assert "gone" in error.message, error
        if backend.name == "native":  # (bwrap binds the mounts again for each command)
            assert (await origin.session.run("ls", ["/workspace"])).stdout == "a\n"
        assert [p.name for p in (state_dir / "sessions").iterdir()] == [origin.session_id]
        assert len(await backend.snapshots()) == 1  # the origin's, which it stands on


async def test_what_a_dead_maker_left_in_the_store_goes_at_the_next_open(driver_name, state_dir):
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        template = await backend.prewarm(template="leftovers", files={"a": b"1"})
        async with await backend.create(template=template.template_key) as handle:
            kept = await handle.snapshot()
    store = state_dir / "snapshots"
    for leftover in (f".new-{'cd' * 16}/files/x", f".deleted-{'ef' * 16}-0000/files/y"):
        (store / leftover).parent.mkdir(parents=True)
        (store / leftover).write_text("partial")
    async with sandboxns.open_backend(driver=driver_name, state_directory=state_dir) as backend:
        assert sorted(p.name for p in store.iterdir()) == sorted([kept.id, "lock"])
        assert [snapshot.id for snapshot in await backend.snapshots()] == [kept.id]


async def test_a_bound_workspace_that_now_leads_elsewhere_is_not_copied(backend, tmp_path):
    bound, elsewhere = tmp_path / "bound", tmp_path / "elsewhere"
    bound.mkdir()
    elsewhere.mkdir()
    (elsewhere / "private").write_text("not the session's")
    async with await backend.create(workspace=bound) as handle:
        bound.rename(tmp_path / "moved")
        bound.symlink_to(elsewhere)
        await refused(ErrorCode.SANDBOX_PATH_REFUSED, handle.snapshot(copy=True))
    assert not [p for p in (backend.state_directory / "snapshots").iterdir() if p.name != "lock"]


async def test_forks_from_the_pool_are_whole_sessions_of_the_snapshot(backend):
    if backend.name == "bwrap":
        await refused(ErrorCode.SANDBOX_UNAVAILABLE, backend.pool_forks(size=2))
        return
    template = await backend.prewarm(template="pooled", files={"a": b"template\n", "gone": b"x"})
    await backend.pool_forks(size=2)
    pooled = {handle.session_id for handle in backend._pools.waiting("forks")}
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, "echo origin > b; rm gone")
        forks = await origin.fork(3)  # two from the pool, one started afresh
        try:
            assert len(pooled & {fork.session_id for fork in forks}) == 2
            for i, fork in enumerate(forks):
                await sh(fork, f"echo {i} > mine")
            for i, fork in enumerate(forks):
                assert (await sh(fork, "ls; cat a b mine")).stdout.split() == [
                    "a",
                    "b",
                    "mine",
                    "template",
                    "origin",
                    str(i),
                ]
                assert fork.template_key == template.template_key
            # A new network namespace is a new holder: it stands on the snapshot too.
            await forks[0].session.set_network_policy("allow-all")
            assert (await sh(forks[0], "cat mine b")).stdout == "0\norigin\n"
            # Stopped and resumed, a pooled fork is the snapshot's.
            state = forks[1].capture_state()
            await forks[1].stop()
            async with await backend.create(state=state, template=state["template"]) as resumed:
                assert (await sh(resumed, "ls; cat mine")).stdout.split() == ["a", "b", "mine", "1"]
            # A pooled fork's snapshot: its blank directories go with it.
            [grandchild] = await forks[2].fork(1)
            assert (await sh(grandchild, "cat mine")).stdout == "2\n"
            storage = backend.state_directory / "sessions" / forks[2].session_id
            # (The old overlay's work directory goes with the next snapshot.)
            assert sorted(p.name for p in storage.iterdir() if p.is_dir()) == [
                "overlay-work",
                "overlay-work.old",
                "workspace",
            ]
            await grandchild.delete()
        finally:
            for fork in forks:
                await fork.delete()
    await backend.pool_forks(size=0)  # the pool's refills go
    assert [p.name for p in (backend.state_directory / "sessions").iterdir()] == [origin.session_id]


async def test_a_snapshot_cancelled_once_its_layer_is_stored_still_moves_the_session_off_it(backend, monkeypatch):
    # The host puts the upper layer in the store before the holder goes over
    # to the new stack: a cancel arriving in between must not leave the
    # session writing into the snapshot.
    if backend.name != "native" or not backend._overlay:
        pytest.skip("an overlay workspace's snapshot")
    template = await backend.prewarm(template="cancelled", files={"a": b"1\n"})
    async with await backend.create(template=template.template_key) as origin:
        await sh(origin, "echo before > b")
        freeze = type(backend)._freeze
        with trio.CancelScope() as scope:

            def freeze_then_cancel(self, *args):
                freeze(self, *args)
                trio.from_thread.run_sync(scope.cancel)

            monkeypatch.setattr(type(backend), "_freeze", freeze_then_cancel)
            await origin.snapshot()
        monkeypatch.undo()
        await sh(origin, "echo after > b; echo new > c")
        [snapshot] = await backend.snapshots()
        async with await backend.create(snapshot=snapshot) as fork:
            assert (await sh(fork, "ls; cat b")).stdout.split() == ["a", "b", "before"]


async def test_pooled_forks_take_the_lifetime_they_are_given(backend):
    if backend.name != "native" or not backend._overlay:
        pytest.skip("the fork pool needs the native driver's overlays")
    template = await backend.prewarm(template="lifetime", files={})
    await backend.pool_forks(size=1)
    pooled = {handle.session_id for handle in backend._pools.waiting("forks")}
    async with await backend.create(template=template.template_key) as origin:
        [fork] = await origin.fork(1, retention=60, destroy_on_close=True, idle_timeout=600)
        assert fork.session_id in pooled
        assert (fork.retention, fork.destroy_on_close) == (60, True)
        stored = json.loads((backend.state_directory / "sessions" / fork.session_id / "session.json").read_text())
        assert stored["retention"] == 60
        await fork.aclose()  # destroy_on_close: gone
        assert not (backend.state_directory / "sessions" / fork.session_id).exists()
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, origin.fork(1, retention=-1))
    assert len(await backend.snapshots()) == 1  # the refused fork took no snapshot


async def test_a_session_not_settled_on_its_stored_snapshot_stops_and_settles_at_the_next_attach(backend, monkeypatch):
    if backend.name != "native" or not backend._overlay:
        pytest.skip("an overlay workspace's snapshot")
    settle = type(backend)._settle_snapshot_locked

    def settle_then_fail(self, session_dir, description, storage):
        settle(self, session_dir, description, storage)
        raise OSError(errno.EIO, "the record could not be written")

    template = await backend.prewarm(template="unsettled", files={"a": b"1\n"})
    origin = await backend.create(template=template.template_key)
    await sh(origin, "echo before > b")
    monkeypatch.setattr(type(backend), "_settle_snapshot_locked", settle_then_fail)
    with pytest.raises(OSError):
        await origin.snapshot()
    monkeypatch.undo()
    # Stopped and released: nothing it runs could write into the stored layer.
    await refused(ErrorCode.SANDBOX_STOPPED, origin.session.run("true", []))
    await origin.wait_closed()
    [snapshot] = await backend.snapshots()
    async with await backend.create(state=origin.capture_state(), template=template.template_key) as resumed:
        assert (await sh(resumed, "cat b; echo after > b; echo new > c; cat b")).stdout == "before\nafter\n"
        async with await backend.create(snapshot=snapshot) as fork:
            assert (await sh(fork, "ls; cat b")).stdout.split() == ["a", "b", "before"]
        stored = json.loads((backend.state_directory / "sessions" / resumed.session_id / "session.json").read_text())
        assert stored["layers"][0] == snapshot.id and "pending_snapshot" not in stored
        await resumed.delete()


async def test_a_flattening_snapshot_that_fails_over_its_copy_stops_the_session(backend, monkeypatch):
    if backend.name != "native" or not backend._overlay:
        pytest.skip("an overlay workspace's stack")
    monkeypatch.setattr(sandboxns._backend, "MAX_STACK_DEPTH", 2)  # the second snapshot flattens
    empty = sandboxns._backend._empty_upper

    def empty_then_fail(upper, layer):
        empty(upper, layer)
        raise OSError(errno.EIO, "the upper layer could not be made again")

    template = await backend.prewarm(template="flatten-fails", files={"a": b"1\n"})
    origin = await backend.create(template=template.template_key)
    await sh(origin, "echo one > b")
    await origin.snapshot()
    await sh(origin, "echo two > c")
    monkeypatch.setattr(sandboxns._backend, "_empty_upper", empty_then_fail)
    with pytest.raises(OSError):
        await origin.snapshot()
    monkeypatch.setattr(sandboxns._backend, "_empty_upper", empty)
    await refused(ErrorCode.SANDBOX_STOPPED, origin.session.run("true", []))
    async with await backend.create(state=origin.capture_state(), template=template.template_key) as resumed:
        assert (await sh(resumed, "ls; cat b c")).stdout.split() == ["a", "b", "c", "one", "two"]
        await resumed.delete()
