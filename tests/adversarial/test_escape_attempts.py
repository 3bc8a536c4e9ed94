"""What a hostile guest tries, and what the kernel lets it do: each case
asserts the outcome as the kernel reports it (errno, exit status, what the
host then sees)."""

from __future__ import annotations

import os
import socket

import pytest
import trio
from conftest import descendants, host_processes_with, sleep_marker, start_waiting_guest

import sandboxns

pytestmark = pytest.mark.smoke


async def sh(session, script: str, **options) -> sandboxns.RunResult:
    return await session.run("sh", ["-c", script], **options)


@pytest.mark.parametrize(
    "target",
    ["/proc/sys/kernel/hostname", "/proc/sysrq-trigger", "/proc/sys/vm/drop_caches", "/proc/1/exe", "/etc/passwd"],
)
async def test_kernel_and_system_files_are_not_writable(session, target):
    result = await sh(session, f"echo x > {target}")
    assert result.exit_code != 0, result


@pytest.mark.parametrize("path", ["/", "/usr/bin", "/etc", "/dev", "/run", "/proc"])
async def test_nothing_outside_the_scratch_places_is_writable(session, path):
    result = await sh(session, f"touch {path}/planted")
    assert result.exit_code != 0, result


async def test_device_nodes_cannot_be_made(session):
    result = await sh(session, "mknod /tmp/sda b 8 0; echo $?; mknod /workspace/null c 1 3; echo $?")
    assert result.stdout.split() == ["1", "1"], result


async def test_only_the_expected_devices_exist(session):
    result = await sh(session, "ls /dev | sort | tr '\\n' ' '")
    devices = set(result.stdout.split())
    assert devices <= {"null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm", "fd"} | {
        "stdin", "stdout", "stderr", "core",
    }  # fmt: skip
    assert not {"sda", "mem", "kmem", "port", "kmsg"} & devices


async def test_host_view_of_a_guest_process(session, workspace):
    # From the host: no new privileges and no capabilities at all.
    marker = sleep_marker()
    async with trio.open_nursery() as nursery:
        await start_waiting_guest(session, workspace, nursery, marker)
        # The command itself (bwrap's own processes carry the marker too).
        [pid] = [p for p in host_processes_with(marker) if _cmdline(p).startswith(b"python3\0")]
        status = _status(pid)
        nursery.cancel_scope.cancel()
    assert status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
    assert status["Seccomp"] == "2"  # a filter


async def test_every_native_sandbox_process_is_filtered(driver_name, workspace):
    # The native holder installs the session's part of the filter before it
    # serves, each command's init adds the command part after its mounts:
    # only the launcher, outside the session's pid namespace, has none.
    if driver_name != "native":
        pytest.skip("bwrap's own processes are bwrap's")
    async with sandboxns.open_sandbox(workspace) as session, trio.open_nursery() as nursery:
        marker = sleep_marker()
        await start_waiting_guest(session, workspace, nursery, marker)
        [command] = host_processes_with(marker)
        filters = {pid: int(_status(pid)["Seccomp_filters"]) for pid in descendants(os.getpid())}
        nursery.cancel_scope.cancel()
    assert filters[command] == 2
    # Launcher, holder, the command's init and the next one, prepared.
    assert sorted(filters.values()) == [0, 1, 2, 2, 2], filters


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read()


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as file:
        return {key: value.strip() for key, _, value in (line.partition(":") for line in file)}


async def test_ptrace_of_a_sibling_is_refused(session):
    script = (
        "import ctypes, os, subprocess\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "result = libc.ptrace(16, child.pid, 0, 0)\n"  # PTRACE_ATTACH
        "print(result, ctypes.get_errno())\n"
        "child.kill()\n"
    )
    result = await session.run("python3", ["-c", script])
    assert result.stdout.split() == ["-1", "1"], result


async def test_no_route_out_by_tcp_or_udp(session):
    script = (
        "import socket\n"
        "for address in [('1.1.1.1', 53), ('10.0.0.1', 80), ('::1', 22)]:\n"
        "    family = socket.AF_INET6 if ':' in address[0] else socket.AF_INET\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n"
        "        s = socket.socket(family, kind); s.settimeout(2)\n"
        "        try:\n"
        "            s.connect(address); s.send(b'x'); s.recv(1); print('REACHED', address)\n"
        "        except OSError as e:\n"
        "            print('refused', e.errno)\n"
    )
    result = await session.run("python3", ["-c", script])
    assert "REACHED" not in result.stdout and result.stdout.count("refused") == 6, result


async def connect_to_a_host_abstract_socket(session) -> str:
    """What the guest gets connecting to an abstract Unix socket the host
    listens on: "REACHED" or "refused ERRNO"."""
    name = f"\0sandboxns-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(name)
        server.listen()
        script = (
            "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({name!r}); print('REACHED')\n"
            "except OSError as e:\n    print('refused', e.errno)\n"
        )
        result = await session.run("python3", ["-c", script])
    assert result.exit_code == 0, result
    return result.stdout.strip()


async def test_the_hosts_abstract_unix_sockets_are_unreachable(session):
    assert (await connect_to_a_host_abstract_socket(session)).startswith("refused")


async def test_internet_reaches_no_abstract_unix_socket_of_the_host(driver_name, workspace):
    # "internet" is the way out allow-all is not: its own namespace, with
    # everything public through the proxy.
    async with sandboxns.open_sandbox(workspace, driver=driver_name, network="internet") as session:
        assert (await connect_to_a_host_abstract_socket(session)).startswith("refused")


async def test_allow_all_shares_the_hosts_abstract_unix_sockets(driver_name, workspace):
    # The exposure the README's security model describes: abstract names
    # belong to the network namespace that allow-all shares.
    async with sandboxns.open_sandbox(workspace, driver=driver_name, network="allow-all") as session:
        assert await connect_to_a_host_abstract_socket(session) == "REACHED"


async def test_two_sessions_see_nothing_of_each_other(driver_name, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    marker = sleep_marker()
    async with (
        sandboxns.open_sandbox(tmp_path / "a", driver=driver_name) as a,
        sandboxns.open_sandbox(tmp_path / "b", driver=driver_name) as b,
        trio.open_nursery() as nursery,
    ):
        await sh(a, "echo secret-a > /workspace/mine; echo a > /tmp/mine")
        await start_waiting_guest(a, tmp_path / "a", nursery, marker, setup="echo a > /tmp/running;")
        seen = await sh(b, "ls -A /workspace /tmp; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
        nursery.cancel_scope.cancel()
    assert "mine" not in seen.stdout and "running" not in seen.stdout and marker not in seen.stdout, seen


async def test_no_process_but_its_own_is_open_to_it(session):
    # /proc/PID/mem gives a process's memory, so code execution as it: the
    # only other process the command sees, its pid 1, is closed to it on
    # both drivers (see test_pid1.py).
    script = (
        "import os\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    if int(pid) == os.getpid():\n"
        "        continue\n"
        "    try:\n"
        "        with open(f'/proc/{pid}/mem', 'r+b'):\n"
        "            pass\n"
        "    except OSError:\n"
        "        continue\n"
        "    caps = open(f'/proc/{pid}/status').read().split('CapEff:')[1].split()[0]\n"
        "    print(pid, caps)\n"
    )
    result = await session.run("python3", ["-c", script])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "", result.stdout
