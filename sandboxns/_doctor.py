"""``sandboxns doctor``: is this host ready to run sandboxes, and if not, why.

Every check probes the machine for real (reads the kernel's settings, makes
the system calls the holder needs, and finally starts a sandbox) and says in
plain words what it found and what to do about it. A check never raises: a
probe that breaks unexpectedly is reported as a failed check instead.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ._bwrap import find_bwrap
from ._driver import HOLDER_PATH, StartPlan
from ._errors import SandboxError
from ._image import missing_for_workspace_cap
from ._native import NativeDriver
from ._open import open_sandbox
from ._session import Session

# mount_setattr(2), which makes the session's cloned trees read-only, arrived
# in 5.12; everything else the holder uses (clone3, pidfds, open_tree) is older.
MIN_KERNEL = (5, 12)
# Bounds a probe that wedges, so the doctor always finishes.
PROBE_TIMEOUT = 10.0
SANDBOX_PROBE_TIMEOUT = 30.0

# openat2(2) and its RESOLVE_BENEATH flag. 437 is its number on every
# architecture using the unified syscall table (x86_64, aarch64, riscv64, ...).
SYS_OPENAT2 = 437
RESOLVE_BENEATH = 0x08

# Runs in a fresh interpreter: unshare(CLONE_NEWUSER) fails with EINVAL in a
# multithreaded process, and the doctor must not move itself into a new
# namespace anyway. os.unshare only exists from Python 3.12 on.
_USERNS_PROBE = """
import ctypes, os, sys
CLONE_NEWUSER = 0x10000000
uid = os.geteuid()
step = "unshare(CLONE_NEWUSER)"
try:
    if hasattr(os, "unshare"):
        os.unshare(CLONE_NEWUSER)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    step = "writing /proc/self/uid_map"
    with open("/proc/self/uid_map", "w") as uid_map:
        uid_map.write(f"0 {uid} 1")
except OSError as exc:
    sys.exit(f"{step} failed: {exc.strerror}")
"""


@dataclass(frozen=True)
class Check:
    """One readiness check. ``required`` is False for advisory checks, which
    only matter for optional features or tooling."""

    name: str
    ok: bool
    detail: str
    required: bool


Probe = Callable[[], tuple[bool, str]]


def _read_sysctl(path: str) -> str | None:
    """The value of a /proc/sys setting, or None if this kernel lacks it."""
    try:
        return Path(path).read_text().strip()
    except FileNotFoundError:
        return None


def _check_kernel() -> tuple[bool, str]:
    # The holder is built on Linux namespaces and new mount API calls; an
    # older kernel fails at session setup with ENOSYS.
    if sys.platform != "linux":
        return False, f"sandboxns needs Linux, but this is {sys.platform}"
    release = os.uname().release
    match = re.match(r"(\d+)\.(\d+)", release)
    if match is None:
        return False, f"cannot read a version from kernel release {release!r}"
    version = (int(match[1]), int(match[2]))
    wanted = ".".join(map(str, MIN_KERNEL))
    if version < MIN_KERNEL:
        return False, (
            f"Linux {release} is too old: sandboxns needs {wanted} or newer (for mount_setattr); upgrade the kernel"
        )
    return True, f"Linux {release} (>= {wanted})"


def _check_user_namespaces() -> tuple[bool, str]:
    # Every session starts in a new user namespace: it is what lets an
    # unprivileged process create the other namespaces and mounts.
    max_userns = _read_sysctl("/proc/sys/user/max_user_namespaces")
    if max_userns is not None and int(max_userns) <= 0:
        return False, (
            "user namespaces are disabled (user.max_user_namespaces = 0); run "
            "'sysctl -w user.max_user_namespaces=15000' (and add it to /etc/sysctl.d/ to keep it)"
        )
    note = ""
    # Debian's older kernels gate unprivileged user namespaces separately;
    # root is exempt from that gate.
    if _read_sysctl("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        fix = "run 'sysctl -w kernel.unprivileged_userns_clone=1' (and add it to /etc/sysctl.d/ to keep it)"
        if os.geteuid() != 0:
            return False, f"unprivileged user namespaces are disabled; {fix}"
        note = f"; non-root users are blocked by kernel.unprivileged_userns_clone=0: to allow them, {fix}"
    probe = subprocess.run(
        [sys.executable, "-c", _USERNS_PROBE], check=False, capture_output=True, text=True, timeout=PROBE_TIMEOUT
    )
    if probe.returncode != 0:
        reason = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit status {probe.returncode}"
        return False, f"cannot create a user namespace: {reason}"
    return True, f"created a user namespace and mapped uid {os.geteuid()} into it{note}"


def _check_apparmor_userns() -> tuple[bool, str]:
    # Ubuntu 23.10+ lets unconfined, unprivileged processes create a user
    # namespace but strips it of every capability, so the holder's mounts fail.
    if _read_sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") != "1":
        return True, "AppArmor does not restrict unprivileged user namespaces"
    fix = (
        "run 'sysctl -w kernel.apparmor_restrict_unprivileged_userns=0', or give the holder "
        "an AppArmor profile that allows user namespaces: write "
        f"'abi <abi/4.0>, include <tunables/global> profile sandboxns-holder {HOLDER_PATH} "
        "flags=(unconfined) { userns, }' to /etc/apparmor.d/sandboxns-holder and run "
        "'apparmor_parser -r /etc/apparmor.d/sandboxns-holder'"
    )
    if os.geteuid() == 0:
        return True, (
            "AppArmor restricts unprivileged user namespaces (Ubuntu 23.10+), which does not "
            f"affect root; to let non-root users sandbox, {fix}"
        )
    return False, (
        "AppArmor restricts unprivileged user namespaces (Ubuntu 23.10+ default), so the "
        f"holder cannot set up its mounts; {fix}"
    )


def _check_overlayfs() -> tuple[bool, str]:
    # Later features build fast workspace templates as overlay mounts.
    filesystems = Path("/proc/filesystems").read_text().split()
    if "overlay" in filesystems:
        return True, "overlay filesystem available"
    return False, "overlay filesystem not available; run 'modprobe overlay' (only needed for workspace templates)"


def _check_pidfd() -> tuple[bool, str]:
    # The driver tracks each session's holder through a pidfd, so it can wait
    # for it and signal it without racing pid reuse.
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return False, f"pidfd_open failed: {exc.strerror}; sandboxns needs Linux 5.3 or newer"
    return True, "pidfd_open works"


def _check_openat2() -> tuple[bool, str]:
    # Contained file I/O resolves guest paths with openat2(RESOLVE_BENEATH),
    # so symlinks in the workspace cannot lead outside it.
    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    how = OpenHow(flags=os.O_PATH | os.O_CLOEXEC, mode=0, resolve=RESOLVE_BENEATH)
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = libc.syscall(
            ctypes.c_long(SYS_OPENAT2),
            ctypes.c_int(root),
            ctypes.c_char_p(b"."),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        err = ctypes.get_errno()
    finally:
        os.close(root)
    if fd < 0:
        return False, (
            f"openat2 failed: {os.strerror(err)}; contained file operations need Linux 5.6 "
            "or newer (and no seccomp filter blocking openat2)"
        )
    os.close(fd)
    return True, "openat2 with RESOLVE_BENEATH works"


def _check_holder() -> tuple[bool, str]:
    # Every session execs this C program; it is built when sandboxns is installed.
    if HOLDER_PATH.is_file() and os.access(HOLDER_PATH, os.X_OK):
        return True, f"{HOLDER_PATH} is installed and executable"
    state = "is not executable" if HOLDER_PATH.exists() else "is missing"
    return False, f"the holder program {HOLDER_PATH} {state}; reinstall sandboxns with 'pip install .'"


def _check_bwrap() -> tuple[bool, str]:
    # Only the bwrap driver (--driver bwrap) needs bubblewrap; the benchmarks
    # also measure against it.
    bwrap = find_bwrap()
    if bwrap is None:
        return False, "bwrap not found (only the bwrap driver needs it); run 'apt-get install -y bubblewrap'"
    result = subprocess.run([bwrap, "--version"], check=False, capture_output=True, text=True, timeout=5)
    if result.returncode != 0:
        return False, f"{bwrap} --version failed: {result.stderr.strip() or result.returncode}"
    return True, f"{result.stdout.strip()} at {bwrap}"


def _check_sandbox() -> tuple[bool, str]:
    # The checks above can each pass while their combination still fails
    # (seccomp, LSMs, a read-only /tmp, ...): start a real session and run a
    # command in it.
    async def run_true() -> tuple[bool, str]:
        with tempfile.TemporaryDirectory() as workspace:
            with trio.fail_after(SANDBOX_PROBE_TIMEOUT):
                async with open_sandbox(workspace) as session:
                    result = await session.run("/usr/bin/true")
        if result.exit_code == 0:
            return True, "started a sandbox and ran /usr/bin/true in it"
        how = f"signal {result.signal}" if result.exit_code is None else f"exit code {result.exit_code}"
        return False, f"/usr/bin/true in a sandbox ended with {how}: {result.stderr.strip()}"

    try:
        return trio.run(run_true)
    except SandboxError as exc:
        return False, f"cannot start a sandbox: {exc.message}"
    except trio.TooSlowError:
        return False, f"starting a sandbox and running /usr/bin/true took over {SANDBOX_PROBE_TIMEOUT:g}s"


def _check_images() -> tuple[bool, str]:
    # A session on an image (Backend.create(image=...)) has for its root a
    # read-only overlay of the image's tree, mounted in its user namespace:
    # start one on a tiny image (the holder program alone, which runs
    # anywhere, being static) and run it there.
    async def run_on_image() -> tuple[bool, str]:
        with tempfile.TemporaryDirectory() as scratch:
            root, workspace = Path(scratch, "image"), Path(scratch, "workspace")
            (root / "bin").mkdir(parents=True)
            workspace.mkdir()
            shutil.copy(HOLDER_PATH, root / "bin/probe")
            with trio.fail_after(SANDBOX_PROBE_TIMEOUT):
                driver = await NativeDriver.start(StartPlan(workspace, image_root=root))
                try:
                    result = await Session(driver).run("/bin/probe", ["--version"], env={})
                finally:
                    await driver.aclose()
        if result.exit_code == 0:
            return True, "started a sandbox on an image's root filesystem"
        return False, f"a program on an image's root filesystem failed ({result}): {result.stderr.strip()}"

    try:
        return trio.run(run_on_image)
    except SandboxError as exc:
        return False, (
            f"sessions on images unavailable (only they need it): {exc.message}; they need overlayfs in "
            "user namespaces (Linux 5.11 or newer)"
        )
    except trio.TooSlowError:
        return False, f"starting a sandbox on an image took over {SANDBOX_PROBE_TIMEOUT:g}s"


def _check_workspace_cap() -> tuple[bool, str]:
    # Confinement(workspace_size=...) mounts an ext4 image per session.
    missing = missing_for_workspace_cap()
    if missing:
        return False, f"workspace size caps unavailable (only they need it): lacking {'; '.join(missing)}"
    return True, "workspace size caps available (root, loop devices, mkfs.ext4)"


def _run(name: str, required: bool, probe: Probe) -> Check:
    try:
        ok, detail = probe()
    except Exception as exc:  # noqa: BLE001 - a broken probe is a failed check, never a crash
        ok, detail = False, f"the check itself failed: {type(exc).__name__}: {exc}"
    return Check(name=name, ok=ok, detail=detail, required=required)


_HOST_CHECKS: tuple[tuple[str, bool, Probe], ...] = (
    ("kernel", True, _check_kernel),
    ("user-namespaces", True, _check_user_namespaces),
    ("apparmor-userns", True, _check_apparmor_userns),
    ("overlayfs", False, _check_overlayfs),
    ("pidfd", True, _check_pidfd),
    ("openat2", False, _check_openat2),
    ("holder", True, _check_holder),
    ("bwrap", False, _check_bwrap),
    ("workspace-cap", False, _check_workspace_cap),
)


def run_checks() -> list[Check]:
    """Run every check, in order; the end-to-end sandbox check last, and
    only if its prerequisites passed. Must not be called from inside
    ``trio.run``."""
    checks = [_run(name, required, probe) for name, required, probe in _HOST_CHECKS]
    passed = {check.name for check in checks if check.ok}
    if {"user-namespaces", "holder"} <= passed:
        checks.append(_run("sandbox", True, _check_sandbox))
        checks.append(_run("images", False, _check_images))
    else:
        checks.append(Check("sandbox", False, "skipped: fix the checks above first", True))
    return checks


def format_report(checks: list[Check]) -> str:
    """One line per check, then a summary saying whether the host is ready."""
    width = max((len(check.name) for check in checks), default=0)
    lines = []
    for check in checks:
        mark = "ok  " if check.ok else "FAIL" if check.required else "warn"
        lines.append(f"{mark}  {check.name:<{width}}  {check.detail}")
    failed = [check.name for check in checks if check.required and not check.ok]
    warned = [check.name for check in checks if not check.required and not check.ok]
    if failed:
        summary = f"Not ready: {len(failed)} required check(s) failed ({', '.join(failed)}); fix them and run again."
    else:
        summary = "Ready: every required check passed."
    if warned:
        summary += f" Advisory warnings: {', '.join(warned)}."
    lines.append(summary)
    return "\n".join(lines)


def main() -> int:
    """Print the report; 0 if every required check passed, else 1."""
    checks = run_checks()
    print(format_report(checks))
    return 0 if all(check.ok for check in checks if check.required) else 1


if __name__ == "__main__":
    raise SystemExit(main())
