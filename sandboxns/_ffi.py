"""The only module that touches the compiled cffi module ``sandboxns._sbx``.

It turns the C boundary into plain Python: the holder launcher raises
``OSError`` instead of returning ``-errno``, and the wire structs (whose
layout the compiler decides, see ``csrc/sbx_proto.h``) are packed and
unpacked here and nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._sbx import ffi, lib

MAX_REQUEST_STRINGS: int = lib.SBX_MAX_REQUEST_STRINGS
TMP_BYTES: int = lib.SBX_TMP_BYTES
SHM_BYTES: int = lib.SBX_SHM_BYTES
REPORT_SIZE: int = ffi.sizeof("struct sbx_report")
MAX_PASSED_FDS: int = lib.SBX_MAX_PASSED_FDS
FD_ORDER = ("reply", "stdin", "stdout", "stderr")
assert len(FD_ORDER) == lib.SBX_NFDS

REPORT_READY: int = lib.SBX_REPORT_READY
REPORT_ERROR: int = lib.SBX_REPORT_ERROR
REPORT_EXITED: int = lib.SBX_REPORT_EXITED
REPORT_STARTED: int = lib.SBX_REPORT_STARTED

# Request rlimit slots, in the order the holder reads them.
RLIMIT_SLOTS = {
    "cpu_seconds": lib.SBX_RLIMIT_CPU,
    "address_space": lib.SBX_RLIMIT_AS,
    "file_size": lib.SBX_RLIMIT_FSIZE,
    "open_files": lib.SBX_RLIMIT_NOFILE,
    "processes": lib.SBX_RLIMIT_NPROC,
}
RLIMIT_COUNT: int = lib.SBX_NRLIMITS
RLIMIT_INHERIT: int = lib.SBX_RLIMIT_INHERIT

# The seccomp table's groups a host may lift (csrc/sbx_seccomp.h).
SECCOMP_GROUPS = {
    "kernel": lib.SBX_SECCOMP_KERNEL,
    "keyring": lib.SBX_SECCOMP_KEYRING,
    "bpf": lib.SBX_SECCOMP_BPF,
    "perf": lib.SBX_SECCOMP_PERF,
    "userfaultfd": lib.SBX_SECCOMP_USERFAULTFD,
    "io_uring": lib.SBX_SECCOMP_IO_URING,
    "ptrace": lib.SBX_SECCOMP_PTRACE,
    "file_handles": lib.SBX_SECCOMP_FILE_HANDLES,
    "mount": lib.SBX_SECCOMP_MOUNT,
    "namespaces": lib.SBX_SECCOMP_NAMESPACES,
    "personality": lib.SBX_SECCOMP_PERSONALITY,
    "tty_injection": lib.SBX_SECCOMP_TTY_INJECTION,
    "setid_files": lib.SBX_SECCOMP_SETID_FILES,
}
SECCOMP_MAX_EXTRA: int = lib.SBX_SECCOMP_MAX_EXTRA


def syscall_number(name: str) -> int | None:
    """This machine's number for the syscall ``name``, or None."""
    return getattr(lib, f"__NR_{name}", None) if name.isidentifier() else None


@dataclass(frozen=True)
class Report:
    kind: int
    exit_code: int
    signal: int
    errno: int
    pid: int
    step: str
    message: str


def spawn_holder(path: str, argv: Sequence[str], control_fd: int, lease_fd: int = -1, cgroup_procs_fd: int = -1) -> int:
    """Start a holder (in the cgroup whose cgroup.procs is open as
    ``cgroup_procs_fd``, if any); returns its pid. Call from a long-lived
    thread: the holder's parent-death signal is tied to the calling
    thread."""
    c_strings = [ffi.new("char[]", os.fsencode(arg)) for arg in argv]
    c_argv = ffi.new("char *[]", c_strings + [ffi.NULL])
    pid = lib.sbx_spawn_holder(os.fsencode(path), c_argv, control_fd, lease_fd, cgroup_procs_fd)
    if pid < 0:
        raise OSError(-pid, os.strerror(-pid), path)
    return pid


def open_beneath(dirfd: int, path: str, flags: int, mode: int = 0, *, no_symlinks: bool = False) -> int:
    """openat2(dirfd, path) that the kernel refuses (EXDEV/ELOOP) if resolving
    it would leave dirfd's directory, or, with ``no_symlinks``, if it meets
    any symlink at all. Raises OSError; returns the new fd."""
    resolve = lib.RESOLVE_BENEATH | lib.RESOLVE_NO_MAGICLINKS | (lib.RESOLVE_NO_SYMLINKS if no_symlinks else 0)
    fd = lib.sbx_openat2(dirfd, os.fsencode(path), flags | os.O_CLOEXEC, mode, resolve)
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), path)
    return fd


def exchange(a: os.PathLike[str], b: os.PathLike[str]) -> None:
    """Swap the names ``a`` and ``b`` atomically; OSError (EINVAL on a
    file system that cannot) otherwise."""
    rc = lib.sbx_exchange(os.fsencode(a), os.fsencode(b))
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc), os.fspath(a), None, os.fspath(b))


def set_fs_ids(uid: int, gid: int) -> None:
    """The calling thread's file-system uid and gid (Linux keeps them per
    thread)."""
    rc = lib.sbx_set_fs_ids(uid, gid)
    if rc < 0:
        raise OSError(-rc, f"cannot act as uid {uid}, gid {gid}: {os.strerror(-rc)}")


def make_userns(uid_map: str, gid_map: str, owner: tuple[int, int] = (-1, -1)) -> int:
    """A user namespace with these maps, owned by the (uid, gid) ``owner``
    (default: this process), in which no user namespace can be made;
    returns its fd (needs privilege over the mapped ids)."""
    fd = lib.sbx_make_userns(uid_map.encode(), gid_map.encode(), *owner)
    if fd < 0:
        raise OSError(-fd, f"cannot make a user namespace: {os.strerror(-fd)}")
    return fd


def idmapped_mount_ns(
    sources: Sequence[str], targets: Sequence[str], readonly: Sequence[bool], idmap_userns_fds: Sequence[int]
) -> int:
    """A mount namespace in which each of ``targets`` shows the tree at the
    same place in ``sources``, its files seen through the maps of the user
    namespace at the same place in ``idmap_userns_fds``; returns its fd."""
    c_sources = [ffi.new("char[]", os.fsencode(path)) for path in sources]
    c_targets = [ffi.new("char[]", os.fsencode(path)) for path in targets]
    fd = lib.sbx_idmapped_mount_ns(
        ffi.new("const char *[]", c_sources),
        ffi.new("const char *[]", c_targets),
        ffi.new("int[]", [int(flag) for flag in readonly]),
        len(sources),
        ffi.new("int[]", list(idmap_userns_fds)),
    )
    if fd < 0:
        raise OSError(-fd, f"cannot prepare the workspace's id mapping: {os.strerror(-fd)}")
    return fd


def mount_image(image: str, target: str) -> int:
    """Mount the ext4 image file ``image`` at ``target`` (nosuid, nodev)
    through a loop device that frees itself once unmounted; returns the loop
    device's number."""
    number = lib.sbx_image_mount(os.fsencode(image), os.fsencode(target))
    if number < 0:
        raise OSError(-number, f"cannot mount {image} at {target}: {os.strerror(-number)}")
    return number


def unmount_image(target: str) -> bool:
    """Unmount ``target``; False when it was still in use on the host and
    has only been detached (it goes once its user lets go)."""
    rc = lib.sbx_image_unmount(os.fsencode(target))
    if rc < 0:
        raise OSError(-rc, f"cannot unmount {target}: {os.strerror(-rc)}")
    return rc == 0


def encode_request(cwd: str, argv: Sequence[str], env: Mapping[str, str], rlimits: Sequence[int]) -> bytes:
    """Pack one exec request; ``rlimits`` are the RLIMIT_COUNT values in
    slot order (RLIMIT_INHERIT for none). Raises ValueError when the strings
    exceed the holder's limit."""
    items = [cwd, *argv, *(f"{key}={value}" for key, value in env.items())]
    strings = b"".join(os.fsencode(item) + b"\0" for item in items)
    if len(strings) > MAX_REQUEST_STRINGS:
        raise ValueError(f"arguments and environment take {len(strings)} bytes; the limit is {MAX_REQUEST_STRINGS}")
    request = ffi.new("struct sbx_exec_request *")
    request.version = lib.SBX_PROTO_VERSION
    request.kind = lib.SBX_REQUEST_EXEC
    request.argc = len(argv)
    request.envc = len(env)
    request.strings_len = len(strings)
    request.rlimits = rlimits
    return bytes(ffi.buffer(request)) + strings


def encode_restack(names: Sequence[str], replace: bool = False) -> bytes:
    """Pack a restack request (see sbx_proto.h): the new upper and work
    directories, named in the one that holds the workspace's upper layer;
    with ``replace``, then the layers from the holder's layer stores (else
    the current upper layer becomes the topmost read-only one)."""
    strings = b"".join(os.fsencode(name) + b"\0" for name in names)
    request = ffi.new("struct sbx_exec_request *")
    request.version = lib.SBX_PROTO_VERSION
    request.kind = lib.SBX_REQUEST_REPLACE if replace else lib.SBX_REQUEST_RESTACK
    request.argc = len(names)
    request.strings_len = len(strings)
    return bytes(ffi.buffer(request)) + strings


def decode_report(data: bytes) -> Report:
    if len(data) != REPORT_SIZE:
        raise ValueError(f"report of {len(data)} bytes, expected {REPORT_SIZE}")
    report = ffi.cast("struct sbx_report *", ffi.from_buffer(data))
    return Report(
        kind=report.kind,
        exit_code=report.exit_code,
        signal=report.signal,
        errno=report.err,
        pid=report.pid,
        step=ffi.string(report.step).decode("utf-8", "replace"),
        message=ffi.string(report.message).decode("utf-8", "replace"),
    )


def encode_signal(signum: int) -> bytes:
    request = ffi.new("struct sbx_signal_request *")
    request.signal = signum
    return bytes(ffi.buffer(request))


def seccomp_program(relaxed: int = 0, denied: Sequence[int] = ()) -> bytes:
    """The guests' seccomp filter as a compiled BPF program (csrc/seccomp.c),
    with the groups in the ``relaxed`` mask lifted and the syscall numbers
    ``denied`` added: what the holder installs before each command, in the
    form bwrap's ``--seccomp`` reads."""
    buffer = ffi.new("unsigned char[]", lib.SBX_SECCOMP_MAX_INSNS * 8)
    size = lib.sbx_seccomp_export(buffer, len(buffer), relaxed, ffi.new("uint32_t[]", list(denied)), len(denied))
    if size < 0:
        raise OSError(-size, os.strerror(-size))
    return bytes(ffi.buffer(buffer, size))
