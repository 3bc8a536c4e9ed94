"""A backend's state directory, and the stored record of each session.

Layout of a state directory (all of it belongs to the trusted host; no
credential is ever written here)::

    templates/<key>/files/...       immutable template files (see _templates)
    templates/<key>/template.json
    sessions/<id>/session.json      backend, template, workspace layout,
                                    layers, retention (replaced whole by
                                    exchange with .session.json.spare, see
                                    write_json)
    sessions/<id>/lease             flock'd by the live owner (see _lease)
    sessions/<id>/workspace/        the session's files; with an overlay,
                                    only what differs from its layers
    sessions/<id>/overlay-work/     overlayfs scratch space (and during and
                                    after a snapshot, the *.next and .old
                                    directories beside these two)
    snapshots/<id>/...              frozen workspaces (see _snapshots)

A session with a workspace size cap keeps those two directories on an ext4
image of the cap's size instead (see _image)::

    sessions/<id>/workspace.img     the image
    sessions/<id>/storage/          where it is mounted while the session is
                                    live, holding workspace/ and overlay-work/

Both are on the image, not the workspace alone, because overlayfs wants its
upper and work directories on one mount.

Durability is per process: a crash of the host process loses nothing already
written, but nothing is fsync'd against power loss.

A session created with a retention is deleted once it has been stopped that
long: stopped by its owner, or left when its owner died, so that nobody holds
its lease. The clock is the lease file's modification time (see _lease).
Whoever opens a backend over the state directory deletes the expired ones,
and a running backend looks again every RETENTION_SWEEP_INTERVAL seconds
(see _backend).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from ._confinement import Confinement
from ._driver import Mount
from ._errors import ErrorCode, SandboxError, invalid_argument
from ._image import WorkspaceImage
from ._layers import remove_tree
from ._lease import last_written, session_ids, unowned
from ._rootfs_images import ImageStore
from ._session import check_seconds
from ._snapshots import MAX_STACK_DEPTH, SNAPSHOT_ID_PATTERN, SnapshotStore, read_record, write_json
from ._templates import KEY_PATTERN

logger = logging.getLogger("sandboxns")

STATE_FORMAT = 1
SESSION_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
# A session's record, in its directory.
RECORD = "session.json"
# A session.json is a few hundred bytes; a much larger one is not ours.
MAX_DESCRIPTION_BYTES = 64 * 1024


def new_description(
    backend: str, template: str | None, layout: str, mounts: tuple[Mount, ...], confinement: Confinement
) -> dict:
    """The record of a new session of ``backend`` (a driver's name) with a
    fresh id: its ``layout`` is "overlay" or "copy" (of ``template``'s
    files, or a snapshot's) or "bound" (to a host directory the caller
    adds as "workspace")."""
    return {
        "format": STATE_FORMAT,
        "backend": backend,
        "template": template,
        "session": secrets.token_hex(16),
        "layout": layout,
        "mounts": [{"host": m.host, "guest": m.guest, "writable": m.writable} for m in mounts],
        "confinement": confinement.to_dict(),
    }


def write_description(session_dir: Path, description: dict) -> None:
    """Replace a session's record whole (see write_json); only its lease's
    holder writes it."""
    write_json(session_dir / RECORD, description)


def _description_problem(description: object, session_id: str) -> str | None:
    """What makes ``description`` not a session.json this code wrote for
    session ``session_id``, or None. Every field a resume acts on is
    checked, so a damaged or edited record is refused whole."""
    if not isinstance(description, dict):
        return "it is not a JSON object"
    if description.get("format") != STATE_FORMAT:
        return f"format {description.get('format')!r} is not {STATE_FORMAT}"
    if description.get("session") != session_id:
        return f"it names session {description.get('session')!r}"
    if not isinstance(description.get("backend"), str) or "template" not in description:
        return "it names no backend or template"
    layout, template = description.get("layout"), description.get("template")
    if layout == "bound":
        workspace = description.get("workspace")
        if template is not None or not isinstance(workspace, str) or not os.path.isabs(workspace):
            return "a bound session needs an absolute workspace path and no template"
    elif layout in ("overlay", "copy"):
        # Also keeps a key like "../.." from naming a host directory to use
        # as the workspace's template. A session made from a snapshot of a
        # bound session has none.
        if not (template is None or (isinstance(template, str) and KEY_PATTERN.fullmatch(template))):
            return f"template {template!r} is not a template key"
    else:
        return f"unknown workspace layout {layout!r}"
    problem = _stack_problem(description)
    if problem is not None:
        return problem
    mounts = description.get("mounts", [])
    if not isinstance(mounts, list) or not all(
        isinstance(mount, dict)
        and set(mount) == {"host", "guest", "writable"}
        and isinstance(mount["host"], str)
        and isinstance(mount["guest"], str)
        and isinstance(mount["writable"], bool)
        for mount in mounts
    ):
        return "its mounts are malformed"
    if description.get("retention") is not None:
        try:
            check_seconds(description["retention"], "its retention")
        except SandboxError as exc:
            return exc.message
    return None


def _stack_problem(description: dict) -> str | None:
    """What is wrong with the snapshot layers a record says its workspace
    stands on (see stack_of), or None."""
    layers, on_template = description.get("layers", []), description.get("on_template")
    if not isinstance(layers, list) or not all(isinstance(i, str) and SNAPSHOT_ID_PATTERN.fullmatch(i) for i in layers):
        return "its snapshot layers are malformed"
    for key in ("snapshot", "pending_snapshot"):
        value = description.get(key)
        if value is not None and not (isinstance(value, str) and SNAPSHOT_ID_PATTERN.fullmatch(value)):
            return f"its {key} is not a snapshot id"
    if description["layout"] != "overlay":
        if layers or on_template or "pending_snapshot" in description:
            return "only an overlay workspace stands on snapshot layers"
        return None
    _, on_template = stack_of(description)
    if not isinstance(on_template, bool) or (on_template and description["template"] is None):
        return "on_template must be true or false, and true only with a template"
    if not layers and not on_template:
        return "an overlay workspace needs a layer under it"
    if len(layers) + on_template > MAX_STACK_DEPTH or len(set(layers)) != len(layers):
        return f"its layers repeat, or stack deeper than {MAX_STACK_DEPTH}"
    return None


def stack_of(description: dict) -> tuple[list[str], bool]:
    """The snapshots an overlay workspace stands on (topmost first), and
    whether its template's files lie under them (records from before
    snapshots have neither key: their template alone)."""
    return list(description.get("layers", [])), description.get("on_template", description["layout"] == "overlay")


def read_description(state_directory: Path, session_id: str) -> dict:
    """Session ``session_id``'s stored record (session.json), checked; a
    record that is not one this code wrote is SANDBOX_STATE_MISMATCH and
    nothing in it is used."""
    path = state_directory / "sessions" / session_id / RECORD
    try:
        data = read_record(path, MAX_DESCRIPTION_BYTES)
    except FileNotFoundError:
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no session {session_id} in {state_directory}") from None
    except OSError as exc:
        raise _damaged(session_id, f"cannot open it: {exc.strerror}") from None
    if data is None:
        raise _damaged(session_id, "it is not a regular file")
    if len(data) > MAX_DESCRIPTION_BYTES:
        raise _damaged(session_id, f"it is larger than {MAX_DESCRIPTION_BYTES} bytes")
    try:
        description = json.loads(data)
    except ValueError:
        raise _damaged(session_id, "it is not JSON") from None
    problem = _description_problem(description, session_id)
    if problem is not None:
        raise _damaged(session_id, problem)
    return description


def _damaged(session_id: str, problem: str) -> SandboxError:
    return SandboxError(
        ErrorCode.SANDBOX_STATE_MISMATCH, f"the stored record of session {session_id} is not usable: {problem}"
    )


def discard_session(session_dir: Path) -> None:
    """Remove a session nothing runs in any more. It leaves sessions/ in one
    rename, so nobody ever finds it half removed."""
    trash = session_dir.with_name(f".deleted-{session_dir.name}-{secrets.token_hex(4)}")
    os.rename(session_dir, trash)
    remove_tree(trash)


def delete_expired_sessions(state_directory: Path, *, dry_run: bool = False) -> list[str]:
    """Delete every stopped session of ``state_directory`` whose retention
    has passed (with ``dry_run``, only find them); returns their ids. A
    session someone holds, one still being torn down, and one whose record
    cannot be read are left alone."""
    expired = []
    for session_id in filter(SESSION_ID_PATTERN.fullmatch, session_ids(state_directory)):
        session_dir = state_directory / "sessions" / session_id
        try:
            retention = read_description(state_directory, session_id).get("retention")
            # Judged without the lock first: a sweep must not lock sessions
            # that are not due, as an owner attaching meanwhile would find
            # its lease taken.
            if retention is None or time.time() - last_written(session_dir) < retention:
                continue
            with unowned(session_dir) as stopped:
                if stopped is None or time.time() - stopped < retention:
                    continue
                if not dry_run:
                    _delete_stopped(session_dir)
        except FileNotFoundError:  # no lease: never attached, being created right now
            continue
        except SandboxError as exc:
            if exc.code is not ErrorCode.SANDBOX_NOT_FOUND:  # else it was deleted meanwhile
                logger.warning("not collecting session %s: %s", session_id, exc.message)
            continue
        except OSError as exc:
            logger.warning("not collecting session %s: %s", session_id, exc)
            continue
        expired.append(session_id)
    return expired


def delete_session(state_directory: Path, session_id: str) -> None:
    """Delete a stopped session of ``state_directory``: its record,
    workspace and lease. SANDBOX_BUSY while anyone holds it or any of its
    processes remain; SANDBOX_NOT_FOUND if there is no such session."""
    if not SESSION_ID_PATTERN.fullmatch(session_id) or session_id not in session_ids(state_directory):
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no session {session_id!r} in {state_directory}")
    session_dir = state_directory / "sessions" / session_id
    try:
        with unowned(session_dir) as stopped:
            if stopped is None:
                raise SandboxError(
                    ErrorCode.SANDBOX_BUSY,
                    f"session {session_id} is in use or its processes remain ('sandboxns lease list' says which)",
                )
            _delete_stopped(session_dir)
    except FileNotFoundError:  # no lease yet: being created right now
        raise SandboxError(ErrorCode.SANDBOX_BUSY, f"session {session_id} is being created") from None


def _delete_stopped(session_dir: Path) -> None:
    """Delete a session whose lease the caller holds and whose processes
    are gone."""
    image = WorkspaceImage(session_dir)
    if image.path.exists():
        image.unmount()  # an owner that crashed left it mounted
    discard_session(session_dir)


def storage_root(session_dir: Path, confinement: Confinement) -> Path:
    """Where a session keeps what it writes (its workspace and an overlay's
    work directory): its own directory, or its mounted image when capped."""
    return session_dir if confinement.workspace_size is None else WorkspaceImage(session_dir).mount_point


def _sessions_layers(state_directory: Path) -> dict[str, list[str]]:
    """The snapshots each stored session stands on or is taking, by
    "session <id>"."""
    users = {}
    for session_id in filter(SESSION_ID_PATTERN.fullmatch, session_ids(state_directory)):
        try:
            description = read_description(state_directory, session_id)
        except SandboxError:
            continue  # gone meanwhile, or not usable anyway
        layers, _ = stack_of(description)
        users[f"session {session_id}"] = [*layers, *filter(None, [description.get("pending_snapshot")])]
    return users


def delete_snapshot(state_directory: Path, snapshot_id: str) -> None:
    """See :meth:`Backend.delete_snapshot`; also for operators, without a
    backend (``sandboxns snapshot delete``)."""
    store = SnapshotStore(state_directory / "snapshots")
    with store.locked():
        store.delete(snapshot_id, {**store.users(), **_sessions_layers(state_directory)})


def delete_image(state_directory: Path, digest: str) -> None:
    """See :meth:`Backend.delete_image`; also for operators, without a
    backend (``sandboxns image delete``). An image a session (live or
    stopped) or a snapshot runs on is SANDBOX_BUSY, naming them: its files
    are their root filesystem. A template's image may go: its sessions
    cannot start (SANDBOX_NOT_FOUND) until the same image is imported
    again, which gives the same digest."""
    store = ImageStore(state_directory / "images")
    with store.locked(exclusive=True):
        store.get(digest)
        users = []
        for session_id in filter(SESSION_ID_PATTERN.fullmatch, session_ids(state_directory)):
            with contextlib.suppress(SandboxError):  # gone meanwhile, or not usable anyway
                if read_description(state_directory, session_id).get("image") == digest:
                    users.append(f"session {session_id}")
        users += [
            f"snapshot {snapshot_id}" for snapshot_id in SnapshotStore(state_directory / "snapshots").on_image(digest)
        ]
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            raise SandboxError(ErrorCode.SANDBOX_BUSY, f"image {digest} is the root of {shown}; delete those first")
        store.delete(digest)


def sweep_snapshot_store(state_directory: Path) -> None:
    """What a process that died while it made or deleted a snapshot left
    (see SnapshotStore.sweep)."""
    store = SnapshotStore(state_directory / "snapshots")
    with store.locked():
        store.sweep({layer for layers in _sessions_layers(state_directory).values() for layer in layers})


def stored_session_state(state_directory: str | os.PathLike[str], session_id: str) -> dict:
    """The descriptor (as :meth:`SessionHandle.capture_state` gives it) of
    session ``session_id`` stored in ``state_directory``; names its backend,
    so a caller knows which driver to open the backend with."""
    if not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
        raise invalid_argument(f"{session_id!r} is not a session id (32 hex digits)")
    description = read_description(Path(state_directory), session_id)
    return {
        "format": STATE_FORMAT,
        "backend": description["backend"],
        "template": description["template"],
        "session": session_id,
    }


def default_state_directory() -> Path:
    """Where sandboxns keeps state when nobody says otherwise:
    ``$XDG_STATE_HOME/sandboxns``, or ``~/.local/state/sandboxns``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "sandboxns"
