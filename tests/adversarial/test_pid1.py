"""pid 1 of a command's pid namespace, attacked from the command.

Both drivers put an init of ours at pid 1 (native: each command's init, a
fork of the holder; bwrap: ``sandboxns-holder --init``, which bwrap execs as
pid 1 instead of its own reaper). It runs as the guest's user, so what keeps
the guest out is that it is non-dumpable: /proc/1/mem, pidfd_getfd, kcmp,
process_vm_* and ptrace all need ptrace rights over it, which a
non-dumpable process grants only to holders of CAP_SYS_PTRACE over its
memory's user namespace. The seccomp filter denies most of these calls as
well; the probe runs once with the filter's ptrace group lifted, so each
layer is checked on its own, and once against a child of its own, which it
may reach, so a denial is pid 1's and not a broken probe's."""

from __future__ import annotations

import errno
import json
import platform

import pytest

import sandboxns

pytestmark = [
    pytest.mark.smoke,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the syscall numbers below are x86_64's"),
]

# Runs in the guest with the target pid as argv[1]; prints {attempt: errno,
# 0 if it worked} as JSON, and for pid 1, afterwards, whether it still runs.
PROBE = r"""
import ctypes, json, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
PIDFD_GETFD, KCMP, PTRACE, PROCESS_VM_READV, PROCESS_VM_WRITEV = 438, 312, 101, 310, 311
KCMP_FILE, PTRACE_ATTACH, PTRACE_SEIZE = 0, 16, 0x4206

def call(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return ctypes.get_errno() if result == -1 else 0

def opened(path, flags):
    try:
        os.close(os.open(path, flags))
        return 0
    except OSError as exc:
        return exc.errno

buffer = ctypes.create_string_buffer(8)
iovec = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), 8)
remote = (ctypes.c_void_p * 2)(8, 8)  # page 0: never mapped

def attack(pid):
    pidfd = os.pidfd_open(pid)
    return {
        "mem-rw": opened(f"/proc/{pid}/mem", os.O_RDWR),
        "mem-read": opened(f"/proc/{pid}/mem", os.O_RDONLY),
        "pidfd_getfd": call(PIDFD_GETFD, pidfd, 0, 0),
        "kcmp": call(KCMP, os.getpid(), pid, KCMP_FILE, 0, 0),
        "process_vm_readv": call(PROCESS_VM_READV, pid, ctypes.addressof(iovec), 1, ctypes.addressof(remote), 1, 0),
        "process_vm_writev": call(PROCESS_VM_WRITEV, pid, ctypes.addressof(iovec), 1, ctypes.addressof(remote), 1, 0),
        "ptrace-seize": call(PTRACE, PTRACE_SEIZE, pid, 0, 0),
        "ptrace-attach": call(PTRACE, PTRACE_ATTACH, pid, 0, 0),
    }

if sys.argv[1] == "child":
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    report = attack(child)
    os.kill(child, signal.SIGKILL)
else:
    report = attack(1)
    # None of these has a handler in either init (the native one passes
    # SIGTERM, SIGINT and SIGHUP on to the command: to this probe). An
    # accepted signal would be pending, or have stopped or killed pid 1 (and
    # with it this probe) by the time its status is read.
    for number in (signal.SIGKILL, signal.SIGSTOP, signal.SIGQUIT, signal.SIGSEGV, signal.SIGUSR1):
        os.kill(1, number)
    with open("/proc/1/status") as status:
        fields = dict(line.split(":", 1) for line in status.read().splitlines())
    report["pid1-state"] = fields["State"].split()[0]
    report["pid1-pending"] = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
print(json.dumps(report))
sys.exit(42)
"""

PTRACE_LIFTED = sandboxns.Confinement(seccomp=sandboxns.SeccompPolicy(allow={"ptrace"}))
ATTACKS = ("mem-rw", "mem-read", "pidfd_getfd", "kcmp", "process_vm_readv", "process_vm_writev", "ptrace-seize")


async def probe(driver_name, workspace, confinement, target: str) -> dict:
    async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement) as session:
        result = await session.run("python3", ["-c", PROBE, target])
    # The exit status is the probe's own: pid 1 reported it, untouched.
    assert result.exit_code == 42, result
    return json.loads(result.stdout)


@pytest.mark.parametrize("confinement", [None, PTRACE_LIFTED], ids=["default-seccomp", "ptrace-lifted"])
async def test_pid1_is_out_of_the_commands_reach(driver_name, workspace, confinement):
    report = await probe(driver_name, workspace, confinement, "1")
    # Opening /proc/1/mem is a path, not a filtered call: non-dumpable alone.
    assert report["mem-rw"] == report["mem-read"] == errno.EACCES, report
    assert {attack: report[attack] for attack in ATTACKS[2:]} == dict.fromkeys(ATTACKS[2:], errno.EPERM), report
    assert report["ptrace-attach"] == errno.EPERM, report
    # Signals from inside reach no init: none is pending, and it is neither
    # stopped nor dead.
    assert report["pid1-pending"] == 0, report
    assert report["pid1-state"] in ("S", "R"), report


async def test_the_probe_reaches_a_process_of_its_own(driver_name, workspace):
    report = await probe(driver_name, workspace, PTRACE_LIFTED, "child")
    # Every attack that pid 1 turns away works on the command's own child
    # (process_vm_* get as far as the bogus remote address).
    assert report["mem-rw"] == report["mem-read"] == report["pidfd_getfd"] == report["kcmp"] == 0, report
    assert report["process_vm_readv"] == report["process_vm_writev"] == errno.EFAULT, report
    assert report["ptrace-seize"] == 0, report


async def test_the_filter_denies_process_access_calls_by_default(driver_name, workspace):
    report = await probe(driver_name, workspace, None, "child")
    denied = ("pidfd_getfd", "kcmp", "process_vm_readv", "process_vm_writev", "ptrace-seize", "ptrace-attach")
    assert {attack: report[attack] for attack in denied} == dict.fromkeys(denied, errno.EPERM), report
