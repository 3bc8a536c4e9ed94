"""Root filesystem images: a task's own environment, imported once into the
state directory, content-addressed.

``ImageStore.import_path(path)`` takes an OCI image layout (a directory, or
a tar of one: what ``skopeo copy ... oci:`` or ``podman save --format
oci-archive`` make), or a plain root filesystem (a directory, or a tar:
``docker export``, ``debootstrap``). Every OCI blob's digest is checked as
it is read. The layers are applied in order to one tree, so whiteouts and
opaque directories are resolved here, once, and the tree needs no overlay
whiteouts (which an unprivileged host could not make) when a session
mounts it::

    images/<hex>/root/          the image's root filesystem
    images/<hex>/image.json     its digest, config and what was skipped
    images/.lock                flock'd: shared while something comes to
                                depend on an image, exclusive to delete one

Unpacking never follows a link: each path is opened one component at a time
under the tree's directory fd (O_NOFOLLOW), and the host never follows a
link of an imported tree afterwards either (a session sees it as its root,
where every link resolves inside the image). An entry whose path leaves the
root or goes through a symbolic link, a hard link to nothing unpacked
before, a path deeper than MAX_DEPTH, or a layer that is no tar is refused
(SANDBOX_INVALID_ARGUMENT naming the layer and the entry). Device nodes and
FIFOs are skipped and reported; set-id bits and ownership are dropped. An
import that fails leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import gzip
import hashlib
import io
import json
import os
import posixpath
import re
import secrets
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Self

from ._errors import ErrorCode, SandboxError, invalid_argument

IMAGE_FORMAT = 1
RECORD_NAME = "image.json"
ROOT_NAME = "root"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": None,
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Kept from a layer's mode: permissions and the sticky bit, never set-id.
KEPT_MODE = 0o1777
# The most path components an entry may have (removing a tree recurses).
MAX_DEPTH = 128
# An interrupted import's staging directory older than this is swept.
STALE_IMPORT_SECONDS = 3600.0
# Host failures, not the image's: SANDBOX_UNAVAILABLE rather than a refusal.
HOST_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE})
_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Image:
    """An imported image: its digest (what prewarm and create name), the
    config a session takes from it, and the entries it skipped."""

    digest: str
    env: dict[str, str]
    working_dir: str
    user: str
    layers: int
    skipped: tuple[str, ...]
    source: str


def check_digest(digest: object) -> str:
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise invalid_argument(f"an image digest is 'sha256:' and 64 hex digits, not {digest!r}")
    return digest


class _Refused(Exception):
    """An entry the import refuses: becomes SANDBOX_INVALID_ARGUMENT."""


class ImageStore:
    """``state_dir/images``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, digest: str) -> Image:
        """An imported image (SANDBOX_NOT_FOUND if there is none)."""
        record = self.root / check_digest(digest).removeprefix("sha256:") / RECORD_NAME
        try:
            return _image(json.loads(record.read_text()))
        except FileNotFoundError:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no image {digest} in {self.root}") from None
        except (ValueError, KeyError, TypeError):
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"image record {record} is unreadable") from None

    def root_of(self, digest: str) -> Path:
        """The root filesystem of an image :meth:`get` found."""
        return self.root / check_digest(digest).removeprefix("sha256:") / ROOT_NAME

    @contextlib.contextmanager
    def locked(self, exclusive: bool) -> Iterator[None]:
        """Across processes: shared while a template or session is made to
        depend on an image (so it is not deleted from under it), exclusive
        while one is deleted."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    def list(self) -> list[Image]:
        images = []
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(self.root.iterdir()):
                if not entry.name.startswith(".") and (entry / RECORD_NAME).is_file():
                    try:
                        images.append(_image(json.loads((entry / RECORD_NAME).read_text())))
                    except (ValueError, KeyError, TypeError):
                        continue  # not a record this version wrote: not an image of ours
        return images

    def delete(self, digest: str) -> None:
        """Remove an image (the record first: a half-removed one is never
        listed)."""
        directory = self.root / check_digest(digest).removeprefix("sha256:")
        try:
            (directory / RECORD_NAME).unlink()
        except FileNotFoundError:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no image {digest} in {self.root}") from None
        _remove_tree(directory)

    def import_path(self, path: str | os.PathLike[str]) -> Image:
        """Import an OCI layout or a root filesystem (see the module
        docstring). Runs in a worker thread; importing the same image
        again is a no-op."""
        source = Path(path)
        if not source.exists():
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no image at {source}")
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep()
        staging = self.root / f".import-{secrets.token_hex(8)}"
        try:
            (staging / ROOT_NAME).mkdir(parents=True)
            with _Tree(staging / ROOT_NAME) as tree:
                described = _unpack(source, tree)
            (staging / RECORD_NAME).write_text(json.dumps(described))
            with self.locked(exclusive=False):  # not while a delete (of the same image) is half done
                self._place(staging, self.root / described["digest"].removeprefix("sha256:"))
            return _image(described)
        except _Refused as refusal:
            raise invalid_argument(f"{source}: {refusal}") from None
        except OSError as exc:
            if exc.errno in HOST_ERRNOS:
                raise SandboxError(ErrorCode.SANDBOX_UNAVAILABLE, f"cannot import {source}: {exc}") from exc
            raise invalid_argument(f"{source}: not an image this can import ({exc})") from None
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, EOFError, tarfile.TarError) as exc:
            raise invalid_argument(f"{source}: not an image this can import ({type(exc).__name__}: {exc})") from None
        finally:
            _remove_tree(staging)

    @staticmethod
    def _place(staging: Path, target: Path) -> None:
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            if (target / RECORD_NAME).is_file():
                return  # imported already (or meanwhile): the same content
            # What a delete left half done: it goes, this takes its place.
            _remove_tree(target)
            os.rename(staging, target)

    def _sweep(self) -> None:
        """Remove what imports that were killed left behind."""
        for entry in self.root.glob(".import-*"):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime > STALE_IMPORT_SECONDS:
                    _remove_tree(entry)


def session_environment(image: Image, defaults: Mapping[str, str], reserved: Collection[str]) -> dict[str, str]:
    """The default environment of a session on ``image``: ``defaults``
    (sandboxns's, never the host's) under the image's Env, which always
    has a PATH (the OCI default where the image gives none), but for the
    ``reserved`` names: a proxy or CA bundle an image names is not the
    session's, whose network is its policy's (the gateway sets those)."""
    return {**defaults, **{name: value for name, value in image.env.items() if name not in reserved}}


def _image(described: dict) -> Image:
    """An image record (as JSON made it: lists for tuples)."""
    fields = {field.name: described[field.name] for field in dataclasses.fields(Image)}
    return Image(**{**fields, "skipped": tuple(fields["skipped"])})


def _remove_tree(path: Path) -> None:
    """Remove what an import made, whatever modes its directories have."""
    if not path.exists():
        return

    def writable_then_retry(function: Any, name: str, _: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
        with contextlib.suppress(OSError):
            function(name)

    shutil.rmtree(path, onerror=writable_then_retry)


# -- sources ------------------------------------------------------------------


class _Blobs:
    """An OCI layout's blobs, from a directory or from a tar of one."""

    def __init__(self, source: Path) -> None:
        self._directory = source if source.is_dir() else None
        self._file = None if self._directory else _open_regular(source, follow=True)
        try:
            self._tar = None if self._file is None else tarfile.open(fileobj=self._file)  # noqa: SIM115 - closed by close()
        except BaseException:
            self._file.close()
            raise
        self._members = {} if self._tar is None else {_clean(m.name): m for m in self._tar.getmembers()}

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._file.close()

    def open(self, name: str) -> IO[bytes]:
        if self._directory is not None:
            return _open_regular(self._directory / name, follow=False)
        member = self._members.get(name)
        extracted = self._tar.extractfile(member) if member is not None and member.isfile() else None
        if extracted is None:
            raise _Refused(f"the layout has no file {name}")
        return extracted

    def json(self, name: str) -> dict:
        with self.open(name) as file:
            try:
                value = json.loads(file.read(16 << 20))
            except ValueError as exc:
                raise _Refused(f"{name} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _Refused(f"{name} is not a JSON object")
        return value

    def blob(self, descriptor: object) -> tuple[str, str]:
        """The blob a descriptor names (its path in the layout), after
        checking its digest."""
        if not isinstance(descriptor, dict) or not isinstance(descriptor.get("digest"), str):
            raise _Refused(f"a descriptor without a digest: {descriptor!r}")
        digest = descriptor["digest"]
        if not DIGEST.fullmatch(digest):
            raise _Refused(f"unsupported digest {digest!r} (sha256 only)")
        name = f"blobs/sha256/{digest.removeprefix('sha256:')}"
        hasher = hashlib.sha256()
        with self.open(name) as file:
            while chunk := file.read(_CHUNK):
                hasher.update(chunk)
        if f"sha256:{hasher.hexdigest()}" != digest:
            raise _Refused(f"blob {digest} does not match its digest")
        return name, digest


def _unpack(source: Path, tree: _Tree) -> dict:
    if _is_layout(source):
        return _unpack_layout(source, tree)
    if source.is_dir():
        return _unpack_directory(source, tree)
    return _unpack_rootfs_tar(source, tree)


def _open_regular(path: Path, follow: bool, expected: os.stat_result | None = None) -> IO[bytes]:
    """A regular file, opened for reading without waiting (a FIFO, a
    device or, unless ``follow``, a symbolic link is refused; with
    ``expected``, so is another file than the one looked at)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused(f"{path.name} is a symbolic link, not a file") from None
        raise
    info = os.fstat(fd)
    if (
        not stat.S_ISREG(info.st_mode)
        or expected is not None
        and (info.st_dev, info.st_ino)
        != (
            expected.st_dev,
            expected.st_ino,
        )
    ):
        os.close(fd)
        raise _Refused(f"{path.name} is not a regular file (or changed while it was read)")
    return os.fdopen(fd, "rb")


def _is_layout(source: Path) -> bool:
    if source.is_dir():
        return (source / "oci-layout").is_file()
    try:
        with _open_regular(source, follow=True) as raw, tarfile.open(fileobj=raw) as archive:
            return any(_clean(name) == "oci-layout" for name in archive.getnames())
    except (tarfile.TarError, OSError) as exc:
        raise _Refused(f"neither a directory nor a tar: {exc}") from None


def _unpack_layout(source: Path, tree: _Tree) -> dict:
    blobs = _Blobs(source)
    try:
        index = blobs.json("index.json")
        manifests = [m for m in index.get("manifests", []) if isinstance(m, dict)]
        if len(manifests) != 1:
            raise _Refused(f"index.json lists {len(manifests)} manifests; one image per import")
        manifest_name, manifest_digest = blobs.blob(manifests[0])
        manifest = blobs.json(manifest_name)
        if manifest.get("mediaType", MANIFEST_TYPES[0]) not in MANIFEST_TYPES:
            raise _Refused(f"{manifest_digest} is not an image manifest ({manifest.get('mediaType')})")
        config_name, _ = blobs.blob(manifest.get("config"))
        config = blobs.json(config_name).get("config") or {}
        layers = manifest.get("layers")
        if not isinstance(layers, list):
            raise _Refused("the manifest lists no layers")
        for number, descriptor in enumerate(layers, 1):
            name, digest = blobs.blob(descriptor)
            media_type = descriptor.get("mediaType", "application/vnd.oci.image.layer.v1.tar")
            if media_type not in LAYER_TYPES:
                raise _Refused(f"layer {number} ({digest}) has an unsupported type {media_type}")
            compressed = LAYER_TYPES[media_type] == "gzip"
            tree.apply_layer(functools.partial(_layer_stream, blobs, name, compressed), f"layer {number}")
        return _described(manifest_digest, config, len(layers), tree, str(source))
    finally:
        blobs.close()


# A layer's entries: each tar header, and how to open its content.
Entries = Iterator[tuple[tarfile.TarInfo, Callable[[], IO[bytes]]]]


def _entries_of(layer: tarfile.TarFile) -> Entries:
    for member in layer:
        yield member, functools.partial(layer.extractfile, member)


@contextlib.contextmanager
def _layer_stream(blobs: _Blobs, name: str, compressed: bool) -> Iterator[Entries]:
    with blobs.open(name) as raw:
        stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if compressed else raw
        with tarfile.open(fileobj=stream, mode="r|") as layer:
            yield _entries_of(layer)


def _unpack_rootfs_tar(source: Path, tree: _Tree) -> dict:
    hasher = hashlib.sha256()
    with _open_regular(source, follow=True) as file:
        while chunk := file.read(_CHUNK):
            hasher.update(chunk)

    @contextlib.contextmanager
    def stream() -> Iterator[Entries]:
        with _open_regular(source, follow=True) as raw, tarfile.open(fileobj=raw, mode="r|*") as layer:
            yield _entries_of(layer)

    tree.apply_layer(stream, "the root filesystem", whiteouts=False)
    return _described(f"sha256:{hasher.hexdigest()}", {}, 1, tree, str(source))


def _unpack_directory(source: Path, tree: _Tree) -> dict:
    """A directory as a layer, its entries described as tar headers (never
    following its symbolic links); its canonical content gives the
    digest."""
    hasher = hashlib.sha256()
    for path in sorted(_walk(source)):
        info = os.lstat(source / path)
        if stat.S_ISLNK(info.st_mode):
            content = os.readlink(source / path)
        elif stat.S_ISREG(info.st_mode):
            content_hash = hashlib.sha256()
            with _open_regular(source / path, follow=False, expected=info) as file:
                while chunk := file.read(_CHUNK):
                    content_hash.update(chunk)
            content = content_hash.hexdigest()
        else:
            content = ""
        # One JSON line per entry: no field can pass for another.
        hasher.update(json.dumps([path, stat.S_IFMT(info.st_mode), info.st_mode & KEPT_MODE, content]).encode() + b"\n")

    def describe(describer: tarfile.TarFile, path: str) -> tuple[tarfile.TarInfo, Callable[[], IO[bytes]]]:
        info = os.lstat(source / path)
        header = describer.gettarinfo(source / path, arcname=path)
        if header is None:  # a socket: not for an image
            header = tarfile.TarInfo(path)
            header.type = tarfile.FIFOTYPE
        return header, functools.partial(_open_regular, source / path, False, info)

    @contextlib.contextmanager
    def stream() -> Iterator[Entries]:
        with tarfile.open(fileobj=io.BytesIO(), mode="w") as describer:
            yield (describe(describer, path) for path in sorted(_walk(source)))

    tree.apply_layer(stream, "the root filesystem", whiteouts=False)
    return _described(f"sha256:{hasher.hexdigest()}", {}, 1, tree, str(source))


def _walk(source: Path) -> Iterator[str]:
    def unreadable(exc: OSError) -> None:
        raise exc

    for directory, names, files in os.walk(source, onerror=unreadable):
        relative = os.path.relpath(directory, source)
        for name in names + files:
            yield name if relative == "." else f"{relative}/{name}"


def _described(digest: str, config: dict, layers: int, tree: _Tree, source: str) -> dict:
    env = {"PATH": DEFAULT_PATH}
    for entry in config.get("Env") or []:
        name, _, value = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if not name or "\0" in entry or "=" not in entry:
            # Every command of the session would carry it, and be refused.
            tree.skipped.append(f"config Env entry {entry!r}: not NAME=VALUE")
            continue
        env[name] = value
    working_dir = config.get("WorkingDir") or "/"
    return {
        "format": IMAGE_FORMAT,
        "digest": digest,
        "env": env,
        "working_dir": working_dir if isinstance(working_dir, str) else "/",
        "user": str(config.get("User") or ""),
        "layers": layers,
        "skipped": tree.skipped,
        "source": source,
    }


def _clean(name: str) -> str:
    """A tar member's path, relative and without './' or a trailing '/'."""
    return posixpath.normpath("/" + name).lstrip("/") if name not in ("", ".", "./") else ""


# -- the tree -------------------------------------------------------------------


class _Tree:
    """The image's root being built, reached only through its directory
    fd and O_NOFOLLOW opens."""

    def __init__(self, root: Path) -> None:
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.skipped: list[str] = []
        self._current: str | None = None  # the entry being applied

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self._root_fd)

    def apply_layer(self, open_layer: Any, what: str, whiteouts: bool = True) -> None:
        """A layer's whiteouts first (they hide what the layers below
        made), then its entries (a plain root filesystem has nothing below:
        its files named like whiteouts are files)."""
        if whiteouts:
            with self._reading(what), open_layer() as entries:
                for member, _ in entries:
                    self._current = member.name
                    parts = self._parts(member.name, what)
                    if parts and parts[-1] == OPAQUE_MARKER:
                        self._empty(parts[:-1], what, member.name)
                    elif parts and parts[-1].startswith(WHITEOUT_PREFIX):
                        hidden = parts[-1].removeprefix(WHITEOUT_PREFIX)
                        if hidden in ("", ".", ".."):
                            raise _Refused(f"{what}: whiteout {member.name!r} names no entry")
                        self._remove(parts[:-1] + [hidden], what, member.name)
        with self._reading(what), open_layer() as entries:
            for member, content in entries:
                self._current = member.name
                parts = self._parts(member.name, what)
                if not parts or whiteouts and parts[-1].startswith(WHITEOUT_PREFIX):
                    continue
                self._add(member, content, parts, what)

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """A layer's failures as refusals naming it and the entry at hand
        (a truncated or garbled tar, a name the file system refuses)."""
        self._current = None
        try:
            yield
        except _Refused:
            raise
        except OSError as exc:
            if exc.errno in HOST_ERRNOS:
                raise
            raise _Refused(f"{what}: entry {self._current!r}: {exc.strerror or exc}") from None
        except (EOFError, tarfile.TarError, zlib.error, ValueError, IndexError) as exc:
            at = f"after entry {self._current!r}" if self._current else "at its start"
            raise _Refused(f"{what} is not a readable tar ({at}): {exc}") from None

    def _parts(self, name: str, what: str) -> list[str]:
        parts = [part for part in name.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise _Refused(f"{what}: entry {name!r} leaves the image root")
        if len(parts) > MAX_DEPTH:
            raise _Refused(f"{what}: entry {name[:200]!r}... is deeper than {MAX_DEPTH} directories")
        return parts

    @contextlib.contextmanager
    def _parent(
        self, parts: list[str], what: str, name: str, create: bool, hides: bool = False
    ) -> Iterator[int | None]:
        """The directory fd of an entry's parent (made if ``create``), or
        None if it is not there; a symbolic link on the way is refused,
        except for a whiteout (``hides``): there is nothing to hide below a
        link or a file, as overlayfs makes a directory over them opaque."""
        fd = os.dup(self._root_fd)
        try:
            for part in parts[:-1]:
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        yield None
                        return
                    os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and hides:
                        yield None
                        return
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _Refused(f"{what}: entry {name!r} goes through a non-directory ({part})") from None
                    raise
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _remove(self, parts: list[str], what: str, name: str) -> None:
        with self._parent(parts, what, name, create=False, hides=True) as parent:
            if parent is not None:
                _remove_at(parent, parts[-1])

    def _empty(self, parts: list[str], what: str, name: str) -> None:
        with self._parent(parts + ["."], what, name, create=False, hides=True) as directory:
            if directory is not None:
                for entry in os.listdir(directory):
                    _remove_at(directory, entry)

    def _add(self, member: tarfile.TarInfo, content: Callable[[], IO[bytes]], parts: list[str], what: str) -> None:
        name = member.name
        if member.isdev() or member.isfifo():
            self.skipped.append(f"{what}: {'/'.join(parts)} (a device node or FIFO)")
            return
        with self._parent(parts, what, name, create=True) as parent:
            assert parent is not None
            last = parts[-1]
            mode = member.mode & KEPT_MODE
            if member.isdir():
                try:
                    info = os.stat(last, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    os.mkdir(last, 0o700, dir_fd=parent)
                else:
                    if not stat.S_ISDIR(info.st_mode):
                        _remove_at(parent, last)
                        os.mkdir(last, 0o700, dir_fd=parent)
                _chmod_directory(parent, last, mode | 0o700)
                return
            _remove_at(parent, last)
            if member.issym():
                if not member.linkname:
                    raise _Refused(f"{what}: symbolic link {name!r} has no target")
                os.symlink(member.linkname, last, dir_fd=parent)
            elif member.islnk():
                target = self._parts(member.linkname, what)
                if not target:
                    raise _Refused(f"{what}: hard link {name!r} names the root")
                with self._parent(target, what, member.linkname, create=False) as source:
                    try:
                        if source is None:
                            raise FileNotFoundError
                        os.link(target[-1], last, src_dir_fd=source, dst_dir_fd=parent, follow_symlinks=False)
                    except FileNotFoundError:
                        raise _Refused(f"{what}: hard link {name!r} names nothing unpacked before") from None
            elif member.isreg():
                fd = os.open(last, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=parent)
                with os.fdopen(fd, "wb") as out, content() as data:
                    shutil.copyfileobj(data, out, _CHUNK)
                    os.fchmod(out.fileno(), mode)
            else:
                self.skipped.append(f"{what}: {'/'.join(parts)} (an entry of tar type {member.type!r})")


def _chmod_directory(parent: int, name: str, mode: int) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _remove_at(parent: int, name: str) -> None:
    """Remove ``name`` under the directory fd, whatever it is."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
        for entry in os.listdir(fd):
            _remove_at(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
