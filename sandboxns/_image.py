"""The workspace size cap: a session's writable storage on an ext4 file
system of the cap's size.

A bound on what a session stores must hold at every write, whoever writes
(the guest through either driver, or the host's file API), and must not
depend on how the state directory's own file system is mounted (quotas need
mount options the host may not have). A file system of exactly the cap's
size is such a bound, and the kernel enforces it: a write past it fails with
ENOSPC. The file system lives in a sparse image file in the session's
directory, so the host's disk holds only what was written::

    sessions/<id>/workspace.img    the ext4 image, never visible to a guest
    sessions/<id>/storage/         where it is mounted while the session runs

The image is mounted in the host's mount namespace before the session's
sandbox starts, so both drivers and the host's file API work on it like on
any directory. A guest only ever writes files through the kernel's ext4, so
the block layout the kernel parses at each mount is one that mkfs and the
kernel themselves wrote.

Attaching a loop device and mounting need CAP_SYS_ADMIN in the initial user
namespace (in practice: root), the loop driver and mkfs.ext4; without any of
them the cap is refused (SANDBOX_UNAVAILABLE), never silently dropped.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from . import _ffi
from ._errors import ErrorCode, SandboxError

logger = logging.getLogger("sandboxns")

IMAGE_NAME = "workspace.img"
MOUNT_POINT_NAME = "storage"
LOOP_CONTROL = "/dev/loop-control"
_SYSTEM_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
CAP_SYS_ADMIN = 21
# What the initial user namespace's uid_map says: every id is itself.
_INITIAL_ID_MAP = ["0", "0", "4294967295"]


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4", path=_SYSTEM_PATH)


def _has_initial_sys_admin() -> bool:
    """Whether this process has CAP_SYS_ADMIN in the initial user namespace,
    which mounting a block device's file system needs. (A user namespace
    that maps every id to itself looks the same here; there, the mount
    itself is refused.)"""
    with open("/proc/self/uid_map") as uid_map:
        if uid_map.read().split() != _INITIAL_ID_MAP:
            return False
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    return False


def missing_for_workspace_cap() -> list[str]:
    """What this host lacks for a workspace size cap; empty if nothing."""
    missing = []
    if not _has_initial_sys_admin():
        missing.append("CAP_SYS_ADMIN in the initial user namespace (run as root)")
    if not os.path.exists(LOOP_CONTROL):
        missing.append(f"{LOOP_CONTROL} (the kernel's loop driver)")
    if _mkfs() is None:
        missing.append("mkfs.ext4 (install e2fsprogs)")
    return missing


def require_workspace_cap_support() -> None:
    """Refuse (SANDBOX_UNAVAILABLE) on a host that cannot cap a workspace,
    naming what it lacks."""
    missing = missing_for_workspace_cap()
    if missing:
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE, f"a workspace size cap needs what this host lacks: {'; '.join(missing)}"
        )


_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


def _mount_sources(mount_point: str) -> list[str]:
    """The sources of what is mounted at ``mount_point`` in this process's
    mount namespace, as /proc/self/mountinfo lists them."""
    sources = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            # The kernel escapes space, tab, newline and backslash as \ooo.
            if _MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4]) == mount_point:
                sources.append(fields[fields.index("-") + 2])
    return sources


def _bound_loop_devices(image: str) -> list[str]:
    """The loop devices (``/dev/loopN``) whose backing file is ``image``."""
    devices = []
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            with open(backing) as file:
                bound = file.read().rstrip("\n")
        except OSError:  # unbound meanwhile: gone (ENOENT), or being cleared (ENODEV, ENXIO)
            continue
        if bound == image:
            devices.append("/dev/" + backing.split("/")[3])
    return devices


# How long a loop device may take to let go of an image once its mount is
# gone. The kernel frees an autoclear device from a work queue after its
# last user closed it: that user may be the file system itself, alive until
# the mount namespaces that held clones of the workspace (a stopped
# session's holder's) are torn down, or whoever opened the device meanwhile
# (udev's probe after the change event). Usually a few milliseconds; a
# detached mount that a host process keeps busy, or a live fork's clone,
# holds it for as long as they like. A mount waits this long for a device
# to let go before it refuses.
RELEASE_TIMEOUT = 1.0


def _released(image: str) -> list[str]:
    """The loop devices still bound to ``image`` after waiting up to
    RELEASE_TIMEOUT for them to let go: usually none."""
    deadline = time.monotonic() + RELEASE_TIMEOUT
    delay = 0.0005
    while (bound := _bound_loop_devices(image)) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return bound


class WorkspaceImage:
    """One capped session's image file and its mount point."""

    def __init__(self, session_dir: Path) -> None:
        self.path = session_dir / IMAGE_NAME
        self.mount_point = session_dir / MOUNT_POINT_NAME

    def create(self, size: int, top_directory: str) -> None:
        """Make the image: a sparse file of ``size`` bytes holding an ext4
        whose root directory holds the empty directory ``top_directory``,
        both this process's user's (the owner of the backend's own
        workspaces), and the mount point beside it."""
        self.mount_point.mkdir(mode=0o700)
        try:
            with open(self.path, "xb") as image:
                os.truncate(image.fileno(), size)
        except OSError as exc:
            raise SandboxError(
                ErrorCode.SANDBOX_LIMIT, f"the state directory cannot hold a {size}-byte image: {exc.strerror}"
            ) from None
        # mkfs copies the tree under -d in, so the image is complete before
        # the session is visible; the mount point is empty again after.
        (self.mount_point / top_directory).mkdir(mode=0o755)
        mkfs = _mkfs()
        if mkfs is None:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, "mkfs.ext4 (e2fsprogs) is not installed")
        # -m 0: no blocks reserved for root, whose host-side file operations
        # would otherwise get more room than the guest. The image is new and
        # sparse, so its unwritten inode tables and journal read as zeros
        # already, and mkfs need not write them (lazy_*_init), nor discard.
        done = subprocess.run(
            [
                mkfs,
                "-q",
                "-F",
                "-m",
                "0",
                "-d",
                str(self.mount_point),
                "-E",
                f"root_owner={os.geteuid()}:{os.getegid()},lazy_itable_init=1,lazy_journal_init=1,nodiscard",
                str(self.path),
            ],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        (self.mount_point / top_directory).rmdir()
        if done.returncode != 0:
            raise SandboxError(
                ErrorCode.SANDBOX_UNAVAILABLE, f"mkfs.ext4 failed on {self.path}: {done.stderr.strip()[:500]}"
            )

    def mount(self) -> None:
        """Mount the image at its mount point, unless it is mounted there
        already: a session's mount outlives an owner that crashed, and the
        next owner takes it over. Refuses to mount the image a second time
        while a detached mount of it still lives (SANDBOX_BUSY): two ext4
        instances over one image would corrupt it."""
        image, mount_point = os.path.realpath(self.path), os.path.realpath(self.mount_point)
        bound = _bound_loop_devices(image)
        mounted = _mount_sources(mount_point)
        if mounted and set(mounted) <= set(bound):
            return
        if mounted:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"{mount_point} has {', '.join(mounted)} mounted on it, not the session's image {image}",
            )
        if bound:
            bound = _released(image)  # a device just unmounted may not have let go yet
        if bound:
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY,
                f"the workspace image {image} is still attached to {', '.join(bound)}, unmounted but in use on the "
                "host (a process's open file or working directory); try again once that process lets go",
            )
        try:
            _ffi.mount_image(image, mount_point)
        except OSError as exc:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, str(exc)) from None

    def unmount(self) -> None:
        """Unmount the image if it is mounted; its loop device lets go of it
        soon after (see RELEASE_TIMEOUT). A mount still in use on the host
        is detached instead, and goes once its user lets go."""
        mount_point = os.path.realpath(self.mount_point)
        if not _mount_sources(mount_point):
            return
        try:
            if not _ffi.unmount_image(mount_point):
                logger.warning("%s is in use on the host; detached, it goes once its user lets go", mount_point)
                return
        except OSError as exc:
            raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, str(exc)) from None
