"""Resource bounds a guest meets."""

from __future__ import annotations

import errno
import resource
import signal
from pathlib import Path

import pytest

import sandboxns

pytestmark = pytest.mark.smoke


async def test_tmp_and_shm_are_bounded(session):
    # 256 MiB for /tmp and 64 MiB for /dev/shm: a full one gives ENOSPC,
    # not the host's memory.
    script = (
        "head -c 300M /dev/zero > /tmp/big; echo tmp=$?; head -c 80M /dev/zero > /dev/shm/big; echo shm=$?; "
        "df -k /tmp /dev/shm | tail -n 2"
    )
    result = await session.run("sh", ["-c", script])
    lines = result.stdout.splitlines()
    assert lines[:2] == ["tmp=1", "shm=1"], result
    assert "No space left on device" in result.stderr
    sizes = [int(line.split()[1]) for line in lines[2:]]
    assert sizes == [256 * 1024, 64 * 1024]


def _limits_of(text: str) -> dict[str, str]:
    """/proc/PID/limits as {name: soft limit}."""
    limits = {}
    for line in text.splitlines()[1:]:
        name, soft = line[:26].strip(), line[26:47].strip()
        limits[name] = soft
    return limits


async def test_default_rlimits_bound_processes_only(session):
    # Of the defaults, only processes has a value; the rest are the host's.
    result = await session.run("cat", ["/proc/self/limits"])
    limits = _limits_of(result.stdout)
    host_limits = _limits_of(Path("/proc/self/limits").read_text())
    assert limits["Max processes"] == "1024"
    for name in ("Max cpu time", "Max address space", "Max file size", "Max open files"):
        assert limits[name] == host_limits[name], name


async def test_a_command_gets_the_limits_it_is_given(session):
    limits = sandboxns.ResourceLimits(
        cpu_seconds=7, address_space=3 << 30, file_size=5 << 20, open_files=99, processes=77
    )
    result = await session.run("cat", ["/proc/self/limits"], resource_limits=limits)
    got = _limits_of(result.stdout)
    assert (got["Max cpu time"], got["Max address space"], got["Max file size"]) == ("7", str(3 << 30), str(5 << 20))
    assert (got["Max open files"], got["Max processes"]) == ("99", "77")
    # The hard limit too: a guest cannot raise them again.
    raised = await session.run("sh", ["-c", "ulimit -n 100"], resource_limits=limits)
    assert raised.exit_code != 0


async def test_a_fork_bomb_is_bounded(session):
    # Also on a root host: its guests are an unprivileged host user, whom
    # RLIMIT_NPROC bounds (it never bounds host uid 0).
    # Every child stays alive, so the count is what the kernel allowed at once.
    script = (
        "import os, signal\n"
        "count = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as error:\n"
        "        print(count, error.errno)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        signal.pause()\n"
        "    count += 1\n"
    )
    limits = sandboxns.ResourceLimits(processes=64)
    result = await session.run("python3", ["-c", script], resource_limits=limits, timeout=20)
    count, error = map(int, result.stdout.split())
    assert error == errno.EAGAIN, result
    # The native driver counts the whole session (holder and inits too).
    assert 40 < count < 64, result
    # And once the command is over, nothing of it is left to count (but for
    # the instant a dead bwrap init may wait for the host to reap it).
    again = await session.run("python3", ["-c", script], resource_limits=limits, timeout=20)
    assert count - 1 <= int(again.stdout.split()[0]) <= count, again


async def test_cpu_time_is_bounded(session):
    limits = sandboxns.ResourceLimits(cpu_seconds=1)
    result = await session.run("python3", ["-c", "while True: pass"], resource_limits=limits, timeout=30)
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL) and not result.timed_out, result


async def test_file_size_is_bounded(session, workspace):
    limits = sandboxns.ResourceLimits(file_size=1 << 20)
    result = await session.run(
        "python3",
        [
            "-c",
            "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); open('/workspace/big', 'wb').write(bytes(2 << 20))",
        ],
        resource_limits=limits,
    )
    assert result.exit_code != 0 and "File too large" in result.stderr, result
    assert (workspace / "big").stat().st_size <= 1 << 20


async def test_address_space_and_open_files_are_bounded(session):
    limits = sandboxns.ResourceLimits(address_space=512 << 20, open_files=32)
    script = (
        "import os\n"
        "try:\n"
        "    bytearray(1 << 30)\n"
        "except MemoryError:\n"
        "    print('memory refused')\n"
        "fds = []\n"
        "try:\n"
        "    while True:\n"
        "        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as error:\n"
        "    print('fds', max(fds), error.errno)\n"
    )
    result = await session.run("python3", ["-c", script], resource_limits=limits)
    assert result.stdout.splitlines() == ["memory refused", f"fds 31 {errno.EMFILE}"], result


@pytest.mark.parametrize(
    "limits",
    [{"processes": 0}, {"processes": -1}, {"open_files": True}, {"cpu_seconds": 1.5}, {"file_size": "1M"}],
)
def test_bad_resource_limits_are_refused(limits):
    with pytest.raises(sandboxns.SandboxError) as caught:
        sandboxns.ResourceLimits(**limits)
    assert caught.value.code == "SANDBOX_INVALID_ARGUMENT"
    assert next(iter(limits)) in caught.value.message


def test_limits_above_the_hosts_own_are_refused():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with pytest.raises(sandboxns.SandboxError) as caught:
        sandboxns.ResourceLimits(open_files=hard + 1)
    assert caught.value.code == "SANDBOX_LIMIT"


async def test_tmp_size_is_a_session_option(driver_name, workspace):
    confinement = sandboxns.Confinement(tmp_size=8 << 20)
    async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement) as session:
        result = await session.run("sh", ["-c", "head -c 9M /dev/zero > /tmp/big; echo $?; df -k /tmp | tail -n 1"])
    status, df = result.stdout.splitlines()
    assert status == "1" and int(df.split()[1]) == 8 * 1024, result


@pytest.mark.parametrize("size", [0, 1 << 19, 1 << 41, "big", True])
def test_bad_tmp_sizes_are_refused(size):
    with pytest.raises(sandboxns.SandboxError) as caught:
        sandboxns.Confinement(tmp_size=size)
    assert caught.value.code == "SANDBOX_INVALID_ARGUMENT"


async def test_a_guest_holds_no_host_fd_beyond_its_stdio(session):
    # runc's "detect fd leak": whatever the drivers open on the host side
    # (control sockets, bwrap's argument, status and seccomp fds) stays there.
    result = await session.run("sh", ["-c", "ls /proc/$$/fd"], stdin=b"")
    assert result.stdout.split() == ["0", "1", "2"], result


async def test_ten_gigabytes_of_output_are_bounded(session):
    # Read and dropped past the cap: the command never blocks on a full
    # pipe, and the host keeps the cap's worth, not the stream.
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = await session.run(
        "sh", ["-c", "head -c 10G /dev/zero; echo done >&2"], max_output_bytes=1 << 20, timeout=120
    )
    assert result.exit_code == 0 and result.truncated and not result.timed_out, result
    assert len(result.stdout_bytes) + len(result.stderr_bytes) == 1 << 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024  # KiB
