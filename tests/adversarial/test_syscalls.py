"""The seccomp filter, seen from inside: each denied call fails with the
errno the filter gives (EPERM, or ENOSYS where libc falls back), not with the
EFAULT/EINVAL/EBADF its zeroed arguments would otherwise earn."""

from __future__ import annotations

import json
import platform

import pytest

import sandboxns

pytestmark = [
    pytest.mark.smoke,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the numbers below are x86_64's"),
]

EPERM_CALLS = {
    "init_module": 175, "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "syslog": 103, "acct": 163, "quotactl": 179, "keyctl": 250,
    "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "mount": 165, "umount2": 166, "pivot_root": 155, "unshare": 272, "setns": 308,
}  # fmt: skip
ENOSYS_CALLS = {
    "clone3": 435, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "openat2": 437,
}  # fmt: skip
CLONE, IOCTL, PERSONALITY, GETPID = 56, 16, 135, 39
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# Runs in the guest: {label: errno (0 if the call succeeded)} as JSON.
PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(nr, *args):
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr), *(ctypes.c_ulong(a) for a in args))
    return ctypes.get_errno() if result == -1 else 0
calls = json.loads(sys.argv[1])
print(json.dumps({label: attempt(*spec) for label, spec in calls.items()}))
"""


async def probe(session, calls: dict[str, list[int]]) -> dict[str, int]:
    result = await session.run("python3", ["-c", PROBE, json.dumps(calls)])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


async def test_denied_syscalls_fail_with_the_filters_errno(session):
    calls = {name: [nr, 0, 0, 0, 0, 0] for name, nr in {**EPERM_CALLS, **ENOSYS_CALLS}.items()}
    errors = await probe(session, calls)
    assert {name: errors[name] for name in EPERM_CALLS} == dict.fromkeys(EPERM_CALLS, 1)
    assert {name: errors[name] for name in ENOSYS_CALLS} == dict.fromkeys(ENOSYS_CALLS, 38)


async def test_namespace_clones_terminal_injection_and_other_abis_are_denied(session):
    errors = await probe(
        session,
        {
            "clone_newuser": [CLONE, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0],
            "clone_newnet": [CLONE, CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0],
            "tiocsti": [IOCTL, 0, TIOCSTI, 0],
            "tiocsti_high_bits": [IOCTL, 0, (1 << 32) | TIOCSTI, 0],
            "tioclinux": [IOCTL, 0, TIOCLINUX, 0],
            "x32_getpid": [0x40000000 | GETPID],
            "personality_linux32": [PERSONALITY, 0x0008],
            "personality_query": [PERSONALITY, 0xFFFFFFFF],
            "getpid": [GETPID],
        },
    )
    assert errors == {
        "clone_newuser": 1, "clone_newnet": 1, "tiocsti": 1, "tiocsti_high_bits": 1, "tioclinux": 1,
        "x32_getpid": 1, "personality_linux32": 1, "personality_query": 0, "getpid": 0,
    }  # fmt: skip


async def test_ordinary_programs_still_work(session):
    # glibc's posix_spawn tries clone3 first and falls back on ENOSYS.
    script = "import subprocess, threading; t = threading.Thread(target=print); t.start(); t.join(); "
    script += "print(subprocess.run(['sh', '-c', 'echo spawned'], capture_output=True).stdout.decode())"
    result = await session.run("python3", ["-c", script])
    assert (result.exit_code, result.stdout.split()) == (0, ["spawned"]), result.stderr


async def test_a_host_may_lift_a_group_and_deny_more(driver_name, workspace):
    # A debugger needs ptrace; uname stands for any call a host wants gone.
    # namespaces is a group of the part each native command's init loads,
    # ptrace one of the part the holder loads for the whole session.
    seccomp = sandboxns.SeccompPolicy(allow={"ptrace", "perf", "namespaces"}, deny={"uname"})
    confinement = sandboxns.Confinement(seccomp=seccomp)
    async with sandboxns.open_sandbox(workspace, driver=driver_name, confinement=confinement) as session:
        errors = await probe(
            session,
            {
                "uname": [63, 0],
                "ptrace_traceme": [EPERM_CALLS["ptrace"], 0, 0, 0, 0],  # PTRACE_TRACEME: allowed once lifted
                "bpf": [EPERM_CALLS["bpf"], 0, 0, 0],  # still denied
                "mount": [EPERM_CALLS["mount"], 0, 0, 0, 0, 0],
                "setns": [EPERM_CALLS["setns"], -1, 0],  # the kernel's own answer once lifted: EBADF
            },
        )
    assert errors == {"uname": 1, "ptrace_traceme": 0, "bpf": 1, "mount": 1, "setns": 9}


@pytest.mark.parametrize(
    ("options", "wrong"),
    [
        ({"allow": {"everything"}}, "everything"),
        ({"deny": {"no_such_call"}}, "no_such_call"),
        ({"allow": "ptrace"}, ""),
    ],
)
def test_unknown_seccomp_names_are_refused(options, wrong):
    with pytest.raises(sandboxns.SandboxError) as caught:
        sandboxns.SeccompPolicy(**options)
    assert caught.value.code == "SANDBOX_INVALID_ARGUMENT" and wrong in caught.value.message


async def test_no_set_id_file_can_be_made(session, workspace):
    # A set-id file left in the workspace would run with its on-disk owner's
    # rights on the host (root's, for a root host's backend sessions).
    script = (
        "import os\n"
        "open('plain', 'w').close()\n"
        "os.chmod('plain', 0o755)\n"
        "print('chmod', 'ok')\n"
        "for label, attempt in [\n"
        "    ('chmod-suid', lambda: os.chmod('plain', 0o4755)),\n"
        "    ('chmod-sgid', lambda: os.chmod('plain', 0o2755)),\n"
        "    ('fchmod', lambda: os.fchmod(os.open('plain', os.O_RDONLY), 0o4755)),\n"
        "    ('create', lambda: os.open('made', os.O_CREAT | os.O_WRONLY, 0o4755)),\n"
        "    ('mknod', lambda: os.mknod('node', 0o100000 | 0o6755)),\n"
        "]:\n"
        "    try:\n"
        "        attempt()\n"
        "        print(label, 'allowed')\n"
        "    except OSError as error:\n"
        "        print(label, error.errno)\n"
    )
    result = await session.run("python3", ["-c", script])
    assert result.stdout.splitlines() == [
        "chmod ok", "chmod-suid 1", "chmod-sgid 1", "fchmod 1", "create 1", "mknod 1",
    ], result  # fmt: skip
    assert not (workspace / "made").exists() and not (workspace / "node").exists()
    assert (workspace / "plain").stat().st_mode & 0o7777 == 0o755
