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
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from ._errors import ErrorCode, SandboxError
from ._templates import _copy_file

_OVERLAY_XATTRS = b"user.overlay."
_OPAQUE = "user.overlay.opaque"


def is_whiteout(entry: os.stat_result) -> bool:
    return stat.S_ISCHR(entry.st_mode) and entry.st_rdev == 0


def is_opaque(path: str) -> bool:
    """Whether an upper layer's directory hides the ones below (reading a
    user xattr needs read access, which a guest's chmod may have taken)."""
    with _readable(path, os.lstat(path)):
        try:
            return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
        except OSError:
            return False


@contextlib.contextmanager
def _readable(path: str, info: os.stat_result) -> Iterator[None]:
    """Let the owner read (or list) what a guest made unreadable, for the
    moment (root reads it anyway)."""
    wanted = 0o500 if stat.S_ISDIR(info.st_mode) else 0o400
    if os.geteuid() == 0 or info.st_mode & wanted == wanted:
        yield
        return
    os.chmod(path, stat.S_IMODE(info.st_mode) | wanted)
    try:
        yield
    finally:
        os.chmod(path, stat.S_IMODE(info.st_mode))


def _copy_xattrs(source: str, target: str) -> None:
    """A file's own extended attributes, without overlayfs's."""
    try:
        names = os.listxattr(source, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        if name.encode().startswith(_OVERLAY_XATTRS):
            continue
        with contextlib.suppress(OSError):
            os.setxattr(target, name, os.getxattr(source, name, follow_symlinks=False), follow_symlinks=False)


def _copy_entry(source: str, info: os.stat_result, target: str, links: dict[tuple[int, int], str]) -> None:
    """One non-directory entry, as what it is; a file with several links in
    the tree is copied once and linked again."""
    mode = info.st_mode
    if stat.S_ISREG(mode) and info.st_nlink > 1:
        earlier = links.get((info.st_dev, info.st_ino))
        if earlier is not None:
            os.link(earlier, target)
            return
        links[(info.st_dev, info.st_ino)] = target
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(source), target)
        return
    if stat.S_ISREG(mode):
        with _readable(source, info):
            reading = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            writing = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _copy_file(reading, writing)
            finally:
                os.close(writing)
        finally:
            os.close(reading)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(target, 0o600)
    elif stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return  # a socket is no file to copy; a guest makes no devices (whiteouts are handled above)
    _copy_xattrs(source, target)
    os.chmod(target, stat.S_IMODE(mode))
    os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))


def merge_layers(layers: Sequence[Path], target: Path) -> None:
    """Write into the empty directory ``target`` the tree overlayfs shows
    for ``layers`` (topmost first): whiteouts hide what is below, an opaque
    directory hides the directories below, and a name is what its topmost
    layer says. With one layer, a plain copy of it."""
    _merge([str(layer) for layer in layers], str(target), {}, top=True)


def copy_tree(source: Path, target: Path) -> None:
    """Copy the whole tree ``source`` into the empty directory ``target``,
    sharing blocks where the file system can (see _templates)."""
    merge_layers([source], target)


def _merge(directories: list[str], target: str, links: dict[tuple[int, int], str], top: bool = False) -> None:
    with contextlib.ExitStack() as readable:  # for as long as what is below them is copied
        entries: dict[str, list[tuple[str, os.stat_result]]] = {}
        for directory in directories:
            readable.enter_context(_readable(directory, os.lstat(directory)))
            with os.scandir(directory) as listing:
                for entry in listing:
                    entries.setdefault(entry.name, []).append((entry.path, entry.stat(follow_symlinks=False)))
        _merge_entries(entries, target, links)
    if top:
        info = os.lstat(directories[0])
        os.chmod(target, stat.S_IMODE(info.st_mode))


def _merge_entries(
    entries: dict[str, list[tuple[str, os.stat_result]]], target: str, links: dict[tuple[int, int], str]
) -> None:
    """Copy one directory's entries, each as its topmost layer has it."""
    for name, found in entries.items():
        path, info = found[0]
        if is_whiteout(info):
            continue  # a name deleted above what is below (or a whiteout a guest made: no file)
        destination = os.path.join(target, name)
        if not stat.S_ISDIR(info.st_mode):
            _copy_entry(path, info, destination, links)
            continue
        below = [path]
        for lower, lower_info in found[1:]:
            if is_opaque(below[-1]) or not stat.S_ISDIR(lower_info.st_mode):
                break
            below.append(lower)
        os.mkdir(destination, 0o700)
        _merge(below, destination, links)
        _copy_xattrs(path, destination)
        os.chmod(destination, stat.S_IMODE(info.st_mode))
        os.utime(destination, ns=(info.st_atime_ns, info.st_mtime_ns))


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


def empty_directory(path: Path) -> bool:
    with contextlib.suppress(FileNotFoundError), os.scandir(path) as listing:
        return next(listing, None) is None
    return True


def move_tree(source: Path, target: Path) -> None:
    """Move ``source`` to ``target`` (which must not exist): one rename on
    one file system; across file systems (a capped workspace lives on its
    own image) a copy, put in place whole, after which ``source`` is
    emptied. Either way ``target``, once it exists, holds all of it."""
    try:
        os.rename(source, target)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    partial = target.with_name(f"{target.name}.partial")
    remove_tree(partial)
    os.mkdir(partial, 0o700)
    copy_tree(source, partial)
    os.rename(partial, target)
    for entry in os.listdir(source):
        remove_tree(source / entry)


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
