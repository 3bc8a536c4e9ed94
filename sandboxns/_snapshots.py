"""Snapshots: a session's workspace frozen as an immutable layer, from
which any number of sessions start (a fork), each writing on a layer of its
own over it.

Layout, beside sessions/ and templates/ in the state directory::

    snapshots/<id>/snapshot.json    the record (see Snapshot; replaced
                                    by exchange with .snapshot.json.spare
                                    once measured, see write_json)
    snapshots/<id>/files/           its layer
    snapshots/lock                  flock'd while a snapshot is taken,
                                    deleted, or a session made from one

With an overlay (the native driver), a session's workspace is a stack: its
own upper directory over the layers of the snapshots it descends from,
topmost first, over its template. Taking a snapshot moves the upper
directory into the store (a rename: nothing is copied, whatever the
workspace holds) and gives the session a new, empty one above it. Forking
starts sessions over the same stack. A stack deeper than MAX_STACK_DEPTH
layers is flattened when the next snapshot is taken: merged into one whole
layer (which costs a copy of the workspace, once).

Without an overlay (the bwrap driver, or a kernel that refuses overlayfs
here) a snapshot is a whole copy of the workspace, and a fork copies it
back: by reflink where the file system shares blocks, byte by byte
otherwise. A session bound to a host directory is snapshotted only by copy,
when the caller asks for one.

A session's record (session.json) lists the snapshots its workspace stands
on ("layers"), so a snapshot is deleted only when no session and no other
snapshot needs it; deleting a session never deletes a layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ._errors import ErrorCode, SandboxError, invalid_argument
from ._ffi import exchange
from ._layers import remove_tree, tree_bytes
from ._rootfs_images import DIGEST as IMAGE_DIGEST
from ._templates import KEY_PATTERN

SNAPSHOT_FORMAT = 1
SNAPSHOT_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
# Lower layers an overlay workspace may stack (snapshots and its template);
# csrc/holder.h's MAX_OVERLAY_LOWERS is the same. Each layer costs every
# lookup that misses the layers above it.
MAX_STACK_DEPTH = 32
MAX_SNAPSHOT_NAME = 256
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class Snapshot:
    """A frozen workspace. Pass it (or its :meth:`to_dict`, or its ``id``)
    to ``Backend.create(snapshot=...)``.

    ``parent``: the snapshot the workspace descended from when this one was
    taken, if any. ``created``: Unix time. ``bytes``: the size of the files
    in its own layer (None until measured: :meth:`Backend.snapshots`
    measures). ``template``: the template key of the sessions it comes from
    (a session made from it reports the same one). ``layers``: the snapshots
    whose layers make up its workspace, itself first (one, for a whole
    copy); ``on_template``: whether the template's files lie beneath them.
    ``image``: the digest of the image its sessions run on, if any."""

    id: str
    name: str | None
    parent: str | None
    created: float
    bytes: int | None
    backend: str
    template: str | None
    layers: tuple[str, ...] = field(default=())
    on_template: bool = False
    image: str | None = None

    @property
    def depth(self) -> int:
        """How many read-only layers a session made from it stands on."""
        return len(self.layers) + self.on_template

    def to_dict(self) -> dict:
        """A JSON-serialisable form, which :meth:`from_dict` reads back."""
        return {
            "format": SNAPSHOT_FORMAT,
            "id": self.id,
            "name": self.name,
            "parent": self.parent,
            "created": self.created,
            "bytes": self.bytes,
            "backend": self.backend,
            "template": self.template,
            "layers": list(self.layers),
            "on_template": self.on_template,
            # Only where there is one: records without are what they were.
            **({"image": self.image} if self.image is not None else {}),
        }

    @classmethod
    def from_dict(cls, value: object) -> Snapshot:
        """Read a :meth:`to_dict` form; anything else is
        SANDBOX_INVALID_ARGUMENT saying what is wrong with it."""
        problem = _record_problem(value)
        if problem is not None:
            raise invalid_argument(f"not a snapshot record: {problem}")
        return cls(
            id=value["id"],
            name=value["name"],
            parent=value["parent"],
            created=float(value["created"]),
            bytes=value["bytes"],
            backend=value["backend"],
            template=value["template"],
            layers=tuple(value["layers"]),
            on_template=value["on_template"],
            image=value.get("image"),
        )


def _record_problem(value: object) -> str | None:
    if not isinstance(value, Mapping):
        return f"it is a {type(value).__name__}, not a mapping"
    if value.get("format") != SNAPSHOT_FORMAT:
        return f"format {value.get('format')!r} is not {SNAPSHOT_FORMAT}"
    expected = {"format", "id", "name", "parent", "created", "bytes", "backend", "template", "layers", "on_template"}
    if set(value) - {"image"} != expected:  # records made before images have none
        return f"its fields are {sorted(value)}, not {sorted(expected | {'image'})}"
    image = value.get("image")
    if not (image is None or (isinstance(image, str) and IMAGE_DIGEST.fullmatch(image))):
        return "its image is not an image digest"
    if not _is_id(value["id"]) or not (value["parent"] is None or _is_id(value["parent"])):
        return "its id or parent is not a snapshot id (32 hex digits)"
    if not (value["name"] is None or isinstance(value["name"], str)):
        return "its name is not a string"
    created = value["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        return "its creation time is not a number"
    size = value["bytes"]
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        return "its size is not a number of bytes"
    if not isinstance(value["backend"], str):
        return "it names no backend"
    if not (
        value["template"] is None or (isinstance(value["template"], str) and KEY_PATTERN.fullmatch(value["template"]))
    ):
        return "its template is not a template key"
    layers, on_template = value["layers"], value["on_template"]
    if not isinstance(on_template, bool) or (on_template and value["template"] is None):
        return "on_template must be true or false, and true only with a template"
    if not isinstance(layers, list) or not layers or layers[0] != value["id"] or not all(map(_is_id, layers)):
        return "its layers must list snapshot ids, its own first"
    if len(layers) + on_template > MAX_STACK_DEPTH or len(set(layers)) != len(layers):
        return f"its layers repeat, or stack deeper than {MAX_STACK_DEPTH}"
    return None


def _is_id(value: object) -> bool:
    return isinstance(value, str) and SNAPSHOT_ID_PATTERN.fullmatch(value) is not None


def check_snapshot_name(name: object) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not name or len(name) > MAX_SNAPSHOT_NAME or not name.isprintable():
        raise invalid_argument(
            f"a snapshot's name must be printable text of 1 to {MAX_SNAPSHOT_NAME} characters, not {name!r}"
        )
    return name


def snapshot_id_of(snapshot: object) -> str:
    """The id a caller's ``snapshot=`` names: a :class:`Snapshot`, its dict
    form, or the id itself."""
    if isinstance(snapshot, Snapshot):
        return snapshot.id
    if isinstance(snapshot, Mapping):
        return Snapshot.from_dict(snapshot).id
    if _is_id(snapshot):
        return snapshot
    raise invalid_argument(
        f"snapshot must be a Snapshot, its to_dict() form or its id (32 hex digits), not {snapshot!r}"
    )


def new_snapshot_id() -> str:
    return secrets.token_hex(16)


class SnapshotStore:
    """``state_dir/snapshots``. Its methods run in worker threads."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def files_of(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / "files"

    def staging(self, snapshot_id: str) -> Path:
        """Where a snapshot is made before :meth:`commit` puts it in place,
        so that nobody ever finds half of one."""
        return self.root / f".new-{snapshot_id}"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive use of the store's dependencies, across processes: no
        snapshot is deleted while a session is being made over it."""
        self.root.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def begin(self, snapshot: Snapshot) -> Path:
        """Make the snapshot's staging directory with its record; returns
        where its layer goes (not made yet)."""
        staging = self.staging(snapshot.id)
        self.root.mkdir(mode=0o700, exist_ok=True)
        staging.mkdir(mode=0o700)
        write_json(staging / "snapshot.json", snapshot.to_dict())
        return staging / "files"

    def commit(self, snapshot_id: str) -> None:
        os.rename(self.staging(snapshot_id), self.root / snapshot_id)

    def abandon(self, snapshot_id: str) -> None:
        remove_tree(self.staging(snapshot_id))

    def exists(self, snapshot_id: str) -> bool:
        return (self.root / snapshot_id / "snapshot.json").is_file()

    def read(self, snapshot_id: str) -> Snapshot:
        path = self.root / snapshot_id / "snapshot.json"
        try:
            data = read_record(path, MAX_RECORD_BYTES) or b""
        except FileNotFoundError:
            raise SandboxError(
                ErrorCode.SANDBOX_NOT_FOUND, f"no snapshot {snapshot_id} in {self.root.parent}"
            ) from None
        try:
            record = json.loads(data)
        except ValueError:
            record = None
        problem = _record_problem(record)
        if problem is None and record["id"] != snapshot_id:
            problem = f"it names snapshot {record['id']}"
        if problem is not None:
            raise SandboxError(
                ErrorCode.SANDBOX_STATE_MISMATCH,
                f"the stored record of snapshot {snapshot_id} is not usable: {problem}",
            )
        return Snapshot.from_dict(record)

    def all(self) -> list[Snapshot]:
        """Every snapshot, oldest first, each measured (see Snapshot.bytes)."""
        try:
            names = sorted(name for name in os.listdir(self.root) if _is_id(name))
        except FileNotFoundError:
            return []
        snapshots = []
        for name in names:
            try:
                snapshots.append(self.measured(self.read(name)))
            except FileNotFoundError:
                continue  # deleted while it was measured
            except SandboxError as exc:
                if exc.code is not ErrorCode.SANDBOX_NOT_FOUND:  # else deleted meanwhile
                    raise
        return sorted(snapshots, key=lambda snapshot: (snapshot.created, snapshot.id))

    def measured(self, snapshot: Snapshot) -> Snapshot:
        """The snapshot with its size, measured and recorded if it was not."""
        if snapshot.bytes is not None:
            return snapshot
        measured = dataclasses.replace(snapshot, bytes=tree_bytes(self.files_of(snapshot.id)))
        with self.locked():  # one writer at a time (see write_json), and not once deleted
            if self.exists(snapshot.id):
                write_json(self.root / snapshot.id / "snapshot.json", measured.to_dict())
        return measured

    def delete(self, snapshot_id: str, users: Mapping[str, list[str]]) -> None:
        """Delete a snapshot unless one of ``users`` (name -> the snapshot
        ids it stands on) needs it: then SANDBOX_BUSY naming them. The
        caller holds :meth:`locked`."""
        self.read(snapshot_id)
        needing = sorted(user for user, layers in users.items() if snapshot_id in layers)
        if needing:
            shown = ", ".join(needing[:5]) + (f" and {len(needing) - 5} more" if len(needing) > 5 else "")
            raise SandboxError(
                ErrorCode.SANDBOX_BUSY, f"snapshot {snapshot_id} is a layer of {shown}; delete those first"
            )
        trash = self.root / f".deleted-{snapshot_id}-{secrets.token_hex(4)}"
        os.rename(self.root / snapshot_id, trash)
        remove_tree(trash)

    def sweep(self, pending: set[str]) -> None:
        """Remove what a process that died left in the store: a snapshot
        still being made (unless a session's record says it is under way:
        then the session's next attach finishes or undoes it) or being
        deleted. The caller holds :meth:`locked`, which every maker holds
        while it makes one, save the sessions named in ``pending``."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            made = name.startswith(".new-") and name.removeprefix(".new-") not in pending
            if made or name.startswith(".deleted-"):
                remove_tree(self.root / name)

    def on_image(self, image: str) -> list[str]:
        """The snapshots whose sessions run on ``image``. Without the
        store's lock: a snapshot is only ever taken of a session, whose
        own record names the image as long as the snapshot is being
        made."""
        return sorted(name for name in _ids_in(self.root) if _image_of_record(self, name) == image)

    def users(self) -> dict[str, list[str]]:
        """Each snapshot's layers below its own, by "snapshot <id>"; one
        whose record is damaged stands on nothing this can tell."""
        users = {}
        for name in _ids_in(self.root):
            try:
                users[f"snapshot {name}"] = list(self.read(name).layers[1:])
            except SandboxError:
                continue
        return users


def _image_of_record(store: SnapshotStore, snapshot_id: str) -> str | None:
    try:
        return store.read(snapshot_id).image
    except SandboxError:
        return None  # gone meanwhile, or damaged


def _ids_in(root: Path) -> list[str]:
    try:
        return [name for name in os.listdir(root) if _is_id(name)]
    except FileNotFoundError:
        return []


def write_json(path: Path, value: dict) -> None:
    """Replace a record whole: a reader (see read_record) finds the old one
    or the new one. The new one is written to a spare file beside it, which
    is then exchanged with it (the old record is the next spare), so that
    replacing a record creates and deletes no file (see sbx_exchange); a
    new record, or one on a file system that cannot exchange, is renamed
    into place. The spare is written under an exclusive flock, and readers
    read under a shared one: one still reading a record that has become the
    spare holds up the next write to it. One writer at a time (a session's
    owner, or the store's lock). On one line: json's C encoder does no
    indenting, and a snapshot writes records on its critical path. As
    nothing here is fsync'd, a power cut may leave a record unreadable
    (then reported, never used)."""
    data = json.dumps(value).encode()
    spare = path.with_name(f".{path.name}.spare")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Not O_TRUNC: ext4 flushes a file truncated to nothing as it is closed.
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
        try:
            exchange(spare, path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINVAL):  # no record yet; no exchange here
                raise
            os.rename(spare, path)
    finally:
        os.close(fd)


def read_record(path: Path, max_bytes: int) -> bytes | None:
    """A record's bytes (up to ``max_bytes`` + 1, so that a larger one shows),
    read under a shared flock (see write_json); None if it is no regular
    file. Never follows a symlink, nor waits on a FIFO, put in its place.
    FileNotFoundError if there is none."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
