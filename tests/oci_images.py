"""OCI image layouts and root filesystems for the tests, built here from
nothing the network serves: tar layers of given entries, and a busybox
image from Debian's busybox-static (installed by .ci/run)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

BUSYBOX = Path("/bin/busybox")


def entry(name: str, data: bytes = b"", *, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = ""):
    """A tar entry: (header, content)."""
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    if kind == tarfile.REGTYPE:
        info.size = len(data)
    if kind == tarfile.DIRTYPE:
        info.mode = mode if mode != 0o644 else 0o755
    return info, data


def layer_tar(entries) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for info, data in entries:
            layer.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return buffer.getvalue()


def write_blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs/sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(layout: Path, layers, env=("FOO=bar",), gzipped: bool = False) -> str:
    """An OCI image layout of these layers; its manifest's digest."""
    layout.mkdir()
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    descriptors = []
    for entries in layers:
        data = layer_tar(entries)
        media_type = "application/vnd.oci.image.layer.v1.tar"
        if gzipped:
            data, media_type = gzip.compress(data), media_type + "+gzip"
        descriptors.append({"mediaType": media_type, **write_blob(layout, data)})
    config = {"config": {"Env": list(env), "WorkingDir": "/srv"}, "rootfs": {"type": "layers"}}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **write_blob(layout, json.dumps(config).encode()),
        },
        "layers": descriptors,
    }
    described = write_blob(layout, json.dumps(manifest).encode())
    index = {"schemaVersion": 2, "manifests": [{"mediaType": manifest["mediaType"], **described}]}
    (layout / "index.json").write_text(json.dumps(index))
    return described["digest"]


def archive(directory: Path, target: Path) -> Path:
    with tarfile.open(target, "w") as packed:
        for path in sorted(directory.rglob("*")):
            packed.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return target


def busybox_entries() -> list:
    """A root filesystem of one static busybox and a link for each applet."""
    if not BUSYBOX.is_file():
        if os.environ.get("SANDBOXNS_REQUIRE_BUSYBOX") == "1":
            pytest.fail(f"SANDBOXNS_REQUIRE_BUSYBOX=1 but {BUSYBOX} is missing")
        pytest.skip(f"{BUSYBOX} is missing: apt-get install busybox-static (.ci/run does)")
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True, text=True).stdout.split()
    return [
        entry("bin", kind=tarfile.DIRTYPE),
        entry("bin/busybox", BUSYBOX.read_bytes(), mode=0o755),
        *(entry(f"bin/{name}", kind=tarfile.SYMTYPE, link="busybox") for name in applets if name != "busybox"),
    ]


def busybox_layout(layout: Path, env=("PATH=/bin", "GREETING=from the image"), more=()) -> str:
    """A busybox OCI image of two layers: the second removes a file of the
    first (a whiteout) and adds one; and ``more`` entries in a third layer,
    if given. Its manifest's digest."""
    lower = [
        *busybox_entries(),
        entry("etc", kind=tarfile.DIRTYPE),
        entry("etc/os-release", b"ID=sandboxns-busybox\n"),
        entry("etc/removed-above", b"only in the lower layer\n"),
        entry("usr/share/lower", b"lower\n"),
    ]
    upper = [entry("etc/.wh.removed-above"), entry("usr/share/upper", b"upper\n")]
    return oci_layout(layout, [lower, upper, *([list(more)] if more else [])], env=env)
