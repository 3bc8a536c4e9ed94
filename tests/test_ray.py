"""sandboxns.ray on a real local Ray cluster of three nodes (each a raylet of
its own, declaring the sandboxns resource), on this one machine: placement,
admission per node, templates on every node, resuming where the files are,
a node that dies mid-run, and credentials kept out of Ray's files.

Run when ray is installed; CI installs it (SANDBOXNS_REQUIRE_RAY=1 makes a
missing ray fail instead of skip)."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import trio
from conftest import refused
from oci_images import busybox_layout

import sandboxns
from sandboxns import ErrorCode

if os.environ.get("SANDBOXNS_REQUIRE_RAY"):
    import ray
else:
    ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster

import sandboxns._channel
import sandboxns.ray

# A node that dies is noticed within about half a second.
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}
NODE = {"num_cpus": 1, "resources": {sandboxns.ray.RESOURCE: 1}}


@pytest.fixture(scope="module")
def ray_cluster():
    """Three nodes (the head and two workers); Ray's own files in a
    directory of their own (short: Ray's Unix sockets are in it)."""
    ray_files = Path(tempfile.mkdtemp(prefix="sbxray-", dir="/tmp"))
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(ray_files)
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**NODE, "include_dashboard": False, "_system_config": FAST_FAILURE_DETECTION},
        )
        try:
            workers = [cluster.add_node(**NODE) for _ in range(2)]
            cluster.wait_for_nodes()
            # Ray puts the driver's working directory on its workers' paths:
            # here that is this checkout, whose sandboxns is not built.
            with contextlib.chdir(ray_files):
                ray.init(address=cluster.address)
            yield cluster, workers, ray_files
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(ray_files, ignore_errors=True)


@pytest.fixture
async def cluster(ray_cluster, tmp_path):
    opened = await sandboxns.ray.open_cluster(state_directory=str(tmp_path / "{node_id}"))
    async with opened:
        yield opened


async def started(handle) -> None:
    """Until the command the test started in ``handle`` has made its mark."""
    with trio.fail_after(30):
        while "started" not in [entry.name for entry in await handle.session.list_dir(".")]:
            await trio.sleep(0.05)


async def sh(handle, script: str):
    result = await handle.session.run("sh", ["-c", script], timeout=60)
    assert result.exit_code == 0, result
    return result


async def test_sessions_spread_over_the_nodes_each_isolated(cluster):
    assert len(cluster.nodes) == 3
    template = await cluster.prewarm(template="spread", files={"a.txt": b"template\n"})
    handles = [await cluster.create(template=template.template_key) for _ in range(6)]
    try:
        by_node = {}
        for handle in handles:
            by_node.setdefault(handle.node, []).append(handle)
        assert sorted(len(on_node) for on_node in by_node.values()) == [2, 2, 2]
        for index, handle in enumerate(handles):
            await handle.session.write_file("mine", f"{index}\n".encode())
        for index, handle in enumerate(handles):
            assert (await sh(handle, "cat a.txt mine; ls")).stdout == f"template\n{index}\na.txt\nmine\n"
            assert await handle.session.read_file("mine") == f"{index}\n".encode()
        names = [entry.name for entry in await handles[0].session.list_dir(".")]
        assert sorted(names) == ["a.txt", "mine"]
        # Each node has its own backend and state directory.
        assert len({(await cluster._call(node, "describe"))[1] for node in cluster.nodes}) == 3
    finally:
        for handle in handles:
            await handle.delete()


async def test_a_template_is_on_every_node_and_a_session_goes_where_asked(cluster):
    template = await cluster.prewarm(template="everywhere", files={"t": b"same\n"})
    for node in cluster.nodes:
        async with await cluster.create(template=template.template_key, node=node) as handle:
            assert handle.node == node
            assert (await sh(handle, "cat t")).stdout == "same\n"
    await refused(ErrorCode.SANDBOX_NOT_FOUND, cluster.create(template=template.template_key, node="f" * 56))


async def test_an_image_imported_on_every_node_is_the_root_of_sessions_anywhere(cluster, tmp_path):
    busybox_layout(tmp_path / "busybox")
    image = await cluster.import_image(tmp_path / "busybox")
    template = await cluster.prewarm(template="on-image", files={}, image=image.digest)
    for node in cluster.nodes:
        async with await cluster.create(template=template.template_key, node=node) as handle:
            assert (await sh(handle, "cat /etc/os-release; echo $GREETING")).stdout == (
                "ID=sandboxns-busybox\nfrom the image\n"
            )


async def test_a_session_resumes_only_on_its_own_node(cluster):
    template = await cluster.prewarm(template="resume", files={})
    handle = await cluster.create(template=template.template_key)
    await sh(handle, "echo kept > f")
    state = handle.capture_state()
    assert state["node"] == handle.node
    await handle.stop()
    elsewhere = next(node for node in cluster.nodes if node != handle.node)
    await refused(
        ErrorCode.SANDBOX_STATE_MISMATCH,
        cluster.create(state=state, template=template.template_key, node=elsewhere),
    )
    async with await cluster.create(state=state, template=template.template_key) as resumed:
        assert resumed.node == handle.node
        assert (await sh(resumed, "cat f")).stdout == "kept\n"
        await resumed.delete()


async def test_snapshots_and_forks_stay_on_their_node(cluster):
    template = await cluster.prewarm(template="forks", files={})
    async with await cluster.create(template=template.template_key) as origin:
        await sh(origin, "echo origin > f")
        forks = await origin.fork(2)
        try:
            for index, fork in enumerate(forks):
                assert fork.node == origin.node
                await sh(fork, f"echo {index} >> f")
            for index, fork in enumerate(forks):
                assert (await sh(fork, "cat f")).stdout == f"origin\n{index}\n"
            snapshot = await origin.snapshot(name="later")
            assert snapshot.name == "later"
        finally:
            for fork in forks:
                await fork.delete()
        await origin.delete()


async def test_errors_come_back_as_sandbox_errors(cluster):
    template = await cluster.prewarm(template="errors", files={})
    async with await cluster.create(template=template.template_key) as handle:
        await refused(ErrorCode.SANDBOX_NOT_FOUND, handle.session.read_file("missing"))
        await refused(ErrorCode.SANDBOX_PATH_REFUSED, handle.session.read_file("../../etc/passwd"))
        await handle.delete()
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, cluster.create(template="not a key"))


async def test_a_full_cluster_refuses_a_new_session_rather_than_queue(ray_cluster, tmp_path):
    cluster = await sandboxns.ray.open_cluster(state_directory=str(tmp_path / "{node_id}"), max_concurrent_commands=1)
    async with cluster:
        template = await cluster.prewarm(template="full", files={})
        handles = [await cluster.create(template=template.template_key, node=node) for node in cluster.nodes]

        async def busy(handle) -> None:  # until the session is deleted under it
            await refused(ErrorCode.SANDBOX_STOPPED, handle.session.run("sh", ["-c", "touch started; exec sleep 60"]))

        async with trio.open_nursery() as nursery:
            for handle in handles:
                nursery.start_soon(busy, handle)
            for handle in handles:  # each node's one admission slot taken
                await started(handle)
            await refused(ErrorCode.SANDBOX_BUSY, cluster.create(template=template.template_key))
            # Per node: a second command on a full node is refused there too.
            await refused(ErrorCode.SANDBOX_BUSY, handles[0].session.run("true"))
            for handle in handles:
                await handle.delete()  # kills the sleeps


async def test_a_node_that_dies_fails_its_sessions_fast_and_the_others_go_on(ray_cluster, tmp_path):
    cluster_utils, _, _ = ray_cluster
    doomed = cluster_utils.add_node(**NODE)
    cluster_utils.wait_for_nodes()
    cluster = await sandboxns.ray.open_cluster(state_directory=str(tmp_path / "{node_id}"))
    async with cluster:
        assert doomed.node_id in cluster.nodes
        template = await cluster.prewarm(template="dies", files={})
        victim = await cluster.create(template=template.template_key, node=doomed.node_id)
        survivor = await cluster.create(template=template.template_key)
        assert survivor.node != doomed.node_id
        async with trio.open_nursery() as nursery:

            async def pending() -> None:
                with trio.fail_after(20):
                    error = await refused(
                        ErrorCode.SANDBOX_UNAVAILABLE,
                        victim.session.run("sh", ["-c", "touch started; exec sleep 60"]),
                    )
                assert doomed.node_id in error.message

            nursery.start_soon(pending)
            await started(victim)
            cluster_utils.remove_node(doomed, allow_graceful=False)
        with trio.fail_after(20):
            await refused(ErrorCode.SANDBOX_UNAVAILABLE, victim.session.read_file("x"))
        assert (await sh(survivor, "echo alive")).stdout == "alive\n"
        await cluster.refresh()
        assert doomed.node_id not in cluster.nodes
        for _ in range(4):
            async with await cluster.create(template=template.template_key) as handle:
                assert handle.node != doomed.node_id
                await handle.delete()
        await survivor.delete()
        for node in cluster.nodes:  # nothing left behind on the others
            running, live, _ = await cluster._call(node, "load")
            assert (running, live) == (0, 0)
            sessions = tmp_path / node / "sessions"
            assert not sessions.exists() or list(sessions.iterdir()) == []


async def test_a_node_that_joins_later_gets_a_backend(ray_cluster, tmp_path):
    cluster_utils, _, _ = ray_cluster
    cluster = await sandboxns.ray.open_cluster(state_directory=str(tmp_path / "{node_id}"))
    async with cluster:
        template = await cluster.prewarm(template="joins", files={"t": b"here\n"})
        newcomer = cluster_utils.add_node(**NODE)
        try:
            cluster_utils.wait_for_nodes()
            assert newcomer.node_id not in cluster.nodes
            await cluster.refresh()  # as the next placement would, within a second
            assert newcomer.node_id in cluster.nodes
            # Templates are made where sessions are; prewarming again adds it there.
            await cluster.prewarm(template="joins", files={"t": b"here\n"})
            async with await cluster.create(template=template.template_key, node=newcomer.node_id) as handle:
                assert (await sh(handle, "cat t")).stdout == "here\n"
                await handle.delete()
        finally:
            cluster_utils.remove_node(newcomer, allow_graceful=True)


async def test_coding_tools_on_a_remote_session_ask_the_callers_hooks(cluster):
    template = await cluster.prewarm(template="coding", files={"src/app.py": b"print('hello')\n"})
    asked = []

    def authorize(operation) -> bool:  # runs here, in the caller's process
        asked.append((operation.kind, getattr(operation, "path", None)))
        return getattr(operation, "path", None) != "/workspace/denied.txt"

    async with await cluster.create(template=template.template_key) as handle:
        tools = await sandboxns.create_sandbox_coding_tools(handle, authorize=authorize)

        async def call(name: str, **arguments) -> dict:
            result = await tools.dispatch(name, arguments)
            assert "error" not in result or name == "write_file", result
            return result

        read = await call("read_file", path="src/app.py")
        assert read["text"] == "print('hello')\n"
        edit = await call("edit_file", path="src/app.py", old_text="hello", new_text="remote",
                          expected_sha256=read["sha256"])  # fmt: skip
        assert edit["replacements"] == 1
        assert (await call("write_file", path="notes/new.txt", content="x"))["created_directories"] == [
            "/workspace/notes"
        ]
        assert (await call("write_file", path="denied.txt", content="no"))["error"] == "FORBIDDEN"
        found = await call("search_files", query="rem.te", regex=True)
        assert [match["path"] for match in found["matches"]] == ["/workspace/src/app.py"]
        assert (await call("glob", pattern="**/*.txt"))["matches"] == ["/workspace/notes/new.txt"]
        listed = await call("list_directory", path=".")
        assert [entry["name"] for entry in listed["entries"]] == ["notes", "src"]
        ran = await call("run_command", executable="shell",
                         args=["-c", "cat src/app.py; test -e denied.txt || echo absent; seq 100000"])  # fmt: skip
        assert ran["exit_code"] == 0 and ran["stdout"].startswith("print('remote')\nabsent\n1\n")
        # Long output stays with the tools, on this side, to page through.
        paged = await call("search_output", reference=ran["artifact"]["reference"], query="99999")
        assert [match["text"] for match in paged["matches"]] == ["99999"]
        # What the tools did is in the session on its node.
        assert await handle.session.read_file("src/app.py") == b"print('remote')\n"
        assert ("write", "/workspace/denied.txt") in asked and ("shell", None) in asked
        await handle.stop()
        assert (await tools.dispatch("read_file", {"path": "src/app.py"}))["error"] == "SANDBOX_STOPPED"
        await handle.delete()


@pytest.mark.parametrize("path", ["channel", "ray"])
async def test_cancelling_a_remote_command_ends_it_on_its_node(cluster, path):
    template = await cluster.prewarm(template="cancel", files={})
    async with await cluster.create(template=template.template_key) as handle:

        async def cancel_a_command() -> None:
            async with trio.open_nursery() as nursery:

                async def long_command() -> None:
                    await handle.session.run("sh", ["-c", "touch started; sleep 60; touch finished"], timeout=120)
                    raise AssertionError("the command ran to its end")

                nursery.start_soon(long_command)
                await started(handle)
                nursery.cancel_scope.cancel()

        if path == "channel":  # the trio run that opened the cluster
            await cancel_a_command()
        else:  # any other trio run's calls are Ray calls
            await trio.to_thread.run_sync(trio.run, cancel_a_command)
        # Like a local cancellation: the command's tree is gone once the
        # cancelled call has returned, and its slot is free.
        running, _, _ = await cluster._call(handle.node, "load")
        assert running == 0
        assert (await sh(handle, "ls; ps -e -o comm= | grep -c sleep || true")).stdout == "started\n0\n"
        await handle.delete()


async def test_a_caller_whose_connection_drops_has_its_commands_ended(cluster):
    template = await cluster.prewarm(template="drops", files={})
    async with await cluster.create(template=template.template_key) as handle:
        async with trio.open_nursery() as nursery:

            async def long_command() -> None:
                error = await refused(
                    ErrorCode.SANDBOX_UNAVAILABLE, handle.session.run("sh", ["-c", "touch started; sleep 60"])
                )
                assert "connection" in error.message and handle.node in error.message

            nursery.start_soon(long_command)
            await started(handle)
            await handle._backend.channel.aclose()
        with trio.fail_after(10):  # the node ends what the caller can no longer wait for
            while (await cluster._call(handle.node, "load"))[0]:
                await trio.sleep(0.05)
        assert (await sh(handle, "ps -e -o comm= | grep -c sleep || true")).stdout == "0\n"  # a new channel
        await handle.delete()


class _Planted:
    """Unpickled, makes a directory: what an unauthenticated peer must never get."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


@pytest.mark.parametrize("token", ["wrong", "too long", "none"])
async def test_a_channel_without_the_token_unpickles_nothing(cluster, tmp_path, token):
    host, port, right = await cluster._call(cluster.nodes[0], "channel")
    planted = tmp_path / "planted"
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        presented = {"wrong": bytes(len(right)), "too long": right + b"x", "none": b""}[token]
        frames = [presented] if presented else []
        frames.append(pickle.dumps((0, "session_call", (_Planted(planted),))))
        await stream.send_all(b"".join(map(framed, frames)))
        with trio.fail_after(20):  # closed on us (a missing token: after the handshake time)
            while await stream.receive_some():
                pass
    assert not planted.exists()


def framed(payload: bytes) -> bytes:
    """A frame of the channel's protocol."""
    return len(payload).to_bytes(sandboxns._channel.HEADER_BYTES, "big") + payload


async def raw_channel(cluster, node: str):
    """An authenticated connection to a node's channel, spoken by hand."""
    host, port, token = await cluster._call(node, "channel")
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(framed(token))
    return stream


async def reply(stream) -> tuple:
    """The next answer on a raw channel (within 10 s)."""
    header = sandboxns._channel.HEADER_BYTES
    received = b""
    with trio.fail_after(10):
        while len(received) < header or len(received) < header + int.from_bytes(received[:header], "big"):
            received += await stream.receive_some()
    return pickle.loads(received[header:])


async def test_nothing_a_peer_sends_stops_the_backend(cluster):
    node = cluster.nodes[0]
    template = await cluster.prewarm(template="peers", files={})
    handle = await cluster.create(template=template.template_key, node=node)
    host, port, _ = await cluster._call(node, "channel")
    # A port scan's connection: one byte, then a reset.
    scan = socket.create_connection((host, port))
    scan.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    scan.send(b"x")
    scan.close()
    # An authenticated peer sending garbage: its connection ends.
    for payload in (b"not a pickle", pickle.dumps("no tuple")):
        async with await raw_channel(cluster, node) as stream:
            await stream.send_all(framed(payload))
            with trio.fail_after(20):
                while await stream.receive_some():
                    pass
    # A call of no method: refused, and the connection serves on.
    async with await raw_channel(cluster, node) as stream:
        await stream.send_all(framed(pickle.dumps((1, "no such call", ()))))
        call_id, failed, outcome = await reply(stream)
        assert (call_id, failed, outcome.code) == (1, True, ErrorCode.SANDBOX_INVALID_ARGUMENT)
        await stream.send_all(framed(pickle.dumps((2, "session_call", (handle.session_id, "read_file", ("x",), {})))))
        assert (await reply(stream))[2].code == ErrorCode.SANDBOX_NOT_FOUND
    # Too many connections waiting to authenticate: the extra one is closed.
    waiting = [await trio.open_tcp_stream(host, port) for _ in range(sandboxns._channel.PENDING_HANDSHAKES)]
    async with await trio.open_tcp_stream(host, port) as extra:
        with trio.fail_after(5):
            assert await extra.receive_some() == b""
    for stream in waiting:
        await stream.aclose()
    # The backend serves on, its session and new ones alike.
    assert (await sh(handle, "echo alive")).stdout == "alive\n"
    async with await cluster.create(template=template.template_key, node=node) as other:
        assert (await sh(other, "echo fresh")).stdout == "fresh\n"
        await other.delete()
    await handle.delete()


async def test_a_cancel_right_behind_its_call_is_not_lost(cluster):
    template = await cluster.prewarm(template="prompt-cancel", files={})
    async with await cluster.create(template=template.template_key) as handle:
        call = (7, "session_call", (handle.session_id, "run", ("sleep", ["30"]), {}))
        async with await raw_channel(cluster, handle.node) as stream:
            # The call and its cancel in one segment: read in one go.
            await stream.send_all(framed(pickle.dumps(call)) + framed(pickle.dumps((7, "cancel", ()))))
            call_id, failed, outcome = await reply(stream)
        assert (call_id, failed, outcome.code) == (7, True, ErrorCode.SANDBOX_STOPPED)
        await handle.delete()


async def test_output_of_any_size_comes_back(cluster):
    template = await cluster.prewarm(template="large", files={})
    async with await cluster.create(template=template.template_key) as handle:
        size = 70 * 1024 * 1024  # over any frame size a channel might have fixed
        result = await handle.session.run("head", ["-c", str(size), "/dev/zero"], max_output_bytes=size)
        assert len(result.stdout_bytes) == size and not result.truncated
        await handle.delete()


async def test_pools_on_every_node_serve_creates(cluster, tmp_path):
    template = await cluster.prewarm(template="pooled", files={"p": b"pool\n"})
    await cluster.pool(template=template.template_key, size_per_node=2)
    waiting = {node: {path.name for path in (tmp_path / node / "sessions").iterdir()} for node in cluster.nodes}
    assert [len(sessions) for sessions in waiting.values()] == [2, 2, 2]
    for node in cluster.nodes:
        async with await cluster.create(template=template.template_key, node=node) as handle:
            assert handle.session_id in waiting[node]  # one that was waiting
            assert (await sh(handle, "cat p")).stdout == "pool\n"
            await handle.delete()
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, cluster.pool(template=template.template_key, size_per_node=-1))


async def test_a_backend_that_dies_is_started_again_and_its_sessions_resume(cluster):
    template = await cluster.prewarm(template="restart", files={})
    handle = await cluster.create(template=template.template_key)
    await sh(handle, "echo kept > f")
    state = handle.capture_state()
    _, pid, _ = await cluster._call(handle.node, "describe")
    os.kill(pid, signal.SIGKILL)  # the backend's process, not its node
    with trio.fail_after(20):
        error = await refused(ErrorCode.SANDBOX_UNAVAILABLE, handle.session.read_file("f"))
    assert handle.node in error.message
    await cluster.refresh()
    assert handle.node in cluster.nodes
    _, new_pid, _ = await cluster._call(handle.node, "describe")
    assert new_pid != pid
    # The new backend recovers the lease its predecessor left, and the
    # session resumes there; the old handle stays with the old backend.
    async with await cluster.create(state=state, template=template.template_key) as resumed:
        assert resumed.node == handle.node
        assert (await sh(resumed, "cat f")).stdout == "kept\n"
        await resumed.delete()
    await refused(ErrorCode.SANDBOX_UNAVAILABLE, handle.session.read_file("f"))


async def test_a_host_that_returns_as_a_new_node_resumes_its_sessions(ray_cluster, tmp_path):
    cluster_utils, _, _ = ray_cluster
    host = tmp_path / "host"  # a state directory of the host's own, as on a real cluster
    before = cluster_utils.add_node(**NODE)
    cluster_utils.wait_for_nodes()
    async with await sandboxns.ray.open_cluster(state_directory=str(host), nodes=[before.node_id]) as cluster:
        template = await cluster.prewarm(template="returns", files={})
        handle = await cluster.create(template=template.template_key)
        await sh(handle, "echo kept > f")
        state = handle.capture_state()
        cluster_utils.remove_node(before, allow_graceful=False)  # the host goes down
    after = cluster_utils.add_node(**NODE)  # and comes back, with a new node id
    try:
        cluster_utils.wait_for_nodes()
        async with await sandboxns.ray.open_cluster(state_directory=str(host), nodes=[after.node_id]) as cluster:
            await refused(ErrorCode.SANDBOX_STATE_MISMATCH, cluster.create(state={**state, "backend_id": "f" * 32}))
            async with await cluster.create(state=state, template=template.template_key) as resumed:
                assert resumed.node == after.node_id
                assert (await sh(resumed, "cat f")).stdout == "kept\n"
                await resumed.delete()
    finally:
        cluster_utils.remove_node(after, allow_graceful=True)


async def test_credentials_never_reach_rays_files(ray_cluster, tmp_path):
    _, _, ray_files = ray_cluster
    secret = "sandboxns-ray-secret-" + os.urandom(8).hex()
    policy = {"allow": [{"origin": "http://upstream.invalid:8080", "headers": {"authorization": secret}}]}
    cluster = await sandboxns.ray.open_cluster(state_directory=str(tmp_path / "{node_id}"))
    async with cluster:
        template = await cluster.prewarm(template="secret", files={})
        async with await cluster.create(template=template.template_key, network=policy) as handle:
            await sh(handle, "true")
            await handle.session.set_network_policy(policy)
            await handle.delete()
    found = [
        path
        for directory in (ray_files, tmp_path)
        for path in Path(directory).rglob("*")
        if path.is_file() and not path.is_symlink() and secret.encode() in _read(path)
    ]
    assert found == []


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a socket, or gone meanwhile
        return b""


def rollout(cluster, template_key: str, seed: int) -> tuple[str, int]:
    """A Ray task: a session of its own, one command, and the session gone."""
    handle = cluster.create(template=template_key)
    try:
        result = handle.session.run("sh", ["-c", f"echo $(( {seed} * {seed} ))"])
        return handle.node, int(result.stdout)
    finally:
        handle.delete()


def test_ray_tasks_use_the_blocking_cluster(ray_cluster, tmp_path):
    # The tasks' workers cannot import this module: its functions go by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        with sandboxns.ray.open_blocking_cluster(state_directory=str(tmp_path / "{node_id}")) as cluster:
            template = cluster.prewarm(template="tasks", files={})
            task = ray.remote(rollout)
            results = ray.get([task.remote(cluster, template.template_key, seed) for seed in range(12)])
            assert sorted(value for _, value in results) == [seed * seed for seed in range(12)]
            assert {node for node, _ in results} <= set(cluster.nodes)
            with pytest.raises(sandboxns.SandboxError) as refusal:
                cluster.create(template="not a key")
            assert refusal.value.code == ErrorCode.SANDBOX_INVALID_ARGUMENT
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
