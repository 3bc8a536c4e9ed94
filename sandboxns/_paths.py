"""Guest paths: where the workspace is, and what a workspace path may be
(a leaf: every layer that names a guest path imports it from here)."""

from __future__ import annotations

import posixpath

from ._errors import ErrorCode, SandboxError, invalid_argument

WORKSPACE = "/workspace"


def normalize_path(path: object) -> str:
    """Return the canonical guest path (``/workspace/...``) for a
    workspace-relative or ``/workspace/...`` path; refuse anything else."""
    if not isinstance(path, str):
        raise invalid_argument(f"a path must be a string, not {type(path).__name__}")
    if not path or "\0" in path:
        raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"invalid path {path!r}")
    joined = path if path.startswith("/") else f"{WORKSPACE}/{path}"
    normal = posixpath.normpath(joined)
    if normal.startswith("//"):  # normpath keeps a leading '//'
        normal = "/" + normal.lstrip("/")
    if normal != WORKSPACE and not normal.startswith(WORKSPACE + "/"):
        raise SandboxError(ErrorCode.SANDBOX_PATH_REFUSED, f"path {path!r} is outside the workspace {WORKSPACE}")
    return normal
