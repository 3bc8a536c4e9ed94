"""Contained byte file I/O on a workspace directory, from the host.

Every path is resolved by the kernel with openat2(RESOLVE_BENEATH |
RESOLVE_NO_MAGICLINKS) relative to an fd of the workspace opened once, so
nothing a guest does to the tree (symlinks to /etc, "..", a rename race) can
make the host touch a file outside it. Never realpath() and then open(): the
tree can change between the two. On a kernel without openat2 (before 5.6) the
same guarantee comes from a component-wise O_NOFOLLOW walk that refuses every
symlink. Paths arrive as canonical guest paths (``/workspace/...``, see
``normalize_path``).

Reads refuse anything but a regular file *before* reading from it, and open
with O_NONBLOCK, so a guest-made FIFO or device cannot hang the host; a
recursive remove opens directories only with O_DIRECTORY | O_NOFOLLOW, for
the same reason. Writes go to a new temporary file that is renamed over the
target: a failed write never leaves a half-written file, and a hard link the
guest made to some other file is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import trio

from . import _ffi
from ._errors import ErrorCode, SandboxError
from ._lease import Lease
from ._paths import WORKSPACE

# How deep remove(recursive=True) descends. It holds one open directory per
# level, so a guest's 10,000-deep tree must not cost the host as many fds;
# deeper trees go with the session, or with an `rm -rf` run in the sandbox.
MAX_REMOVE_DEPTH = 256


@dataclass(frozen=True)
class DirEntry:
    """One entry of a workspace directory."""

    name: str
    kind: Literal["file", "directory", "symlink", "other"]
    size: int


def list_directory_fd(fd: int) -> list[DirEntry]:
    """The entries of the open directory ``fd``, by name, each as it is
    (a symlink is a symlink, never followed)."""
    entries = []
    with os.scandir(fd) as listing:
        for entry in listing:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we listed: it is not there
            except OSError:
                # There, but not to be looked at (a directory the guest made
                # readable but not searchable): listed for what it is known to be.
                entries.append(DirEntry(entry.name, "other", 0))
                continue
            entries.append(DirEntry(entry.name, entry_kind(info.st_mode), info.st_size))
    return sorted(entries, key=lambda e: e.name)


def entry_kind(mode: int) -> Literal["file", "directory", "symlink", "other"]:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _kind_name(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def path_error(exc: OSError, guest_path: str) -> SandboxError:
    """The SandboxError for a failed operation on a workspace path; it names
    only the guest path, never a host one."""
    if exc.errno == errno.EXDEV:
        return SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{guest_path} resolves outside the workspace")
    if exc.errno == errno.ELOOP:
        return SandboxError(
            ErrorCode.SANDBOX_PATH_REFUSED, f"{guest_path} is, or passes through, a symlink that is not followed"
        )
    if exc.errno in (errno.ENXIO, errno.ENODEV):  # opening a socket or absent device
        return SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{guest_path} is not a regular file")
    if exc.errno in (errno.EACCES, errno.EPERM):  # file modes, or a device on a nodev mount
        return SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{guest_path}: permission denied")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"{guest_path} does not exist")
    if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
        return SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path}: {exc.strerror}")
    if exc.errno == errno.ENAMETOOLONG:  # a path, or a name in it, longer than the kernel takes
        return SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path} is too long a path")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a capped workspace, or the host's disk, is full
        return SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path}: {exc.strerror}; the workspace is full")
    return SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"{guest_path}: {exc.strerror}")


# open(dirfd, relative path, flags, mode) -> fd, never leaving dirfd's tree.
Resolver = Callable[[int, str, int, int], int]


def _open_no_symlink(name: str, flags: int, mode: int, directory: int) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
    except NotADirectoryError:
        # O_DIRECTORY|O_NOFOLLOW on a symlink says ENOTDIR; call it what it is.
        if stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, "symlink in path", name) from None
        raise


def walk_beneath(root: int, relative: str, flags: int, mode: int = 0) -> int:
    """The fallback resolver: open each component relative to the previous one
    with O_NOFOLLOW, refusing (ELOOP) any symlink on the way. Stricter than
    openat2, which follows symlinks that stay inside. ``relative`` is already
    normalised, so it holds no "..", and no component can climb out."""
    components = [part for part in relative.split("/") if part and part != "."]
    if not components:  # the root itself
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=root)
    directory = os.dup(root)
    try:
        for name in components[:-1]:
            step = _open_no_symlink(name, os.O_PATH | os.O_DIRECTORY, 0, directory)
            os.close(directory)
            directory = step
        return _open_no_symlink(components[-1], flags, mode, directory)
    finally:
        os.close(directory)


def open_beneath(root: int, relative: str, flags: int, mode: int = 0) -> int:
    """openat2 where the kernel has it, else the O_NOFOLLOW walk."""
    global _openat2_missing
    if not _openat2_missing:
        try:
            return _ffi.open_beneath(root, relative, flags, mode)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _openat2_missing = True
    return walk_beneath(root, relative, flags, mode)


def open_beneath_no_symlinks(root: int, relative: str, flags: int, mode: int = 0) -> int:
    """Like open_beneath, but any symlink on the way is refused (ELOOP): for
    callers that authorized a path segment by segment and must not be led
    elsewhere by a symlink swapped in afterwards."""
    global _openat2_missing
    if not _openat2_missing:
        try:
            return _ffi.open_beneath(root, relative, flags, mode, no_symlinks=True)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
            _openat2_missing = True
    return walk_beneath(root, relative, flags, mode)


_openat2_missing = False


def write_temporary(parent: int, name: str, data: bytes, mode: int) -> str:
    """A new file holding ``data`` beside ``name`` in the directory
    ``parent``, under a name nobody else uses, for the caller to rename (or
    link) into place. Writing a new file and renaming it, rather than
    writing in place, means a failure never leaves half a file and a hard
    link to the old one is never written through."""
    temporary = f".{name}.sandboxns-{secrets.token_hex(6)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=parent)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        discard_temporary(parent, temporary)
        raise
    finally:
        os.close(fd)
    return temporary


def discard_temporary(parent: int, temporary: str | None) -> None:
    if temporary is not None:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=parent)


def _open_subdirectory(parent: int, name: str) -> int:
    """A directory in ``parent``, opened to empty it. O_DIRECTORY |
    O_NOFOLLOW: whatever the guest swapped in since it was seen as a
    directory (a symlink to anywhere, a FIFO whose open would wait forever
    for a writer) fails (ELOOP, ENOTDIR) instead of being followed or
    opened."""
    return _open_no_symlink(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK, 0, parent)


def _unlink_all_but_directories(directory: int) -> list[str]:
    """Unlink every entry of ``directory`` that is not a directory (never
    opening one); returns the names of the subdirectories."""
    subdirectories = []
    with os.scandir(directory) as listing:
        entries = list(listing)  # all of them before changing the directory
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            subdirectories.append(entry.name)
        else:
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile: as good as removed
                os.unlink(entry.name, dir_fd=directory)
    return subdirectories


def remove_directory_tree(parent: int, name: str, guest_path: str) -> None:
    """Remove the directory ``name`` in ``parent`` and everything in it,
    depth first, without recursion (a guest can nest deeper than Python
    recurses). Every step is relative to a directory fd and never follows a
    symlink, so nothing outside the tree is touched, whatever is swapped in
    meanwhile. Past MAX_REMOVE_DEPTH it stops with SANDBOX_LIMIT; entries
    already removed by then stay removed, as when `rm -r` fails half way."""
    # One per directory being emptied, outermost first: its fd, its name in
    # the one above, and its subdirectories still to remove.
    levels: list[tuple[int, str, list[str]]] = []

    def descend(into: int, child: str) -> None:
        fd = _open_subdirectory(into, child)
        levels.append((fd, child, []))
        levels[-1][2].extend(_unlink_all_but_directories(fd))

    try:
        descend(parent, name)
        while levels:
            directory, finished, pending = levels[-1]
            if pending:
                if len(levels) >= MAX_REMOVE_DEPTH:
                    raise SandboxError(
                        ErrorCode.SANDBOX_LIMIT,
                        f"{guest_path} is nested more than {MAX_REMOVE_DEPTH} directories deep; remove it with a"
                        " command in the sandbox",
                    )
                descend(directory, pending.pop())
            else:
                levels.pop()
                os.close(directory)
                os.rmdir(finished, dir_fd=levels[-1][0] if levels else parent)
    finally:
        for directory, _, _ in levels:
            os.close(directory)


class WorkspaceFiles:
    """Byte file operations confined to one directory, given as an fd (which
    this object then owns): a host directory, or the session's merged
    workspace as the holder sees it."""

    def __init__(self, root_fd: int, resolver: Resolver = open_beneath) -> None:
        self._root = root_fd
        self._resolve = resolver

    @classmethod
    def of_directory(cls, path: Path, resolver: Resolver = open_beneath) -> WorkspaceFiles:
        return cls(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), resolver)

    @property
    def root(self) -> int:
        """The workspace directory's fd (owned by this object)."""
        return self._root

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    @staticmethod
    def _relative(guest_path: str) -> str:
        return os.path.relpath(guest_path, WORKSPACE)

    def _open(self, guest_path: str, flags: int, mode: int = 0) -> int:
        try:
            return self._resolve(self._root, self._relative(guest_path), flags, mode)
        except OSError as exc:
            raise path_error(exc, guest_path) from None

    def _parent(self, guest_path: str) -> tuple[int, str]:
        """An O_PATH fd of the parent directory and the final name."""
        if guest_path == WORKSPACE:
            raise SandboxError(
                ErrorCode.SANDBOX_PATH_REFUSED, "the workspace root itself cannot be replaced or removed"
            )
        parent, name = guest_path.rsplit("/", 1)
        return self._open(parent, os.O_PATH | os.O_DIRECTORY), name

    def read_bytes(self, guest_path: str, max_bytes: int) -> bytes:
        # O_NONBLOCK: opening a FIFO must not wait for a writer. The type
        # is checked on the opened fd, so a swap after the open cannot help.
        fd = self._open(guest_path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} is a directory")
            if not stat.S_ISREG(info.st_mode):
                raise SandboxError(
                    ErrorCode.SANDBOX_PATH_REFUSED, f"{guest_path} is a {_kind_name(info.st_mode)}, not a regular file"
                )
            if info.st_size > max_bytes:
                raise SandboxError(
                    ErrorCode.SANDBOX_LIMIT, f"{guest_path} has {info.st_size} bytes; the limit is {max_bytes}"
                )
            data = bytearray()
            # Read in chunks of what the file holds, not of the limit: a
            # large limit must not mean a large allocation per read. But at
            # least 64 KiB: a guest can grow an empty file to 1 TiB between
            # the fstat and the read, and a byte per read() up to the limit
            # would cost the host millions of calls.
            while chunk := os.read(fd, min(max_bytes + 1 - len(data), max(info.st_size + 1, 1 << 16), 1 << 20)):
                data += chunk
                if len(data) > max_bytes:  # it grew while we read
                    raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path} is larger than {max_bytes} bytes")
            return bytes(data)
        finally:
            os.close(fd)

    def write_bytes(self, guest_path: str, data: bytes) -> None:
        parent, name = self._parent(guest_path)
        temporary = None
        try:
            try:
                # The permission bits only: content the host writes must not
                # become a setuid or setgid program because the guest marked
                # the old file so (a root host would keep the bits).
                mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode & 0o777
            except FileNotFoundError:
                mode = 0o644
            temporary = write_temporary(parent, name, data, mode)
            os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
            temporary = None
        except OSError as exc:
            raise path_error(exc, guest_path) from None
        finally:
            discard_temporary(parent, temporary)
            os.close(parent)

    def list_dir(self, guest_path: str) -> list[DirEntry]:
        fd = self._open(guest_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return list_directory_fd(fd)
        finally:
            os.close(fd)

    def remove(self, guest_path: str, recursive: bool) -> None:
        parent, name = self._parent(guest_path)
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(name, dir_fd=parent)
            elif recursive:
                remove_directory_tree(parent, name, guest_path)
            else:
                os.rmdir(name, dir_fd=parent)
        except OSError as exc:
            raise path_error(exc, guest_path) from None
        finally:
            os.close(parent)

    def mkdir(self, guest_path: str, parents: bool) -> None:
        if guest_path == WORKSPACE:
            return
        if parents:
            # Outermost first, in a loop: a path may have more components
            # than Python recurses.
            components = guest_path[len(WORKSPACE) + 1 :].split("/")
            for depth in range(1, len(components)):
                self._make_directory(f"{WORKSPACE}/{'/'.join(components[:depth])}", exist_ok=True)
        self._make_directory(guest_path, exist_ok=parents)

    def _make_directory(self, guest_path: str, exist_ok: bool) -> None:
        parent, name = self._parent(guest_path)
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                # The stat may fail too (the guest removed it meanwhile): the
                # outer handler turns that into a SandboxError as well.
                if not exist_ok or not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} already exists") from None
        except OSError as exc:
            raise path_error(exc, guest_path) from None
        finally:
            os.close(parent)


def _as_fs_ids(ids: tuple[int, int], operation, *args):
    """Run operation in this worker thread with the file-system ids ``ids``
    (they are per thread), then give the thread its own back."""
    _ffi.set_fs_ids(*ids)
    try:
        return operation(*args)
    finally:
        _ffi.set_fs_ids(os.geteuid(), os.getegid())


class HostWorkspaceIO:
    """The byte file I/O half of a SandboxDriver whose workspace is a host
    directory (``self._files``). Work happens in a worker thread, so a slow
    disk never stalls the trio loop."""

    _files: WorkspaceFiles
    _closed: bool
    _lease: Lease | None
    # The host uid and gid file operations act as, when not this process's
    # own: a root host's workspace seen through the guest's idmapped mount
    # belongs to the guest's host user there.
    _fs_ids: tuple[int, int] | None = None

    def check_usable(self) -> None:
        """Refuse once the session is stopped, or once an operator has taken
        its lease away (``sandboxns lease clear --force``)."""
        if self._closed:
            raise SandboxError(ErrorCode.SANDBOX_STOPPED, "the session is stopped")
        if self._lease is not None and not self._lease.is_current():
            raise SandboxError(
                ErrorCode.SANDBOX_STOPPED, "the session was taken away from this handle (its lease was cleared)"
            )

    # Operations running in worker threads right now; the workspace fd is
    # closed only when none is (a worker cannot be interrupted).
    _file_ops = 0
    _file_ops_done: trio.Event | None = None

    async def _file_op(self, operation, *args):
        self.check_usable()
        self._file_ops += 1
        try:
            if self._fs_ids is not None:
                return await trio.to_thread.run_sync(_as_fs_ids, self._fs_ids, operation, *args)
            return await trio.to_thread.run_sync(operation, *args)
        finally:
            self._file_ops -= 1
            if self._file_ops == 0 and self._file_ops_done is not None:
                self._file_ops_done.set()

    async def workspace_call(self, operation, *args):
        """Run ``operation(root_fd, *args)`` in a worker thread, with the
        workspace directory's fd kept open for it: the entry point for
        host-side tools that need more than the byte I/O above."""
        return await self._file_op(lambda *rest: operation(self._files.root, *rest), *args)

    async def _close_files(self) -> None:
        """Close the workspace handle once no file operation uses it."""
        while self._file_ops:
            self._file_ops_done = trio.Event()
            await self._file_ops_done.wait()
        self._files.close()

    async def read_bytes(self, path: str, max_bytes: int) -> bytes:
        return await self._file_op(self._files.read_bytes, path, max_bytes)

    async def write_bytes(self, path: str, data: bytes) -> None:
        await self._file_op(self._files.write_bytes, path, data)

    async def list_dir(self, path: str) -> list[DirEntry]:
        return await self._file_op(self._files.list_dir, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._file_op(self._files.remove, path, recursive)

    async def mkdir(self, path: str, parents: bool = False) -> None:
        await self._file_op(self._files.mkdir, path, parents)
