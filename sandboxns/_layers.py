"""Workspace trees on the host: copied, merged from overlay layers, sized.

A snapshot's layer is either a whole tree, or what one session wrote over
the layers below it: an overlayfs upper directory, in which a deleted name is
a *whiteout* (a character device numbered 0:0) and a directory that replaces
the one below is *opaque* (the ``user.overlay.opaque`` xattr, as overlayfs
keeps its metadata in user xattrs when a user namespace mounts it). Merging a
stack applies those as overlayfs does, into one whole tree.

Every tree here may have been shaped by a guest: symlinks are copied as links
and never followed, FIFOs and sockets are made anew and never opened,
directories and files whose modes shut their owner out (a guest's chmod 000)
are copied all the same, and nothing of a tree is ever executed. These
functions run in worker threads, while nothing runs in the session.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._errors import ErrorCode, SandboxError

_OVERLAY_XATTRS = "user.overlay."
_OPAQUE = "user.overlay.opaque"
# ioctl(dest, FICLONE, src): share src's blocks (btrfs, XFS, bcachefs...).
FICLONE = 0x40049409


def copy_file(source: int, target: int) -> None:
    """A file's contents, reflinked where the file system shares blocks."""
    try:
        fcntl.ioctl(target, FICLONE, source)
        return
    except OSError:
        pass
    try:
        while os.copy_file_range(source, target, 1 << 30):
            pass
    except OSError as exc:
        # Between file systems of different types (the template store and a
        # capped workspace's ext4 image) the kernel refuses before copying.
        if exc.errno != errno.EXDEV:
            raise
        while os.sendfile(target, source, None, 1 << 30):
            pass


def is_whiteout(entry: os.stat_result) -> bool:
    return stat.S_ISCHR(entry.st_mode) and entry.st_rdev == 0


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _through(pinned: int) -> str:
    """A path to the very inode an O_PATH fd pins, whatever its name leads
    to by now (a guest of another session may be renaming things in a bound
    host directory while it is copied)."""
    return f"/proc/self/fd/{pinned}"


@contextlib.contextmanager
def _opened(parent: int, name: str, info: os.stat_result, flags: int) -> Iterator[int]:
    """An fd of ``name`` in the directory ``parent``, which must still be
    the ``info`` it was listed as (never a link followed, never a FIFO
    waited on); readable by its owner for as long as the block runs, should
    a guest's chmod have shut them out (root reads it anyway)."""
    pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        now = os.fstat(pinned)
        if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) != (info.st_dev, info.st_ino, stat.S_IFMT(info.st_mode)):
            raise OSError(errno.ESTALE, f"{name} changed while it was being copied")
        wanted = 0o500 if stat.S_ISDIR(now.st_mode) else 0o400
        unlocked = os.geteuid() != 0 and now.st_mode & wanted != wanted
        if unlocked:
            os.chmod(_through(pinned), stat.S_IMODE(now.st_mode) | wanted)
        try:
            fd = os.open(_through(pinned), (flags & ~os.O_NOFOLLOW) | os.O_CLOEXEC)  # the fd is no link
            try:
                yield fd
            finally:
                os.close(fd)
        finally:
            if unlocked:
                os.chmod(_through(pinned), stat.S_IMODE(now.st_mode))
    finally:
        os.close(pinned)


def _copy_xattrs(source: int, target: str, verbatim: bool) -> None:
    """An open file's extended attributes; of overlayfs's own, with
    ``verbatim`` (a layer copied as a layer), whether a directory is
    opaque."""
    try:
        names = os.listxattr(source)
    except OSError:
        return
    for name in names:
        if name.startswith(_OVERLAY_XATTRS) and not (verbatim and name == _OPAQUE):
            continue
        with contextlib.suppress(OSError):
            os.setxattr(target, name, os.getxattr(source, name), follow_symlinks=False)


def _is_opaque(directory: int) -> bool:
    try:
        return os.getxattr(directory, _OPAQUE) == b"y"
    except OSError:
        return False


class _Copy:
    """One merge or copy: the files linked more than once, and the
    directories whose modes are set last (a mode that shuts out their owner
    must not stop the copy of what goes below them)."""

    def __init__(self, verbatim: bool) -> None:
        self.verbatim = verbatim
        self.links: dict[tuple[int, int], str] = {}
        self.directories: list[tuple[str, os.stat_result]] = []

    def entry(self, parent: int, name: str, info: os.stat_result, target: str) -> None:
        """One non-directory entry, as what it is."""
        mode = info.st_mode
        if stat.S_ISREG(mode) and info.st_nlink > 1:
            earlier = self.links.get((info.st_dev, info.st_ino))
            if earlier is not None:
                os.link(earlier, target)
                return
            self.links[(info.st_dev, info.st_ino)] = target
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=parent), target)
            return
        if stat.S_ISREG(mode):
            with _opened(parent, name, info, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK) as reading:
                writing = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    copy_file(reading, writing)
                finally:
                    os.close(writing)
                _copy_xattrs(reading, target, self.verbatim)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(target, 0o600)
        elif is_whiteout(info) and self.verbatim:
            os.mknod(target, stat.S_IFCHR, 0)  # anyone may make a whiteout (Linux 5.8)
            return
        else:
            return  # a socket is no file to copy; a guest makes no devices
        os.chmod(target, stat.S_IMODE(mode))
        os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))

    def directory(self, directories: list[int], target: str) -> None:
        """Copy the entries of one directory, as open in each layer that
        has it (topmost first), each entry as its topmost layer has it."""
        entries: dict[str, list[tuple[int, os.stat_result]]] = {}
        for directory in directories:
            with os.scandir(directory) as listing:
                for entry in listing:
                    entries.setdefault(entry.name, []).append((directory, entry.stat(follow_symlinks=False)))
        for name, found in entries.items():
            parent, info = found[0]
            destination = os.path.join(target, name)
            if is_whiteout(info) and not self.verbatim:
                continue  # deleted from what is below (or a whiteout a guest made: no file)
            if not stat.S_ISDIR(info.st_mode):
                self.entry(parent, name, info, destination)
                continue
            os.mkdir(destination, 0o700)
            with contextlib.ExitStack() as opened:  # readable until what is below is copied
                below = [opened.enter_context(_opened(parent, name, info, _DIRECTORY))]
                for lower, lower_info in found[1:]:
                    if _is_opaque(below[-1]) or not stat.S_ISDIR(lower_info.st_mode):
                        break
                    below.append(opened.enter_context(_opened(lower, name, lower_info, _DIRECTORY)))
                self.directory(below, destination)
                _copy_xattrs(below[0], destination, self.verbatim)
            self.directories.append((destination, info))

    def finish(self) -> None:
        """The directories' modes and times, each after those below it (in
        the order they were finished)."""
        for destination, info in self.directories:
            os.chmod(destination, stat.S_IMODE(info.st_mode))
            os.utime(destination, ns=(info.st_atime_ns, info.st_mtime_ns))


def merge_layers(layers: Sequence[Path], target: Path, *, verbatim: bool = False) -> None:
    """Write into the empty directory ``target`` the tree overlayfs shows
    for ``layers`` (topmost first): whiteouts hide what is below, an opaque
    directory hides the directories below, and a name is what its topmost
    layer says. With one layer, a copy of it: with ``verbatim``, one that
    keeps its whiteouts and opaque directories (a layer copied as a layer).
    A layer's top directory is opened as it is named and must be no link;
    below it nothing is looked up by a path a guest could redirect."""
    copy = _Copy(verbatim)
    with contextlib.ExitStack() as opened:
        tops = []
        for layer in layers:
            parent = os.open(layer.parent, _DIRECTORY)
            opened.callback(os.close, parent)
            tops.append(opened.enter_context(_opened(parent, layer.name, os.lstat(layer), _DIRECTORY)))
        copy.directory(tops, str(target))
    copy.finish()
    os.chmod(target, stat.S_IMODE(os.lstat(layers[0]).st_mode))


def copy_tree(source: Path, target: Path, *, verbatim: bool = False) -> None:
    """Copy the whole tree ``source`` into the empty directory ``target``,
    sharing blocks where the file system can (see _templates)."""
    merge_layers([source], target, verbatim=verbatim)


def tree_bytes(root: Path) -> int:
    """The size of the regular files in a tree (each file once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    pending = [str(root)]
    while pending:
        directory = pending.pop()
        try:
            listing = os.scandir(directory)
        except PermissionError:
            continue  # a guest's chmod 000: what is inside is not counted
        with listing:
            for entry in listing:
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
                elif stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                    seen.add((info.st_dev, info.st_ino))
                    total += info.st_size
    return total


def move_tree(source: Path, target: Path) -> bool:
    """Move ``source`` to ``target`` (which must not exist): one rename on
    one file system (True); across file systems (a capped workspace lives
    on its own image) a copy, put in place whole, after which ``source`` is
    emptied (False). Either way ``target``, once it exists, holds all of
    it."""
    try:
        os.rename(source, target)
        return True
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    partial = target.with_name(f"{target.name}.partial")
    remove_tree(partial)
    os.mkdir(partial, 0o700)
    copy_tree(source, partial, verbatim=True)
    os.rename(partial, target)
    for entry in os.listdir(source):
        remove_tree(source / entry)
    return False


def remove_tree(path: Path) -> None:
    """Remove a tree a guest may have shaped: with symlinks (never
    followed), with directories overlayfs left mode 000 (root ignores the
    mode; anyone else must restore it first), nested deeper than Python's
    recursion or PATH_MAX (then GNU rm, which walks any depth, finishes).
    Nothing of the session runs any more when this is called."""
    target = os.fspath(path)

    def unlock_and_retry(function, failed_path, exc_info):
        if not isinstance(exc_info[1], PermissionError):
            raise exc_info[1]
        for writable in (os.path.dirname(failed_path), failed_path):
            if not os.path.islink(writable):  # a guest's symlink may point anywhere
                with contextlib.suppress(OSError):
                    os.chmod(writable, 0o700)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            shutil.rmtree(failed_path, onerror=unlock_and_retry)
        else:
            function(failed_path)

    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not os.path.isdir(target):
        os.unlink(target)
        return
    try:
        shutil.rmtree(target, onerror=unlock_and_retry)
        return
    except (RecursionError, OSError):
        pass
    if os.geteuid() != 0:
        # -R never follows the symlinks it meets inside the tree.
        subprocess.run(["chmod", "-R", "u+rwx", "--", target], check=False, capture_output=True)
    done = subprocess.run(["rm", "-rf", "--one-file-system", "--", target], check=False, capture_output=True)
    if os.path.lexists(target):
        raise SandboxError(
            ErrorCode.SANDBOX_UNAVAILABLE,
            f"cannot remove {target}: {done.stderr.decode(errors='replace').strip()[:500]}",
        )
