"""What a guest can see, write, reach and do: checked from inside the
sandbox and, where it matters, against the host kernel's view."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import pytest
import trio
from conftest import host_processes_with, sleep_marker

import sandboxns

pytestmark = pytest.mark.smoke

RUNTIME_ENTRIES = {name for name in ("bin", "sbin", "lib", "lib64", "usr") if os.path.lexists(f"/{name}")}
ROOT_ENTRIES = RUNTIME_ENTRIES | {"dev", "etc", "proc", "run", "tmp", "workspace"}


async def sh(session: sandboxns.Session, script: str, **kwargs) -> sandboxns.RunResult:
    return await session.run("/bin/sh", ["-c", script], **kwargs)


async def test_guest_runs_as_configured_user_and_host_sees_its_own_uid(session, workspace):
    result = await sh(session, "id -u; id -g; id -un; touch /workspace/made-by-guest")
    assert result.stdout.split() == ["1000", "1000", "sandbox"]
    made = (workspace / "made-by-guest").stat()
    assert (made.st_uid, made.st_gid) == (os.getuid(), os.getgid())


async def test_uid_zero_inside_still_has_no_capabilities(driver_name, workspace):
    async with sandboxns.open_sandbox(workspace, driver=driver_name, uid=0, gid=0) as session:
        result = await sh(session, "id -u; grep -E '^(CapEff|CapBnd)' /proc/self/status")
    lines = result.stdout.splitlines()
    assert lines[0] == "0"
    assert lines[1].split() == ["CapEff:", "0000000000000000"]
    assert lines[2].split() == ["CapBnd:", "0000000000000000"]


async def test_no_capabilities_and_no_new_privs(session):
    result = await session.run("/bin/cat", ["/proc/self/status"])
    status = dict(line.split(":", 1) for line in result.stdout.splitlines())
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[field], 16) == 0, field
    assert status["NoNewPrivs"].strip() == "1"


async def test_runtime_dirs_are_read_only_and_cannot_be_remounted(session):
    marker = f"sandboxns-test-{os.getpid()}"
    result = await sh(session, f"mount -o remount,rw /usr; echo mount=$?; touch /usr/{marker}; echo touch=$?")
    assert "mount=0" not in result.stdout
    assert "touch=0" not in result.stdout
    assert "Read-only file system" in result.stderr
    assert not os.path.exists(f"/usr/{marker}")


async def test_environment_is_exactly_what_was_passed_plus_pwd(session):
    result = await session.run("/usr/bin/env", env={"ONLY": "this", "PWD": "/elsewhere"}, cwd="sub/..")
    assert sorted(result.stdout.splitlines()) == ["ONLY=this", "PWD=/workspace"]
    result = await session.run("/usr/bin/env")
    assert sorted(result.stdout.splitlines()) == sorted(
        f"{key}={value}" for key, value in {**sandboxns._session.DEFAULT_ENV, "PWD": "/workspace"}.items()
    )


async def test_the_environment_never_shows_in_a_host_process_list(session, workspace):
    secret = f"token-{sleep_marker()}"
    fifo = workspace / "started"
    os.mkfifo(fifo)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(session.run, "sh", ["-c", "echo > started; sleep 100"], env={"TOKEN": secret})
        )
        await trio.to_thread.run_sync(fifo.read_bytes)
        assert host_processes_with(secret) == []
        nursery.cancel_scope.cancel()


async def test_guest_cannot_make_namespaces_of_its_own(session):
    result = await sh(
        session, "unshare -U true && echo user; unshare -m true && echo mount; unshare -n true && echo net"
    )
    assert result.stdout == ""
    assert result.stderr.count("unshare failed") == 3


async def test_host_paths_are_invisible(session, workspace):
    result = await sh(session, "ls -A /; echo ---; ls -A /etc; echo ---; ls -A /dev")
    root, etc, dev = (part.split() for part in result.stdout.split("---"))
    assert set(root) == ROOT_ENTRIES
    assert set(etc) <= {
        "passwd",
        "group",
        "hosts",
        "hostname",
        "nsswitch.conf",
        "ld.so.cache",
        "alternatives",
        "ssl",
    }
    assert set(dev) == {
        "null",
        "zero",
        "full",
        "random",
        "urandom",
        "tty",
        "pts",
        "ptmx",
        "shm",
        "fd",
        "stdin",
        "stdout",
        "stderr",
        "core",
    }
    home = os.path.expanduser("~")
    probe = await sh(session, f"ls -d '{home}' '{workspace}' /root /home /var /opt 2>/dev/null; echo done")
    assert probe.stdout.strip() == "done"


async def test_workspace_is_writable_and_persists_between_commands(session, workspace):
    await sh(session, "echo kept > /workspace/note.txt")
    assert (await session.run("/bin/cat", ["note.txt"])).stdout == "kept\n"
    assert (workspace / "note.txt").read_text() == "kept\n"


async def test_tmp_and_shm_are_empty_at_every_command_start(session):
    first = await sh(session, "ls -A /tmp /dev/shm; touch /tmp/left /dev/shm/left && echo wrote")
    assert first.stdout.split() == ["/dev/shm:", "/tmp:", "wrote"]
    second = await sh(session, "ls -A /tmp /dev/shm")
    assert second.stdout.split() == ["/dev/shm:", "/tmp:"]


async def test_sysv_ipc_objects_do_not_outlive_their_command(session):
    # /proc/sysvipc lists the reader's IPC namespace: a header line plus one
    # line per object.
    first = await sh(
        session, "ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && cat /proc/sysvipc/shm /proc/sysvipc/msg"
    )
    assert len(first.stdout.splitlines()) == 4, first
    second = await sh(session, "cat /proc/sysvipc/shm /proc/sysvipc/msg")
    assert len(second.stdout.splitlines()) == 2, second


async def test_guest_has_its_own_pid_namespace_per_command(session):
    result = await sh(session, "echo $$; ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '")
    shell_pid, pids = result.stdout.split("\n", 1)
    assert shell_pid == "2"  # pid 1 is the command's init
    # Only this command's own processes (the shell and its pipeline) exist.
    assert all(int(pid) < 10 for pid in pids.split())


async def test_only_loopback_and_no_route_to_host_services(session):
    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        # Positive control: the listener works from the host.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        (await listener.accept())[0].close()
        result = await session.run(
            "/bin/bash", ["-c", f"cat /proc/net/dev; echo > /dev/tcp/127.0.0.1/{port} && echo connected"]
        )
        interfaces = {line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line}
        assert interfaces == {"lo"}
        assert "connected" not in result.stdout
        assert "Connection refused" in result.stderr


async def test_allow_all_shares_the_host_network(driver_name, workspace):
    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        async with sandboxns.open_sandbox(workspace, driver=driver_name, network="allow-all") as session:
            result = await session.run("/bin/bash", ["-c", f"echo > /dev/tcp/127.0.0.1/{port} && echo connected"])
        assert result.stdout == "connected\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="entering another user's network namespace needs host root")
async def test_native_network_namespace_seen_from_the_host(workspace):
    from pyroute2 import NetNS

    async with sandboxns.open_sandbox(workspace, driver="native") as session:
        (pid1,) = _children(session.driver._pid)
        _check_netns(pid1, NetNS)


def _check_netns(pid1: int, NetNS) -> None:
    with NetNS(f"/proc/{pid1}/ns/net") as netns:
        links = {link.get_attr("IFLA_IFNAME"): link for link in netns.get_links()}
        assert set(links) == {"lo"}
        assert links["lo"]["flags"] & 1  # IFF_UP
        routes = [r for r in netns.get_routes(table=254)]
        assert routes == []
    assert os.readlink(f"/proc/{pid1}/ns/net") != os.readlink("/proc/self/ns/net")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


async def test_hostname_and_user_database(session):
    result = await sh(session, "hostname; whoami; echo $HOME")
    assert result.stdout.split() == ["sandbox", "sandbox", "/workspace"]


async def test_dev_nodes_work(session):
    result = await sh(
        session, "echo x > /dev/null && head -c 4 /dev/zero | od -An -tx1 && head -c 8 /dev/urandom | wc -c"
    )
    assert result.stdout.split() == ["00", "00", "00", "00", "8"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the holder is non-dumpable: only root may inspect it")
async def test_native_holder_is_its_own_program_not_a_python_fork(workspace):
    async with sandboxns.open_sandbox(workspace, driver="native") as session:
        holder = session.driver._pid
        assert Path(os.readlink(f"/proc/{holder}/exe")).name == "sandboxns-holder"
        assert Path(f"/proc/{holder}/environ").read_bytes() == b""  # none of the host's environment
