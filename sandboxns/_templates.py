"""Templates: immutable, content-addressed snapshots of workspace files.

``state_dir/templates/<key>/files/`` holds the files and ``template.json``
describes them. The key is a SHA-256 over the backend name, the template name
and every file's path and content, so the same inputs always give the same key
and any change gives a new one. A template is written under a temporary name
and renamed into place, so a reader never sees half of one.

A session made from a template normally sees it as the read-only lower layer
of an overlay (nothing is copied); where overlayfs is unavailable, the
template is copied into the session's workspace, by reflink where the
filesystem can share blocks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ._errors import ErrorCode, SandboxError, invalid_argument
from ._paths import WORKSPACE, normalize_path

TEMPLATE_FORMAT = 1
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
MAX_TEMPLATE_NAME = 256


@dataclass(frozen=True)
class Template:
    """A prewarmed template. Pass ``template_key`` to ``Backend.create``."""

    template_key: str
    name: str
    file_count: int
    # The digest of the image whose root filesystem its sessions run on
    # (see Backend.import_image), or None for the host's runtime trees.
    image: str | None = None


def check_template_files(name: object, files: object) -> tuple[str, dict[str, bytes]]:
    """Validate prewarm's arguments; returns the name and the files keyed by
    workspace-relative path."""
    if not isinstance(name, str) or not name or len(name) > MAX_TEMPLATE_NAME or "\0" in name:
        raise invalid_argument(
            f"template must be a non-empty name of at most {MAX_TEMPLATE_NAME} characters, not {name!r}"
        )
    if not isinstance(files, Mapping):
        raise invalid_argument(f"files must map workspace paths to bytes, not {type(files).__name__}")
    checked: dict[str, bytes] = {}
    for path, content in files.items():
        relative = os.path.relpath(normalize_path(path), WORKSPACE)
        if relative == ".":
            raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, "a template file cannot be the workspace itself")
        if isinstance(content, (bytearray, memoryview)):
            content = bytes(content)
        if not isinstance(content, bytes):
            raise invalid_argument(f"the content of template file {path!r} must be bytes, not {type(content).__name__}")
        if relative in checked:
            raise invalid_argument(f"template file {path!r} is given twice")
        checked[relative] = content
    for relative in checked:
        parent = os.path.dirname(relative)
        while parent:
            if parent in checked:
                raise invalid_argument(f"template file {parent!r} is also the directory of {relative!r}")
            parent = os.path.dirname(parent)
    return name, checked


def template_key(backend: str, name: str, files: Mapping[str, bytes], image: str | None = None) -> str:
    digest = hashlib.sha256()
    for part in (b"sandboxns-template", str(TEMPLATE_FORMAT).encode(), backend.encode(), name.encode()):
        digest.update(part + b"\0")
    if image is not None:  # keys of templates without one stay what they were
        digest.update(b"image\0" + image.encode() + b"\0")
    for path in sorted(files):
        content = files[path]
        digest.update(path.encode() + b"\0" + str(len(content)).encode() + b"\0")
        digest.update(content)
    return digest.hexdigest()


def check_key(key: object) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        raise invalid_argument(f"template must be a template key from prewarm() (64 hex digits), not {key!r}")
    return key


class TemplateStore:
    """``state_dir/templates``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def files_of(self, key: str) -> Path:
        return self.root / key / "files"

    def exists(self, key: str) -> bool:
        return (self.root / key / "template.json").is_file()

    def image_of(self, key: str) -> str | None:
        """The image a stored template's sessions run on, if any."""
        try:
            image = json.loads((self.root / key / "template.json").read_text()).get("image")
        except FileNotFoundError:
            raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no template {key} in {self.root.parent}") from None
        except (ValueError, AttributeError):
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"template {key}'s record is unreadable") from None
        if image is not None and not isinstance(image, str):
            raise SandboxError(ErrorCode.SANDBOX_STATE_MISMATCH, f"template {key}'s record names no image digest")
        return image

    def store(self, backend: str, name: str, files: Mapping[str, bytes], image: str | None = None) -> Template:
        """Write a template unless it is already there (then this is one
        stat). Runs in a worker thread."""
        key = template_key(backend, name, files, image)
        template = Template(key, name, len(files), image)
        if self.exists(key):
            return template
        staging = self.root / f".new-{key[:16]}-{secrets.token_hex(6)}"
        try:
            (staging / "files").mkdir(parents=True)
            for relative, content in files.items():
                target = staging / "files" / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            description = {"format": TEMPLATE_FORMAT, "backend": backend, "name": name, "files": len(files)}
            if image is not None:
                description["image"] = image
            (staging / "template.json").write_text(json.dumps(description))
            try:
                os.rename(staging, self.root / key)
            except OSError as exc:
                # Someone stored the same template at the same time: theirs
                # has the same content.
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return template
