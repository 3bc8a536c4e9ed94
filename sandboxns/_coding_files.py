"""The file side of the coding tools: synchronous operations on a workspace
directory fd, run in worker threads (see HostWorkspaceIO.workspace_call).

Stricter than the session's byte I/O: every path is resolved with openat2
RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, so no symlink is followed anywhere.
The tools authorize a path segment by segment; a directory swapped for a
symlink after that (to lead somewhere not authorized) makes the operation
fail closed instead. Walks (glob, search) never descend through symlinks
and skip dependency and VCS directories.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ._errors import ErrorCode, SandboxError
from ._files import discard_temporary, list_directory_fd, open_beneath_no_symlinks, path_error, write_temporary
from ._paths import WORKSPACE

SKIPPED_DIRECTORIES = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "node_modules",
        "__pycache__",
        ".venv",
        ".tox",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
    }
)


def _relative(guest_path: str) -> str:
    return "." if guest_path == WORKSPACE else guest_path[len(WORKSPACE) + 1 :]


def open_path(root: int, guest_path: str, flags: int, mode: int = 0) -> int:
    try:
        return open_beneath_no_symlinks(root, _relative(guest_path), flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise path_error(exc, guest_path) from None


def _regular_file(root: int, guest_path: str) -> int:
    fd = open_path(root, guest_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} is {what}")
    return fd


def _read_all(fd: int, limit: int, guest_path: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > limit:
        raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path} has {size} bytes; the limit is {limit}")
    data = bytearray()
    while chunk := os.pread(fd, limit + 1 - len(data), len(data)):
        data += chunk
        if len(data) > limit:
            raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path} grew over {limit} bytes")
    return bytes(data)


@dataclass(frozen=True)
class ReadResult:
    data: bytes
    size: int
    sha256: str
    offset: int
    next_offset: int | None


def _continues(byte: int) -> bool:
    return (byte & 0xC0) == 0x80  # 10xxxxxx: inside a UTF-8 character


def utf8_window(max_bytes: int) -> int:
    """How many bytes to cut ``max_bytes`` from with utf8_slice: up to 3
    skipped at the start, a whole character (up to 4 bytes) even when fewer
    are asked for, and one more to see whether the last character goes on."""
    return max(max_bytes, 4) + 4


def utf8_slice(window: bytes, max_bytes: int) -> tuple[int, int]:
    """Start and end of at most ``max_bytes`` of ``window`` that neither
    begin nor end inside a UTF-8 character (for text that is UTF-8; other
    bytes are cut where they fall). ``window`` holds utf8_window(max_bytes)
    bytes unless the file ended."""
    start = 0
    while start < min(3, len(window)) and _continues(window[start]):
        start += 1
    end = min(start + max_bytes, len(window))
    if end < len(window):  # the first byte left out may continue a character
        cut = end
        while cut > start and end - cut < 3 and _continues(window[cut]):
            cut -= 1
        if cut > start:
            end = cut
        elif _continues(window[end]):
            # Fewer bytes asked for than the character has: give it whole.
            while end < len(window) and end - start < 4 and _continues(window[end]):
                end += 1
    return start, end


def read_slice(root: int, guest_path: str, offset: int, max_bytes: int, hash_limit: int) -> ReadResult:
    """Up to ``max_bytes`` from ``offset``, both moved to character
    boundaries, and the sha256 of the whole file (which must not be over
    ``hash_limit`` bytes)."""
    fd = _regular_file(root, guest_path)
    try:
        digest = hashlib.sha256()
        size = 0
        while chunk := os.pread(fd, 1 << 20, size):
            digest.update(chunk)
            size += len(chunk)
            if size > hash_limit:
                raise SandboxError(ErrorCode.SANDBOX_LIMIT, f"{guest_path} is over {hash_limit} bytes")
        window = os.pread(fd, utf8_window(max_bytes), offset) if offset < size else b""
    finally:
        os.close(fd)
    start, end = utf8_slice(window, max_bytes)
    next_offset = offset + end if offset + end < size else None
    return ReadResult(window[start:end], size, digest.hexdigest(), offset + start, next_offset)


def invalid_utf8_offsets(data: bytes, limit: int) -> list[int]:
    """Where in ``data`` the first ``limit`` sequences that are not UTF-8
    begin: each is one U+FFFD in ``data.decode("utf-8", "replace")``."""
    offsets: list[int] = []
    position = 0
    while len(offsets) < limit:
        try:
            data[position:].decode("utf-8")
            break
        except UnicodeDecodeError as exc:
            offsets.append(position + exc.start)
            position += exc.end
    return offsets


def read_whole(root: int, guest_path: str, limit: int) -> bytes:
    fd = _regular_file(root, guest_path)
    try:
        return _read_all(fd, limit, guest_path)
    finally:
        os.close(fd)


def missing_directories(root: int, guest_path: str) -> list[str]:
    """The ancestors of ``guest_path`` that do not exist yet, outermost
    first (refusing a symlink or a file in the way)."""
    missing = []
    parent = guest_path.rsplit("/", 1)[0]
    while parent != WORKSPACE:
        try:
            fd = open_beneath_no_symlinks(root, _relative(parent), os.O_PATH | os.O_NOFOLLOW)
        except FileNotFoundError:
            missing.append(parent)
            parent = parent.rsplit("/", 1)[0]
            continue
        except OSError as exc:
            raise path_error(exc, parent) from None
        mode = os.fstat(fd).st_mode
        os.close(fd)
        if stat.S_ISLNK(mode):
            raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"{parent} is a symlink")
        if not stat.S_ISDIR(mode):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{parent} is not a directory")
        break
    return list(reversed(missing))


def write_atomically(
    root: int,
    guest_path: str,
    data: bytes,
    overwrite: bool,
    expected_sha256: str | None = None,
    authorized_directories: tuple[str, ...] | None = None,
) -> list[str]:
    """Create (with missing parent directories) or replace a file by a new
    file renamed over it. Returns the directories created, which must be
    ``authorized_directories`` when given. Without ``overwrite`` an existing
    file is never replaced (the new one is linked into place, which fails if
    the name exists); with ``expected_sha256``, refuses unless the current
    content still has that hash (checked just before the rename)."""
    created = []
    missing = missing_directories(root, guest_path)
    if authorized_directories is not None and tuple(missing) != authorized_directories:
        raise StaleError(guest_path)
    for directory in missing:
        parent_fd = open_path(root, directory.rsplit("/", 1)[0], os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(directory.rsplit("/", 1)[1], 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise path_error(exc, directory) from None
        finally:
            os.close(parent_fd)
        created.append(directory)
    parent, name = guest_path.rsplit("/", 1)
    parent_fd = open_path(root, parent, os.O_PATH | os.O_DIRECTORY)
    temporary = None
    try:
        try:
            current = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        if current is not None and not overwrite:
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} exists; pass overwrite=true")
        if current is not None and not stat.S_ISREG(current.st_mode):
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} is not a regular file")
        mode = stat.S_IMODE(current.st_mode) if current is not None else 0o644
        temporary = write_temporary(parent_fd, name, data, mode)
        if expected_sha256 is not None:
            try:
                now = read_whole(root, guest_path, max(len(data), current.st_size if current else 0))
            except SandboxError:
                raise StaleError(guest_path) from None  # grew, vanished or turned into something else
            if hashlib.sha256(now).hexdigest() != expected_sha256:
                raise StaleError(guest_path)
        if overwrite:
            os.rename(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        else:
            try:
                os.link(temporary, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
            except FileExistsError:
                raise SandboxError(
                    ErrorCode.SANDBOX_INVALID_ARGUMENT, f"{guest_path} exists; pass overwrite=true"
                ) from None
            os.unlink(temporary, dir_fd=parent_fd)
        temporary = None
    except OSError as exc:
        raise path_error(exc, guest_path) from None
    finally:
        discard_temporary(parent_fd, temporary)
        os.close(parent_fd)
    return created


class StaleError(Exception):
    """The file changed since the caller read it."""


@dataclass(frozen=True)
class Entry:
    path: str  # guest path
    kind: str  # file, directory, symlink, other
    size: int


def list_directory(root: int, guest_path: str) -> list[Entry]:
    fd = open_path(root, guest_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return [Entry(f"{guest_path}/{e.name}", e.kind, e.size) for e in list_directory_fd(fd)]
    finally:
        os.close(fd)


def walk(root: int, guest_path: str, max_depth: int, max_entries: int) -> list[Entry]:
    """Entries under a directory, depth first, never through a symlink,
    skipping dependency/VCS directories; at most ``max_entries`` are looked
    at."""
    found: list[Entry] = []
    pending = [(guest_path, 0)]
    while pending:
        directory, depth = pending.pop()
        try:
            entries = list_directory(root, directory)
        except SandboxError:
            continue  # vanished or swapped meanwhile: fail closed, skip it
        for entry in entries:
            if len(found) >= max_entries:
                return found
            found.append(entry)
            name = entry.path.rsplit("/", 1)[1]
            if entry.kind == "directory" and depth + 1 < max_depth and name not in SKIPPED_DIRECTORIES:
                pending.append((entry.path, depth + 1))
    return found


def glob_match(pattern: str, relative: str) -> bool:
    """Whether a workspace-relative path matches a glob: ``*``, ``?`` and
    ``[...]`` within one path segment, ``**`` for any number of segments.
    Segment by segment with fnmatch (which does not backtrack
    exponentially) and a table for ``**``, so no pattern a model writes can
    take long."""
    parts, names = pattern.split("/"), relative.split("/")
    # reachable[j]: the pattern so far can match exactly the first j names.
    reachable = [True] + [False] * len(names)
    for part in parts:
        if part == "**":
            for j in range(1, len(names) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            reachable = [False] + [
                reachable[j - 1] and fnmatch.fnmatchcase(names[j - 1], part) for j in range(1, len(names) + 1)
            ]
    return reachable[len(names)]


@dataclass(frozen=True)
class Match:
    path: str
    line: int
    text: str
    before: list[str]
    after: list[str]


class Deadline(float):
    """A time.monotonic() deadline that stays one on another host: it is
    pickled as the seconds left, and unpickled against that host's clock."""

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def __reduce__(self):
        return (Deadline.after, (self - time.monotonic(),))


class SearchTimeout(Exception):
    """A search ran out of its time budget (a pathological expression)."""


def search_lines(text: str, pattern, limit: int, deadline: float, context: int = 0) -> Iterator[tuple[int, list[str]]]:
    """(line index, lines) for up to ``limit`` lines of ``text`` matching the
    compiled ``regex`` pattern, giving up (SearchTimeout) at ``deadline``."""
    lines = text.splitlines()
    found = 0
    for number, line in enumerate(lines):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SearchTimeout
        try:
            hit = pattern.search(line, timeout=remaining)
        except TimeoutError:
            raise SearchTimeout from None
        if hit:
            yield number, lines
            found += 1
            if found >= limit:
                return


def search_contents(
    root: int, paths: list[str], pattern, context: int, limit: int, deadline: float, max_file_bytes: int
) -> list[Match]:
    """Lines matching ``pattern`` in the given files (skipping binary ones,
    ones too large, and ones that vanished or became symlinks meanwhile)."""
    matches: list[Match] = []
    for guest_path in paths:
        try:
            data = read_whole(root, guest_path, max_file_bytes)
        except SandboxError:
            continue
        if b"\0" in data[:8192]:
            continue
        for number, lines in search_lines(data.decode("utf-8", "replace"), pattern, limit + 1 - len(matches), deadline):
            matches.append(
                Match(guest_path, number + 1, lines[number][:500], lines[max(0, number - context) : number],
                      lines[number + 1 : number + 1 + context])
            )  # fmt: skip
        if len(matches) > limit:
            break
    return matches
