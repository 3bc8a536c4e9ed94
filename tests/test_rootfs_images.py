"""Importing root filesystem images into the state directory: OCI layouts
(directory and archive, plain and gzip layers) and plain root filesystems
(directory and tar), built here from nothing the network serves; what the
unpacked tree holds, and what an import refuses, leaving nothing behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import refused
from oci_images import archive, entry, layer_tar, oci_layout

import sandboxns
from sandboxns import ErrorCode

pytestmark = pytest.mark.smoke


LOWER = [
    entry("etc", kind=tarfile.DIRTYPE),
    entry("etc/os-release", b"ID=sandboxns-test\n"),
    entry("etc/removed", b"gone in the upper layer\n"),
    entry("opt/a/x", b"x\n"),
    entry("opt/a/y", b"y\n"),
    entry("usr/bin/tool", b"#!/bin/sh\n", mode=0o4755),
]
UPPER = [
    entry("etc/.wh.removed"),
    entry("opt/a/.wh..wh..opq"),
    entry("opt/a/z", b"z\n"),
    entry("bin/sh", kind=tarfile.SYMTYPE, link="/usr/bin/tool"),
    entry("usr/bin/alias", kind=tarfile.LNKTYPE, link="usr/bin/tool"),
    entry("dev/null", kind=tarfile.CHRTYPE),
]


@pytest.fixture
async def backend(tmp_path):
    async with sandboxns.open_backend(state_directory=tmp_path / "state") as opened:
        yield opened


@pytest.mark.parametrize("form", ["layout", "archive", "gzip"])
async def test_an_oci_image_is_its_layers_applied_in_order(backend, tmp_path, form):
    manifest = oci_layout(tmp_path / "image", [LOWER, UPPER], gzipped=form == "gzip")
    source = archive(tmp_path / "image", tmp_path / "image.tar") if form == "archive" else tmp_path / "image"
    image = await backend.import_image(source)
    assert image.digest == manifest and image.layers == 2
    assert image.env == {"PATH": image.env["PATH"], "FOO": "bar"} and image.working_dir == "/srv"
    root = tmp_path / "state/images" / manifest.removeprefix("sha256:") / "root"
    assert (root / "etc/os-release").read_text() == "ID=sandboxns-test\n"
    assert not (root / "etc/removed").exists()  # whited out
    assert sorted(path.name for path in (root / "opt/a").iterdir()) == ["z"]  # opaque: the lower x, y hidden
    assert os.readlink(root / "bin/sh") == "/usr/bin/tool"
    assert (root / "usr/bin/alias").stat().st_ino == (root / "usr/bin/tool").stat().st_ino
    assert stat.S_IMODE((root / "usr/bin/tool").stat().st_mode) == 0o755  # no set-uid
    assert not (root / "dev/null").exists() and image.skipped == ("layer 2: dev/null (a device node or FIFO)",)
    assert [listed.digest for listed in await backend.images()] == [manifest]


async def test_a_plain_root_filesystem_as_a_directory_or_a_tar(backend, tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/os-release").write_text("ID=plain\n")
    (rootfs / "bin").mkdir()
    (rootfs / "bin/sh").symlink_to("busybox")
    (rootfs / "bin/busybox").write_bytes(b"\x7fELF")
    from_directory = await backend.import_image(rootfs)
    again = await backend.import_image(rootfs)
    assert again == from_directory and from_directory.env["PATH"].startswith("/usr/local/sbin")
    from_tar = await backend.import_image(archive(rootfs, tmp_path / "rootfs.tar"))
    assert from_tar.digest != from_directory.digest  # a tar's digest is its bytes'
    for image in (from_directory, from_tar):
        root = tmp_path / "state/images" / image.digest.removeprefix("sha256:") / "root"
        assert (root / "etc/os-release").read_text() == "ID=plain\n"
        assert os.readlink(root / "bin/sh") == "busybox"
    assert sorted(image.digest for image in await backend.images()) == sorted([from_directory.digest, from_tar.digest])
    await backend.delete_image(from_tar.digest)
    assert [image.digest for image in await backend.images()] == [from_directory.digest]
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.delete_image(from_tar.digest))


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ([entry("../escape", b"out")], "../escape"),
        ([entry("lib", kind=tarfile.SYMTYPE, link="/tmp"), entry("lib/planted", b"x")], "lib/planted"),
        ([entry("alias", kind=tarfile.LNKTYPE, link="nothing/here")], "alias"),
    ],
    ids=["dot-dot", "through-a-symlink", "dangling-hard-link"],
)
async def test_a_hostile_layer_is_refused_naming_its_entry_and_leaves_nothing(backend, tmp_path, bad, named):
    oci_layout(tmp_path / "image", [LOWER, bad])
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "image"))
    assert named in error.message and "layer 2" in error.message
    assert not (Path("/tmp") / "planted").exists()
    assert list((tmp_path / "state/images").iterdir()) == []
    assert await backend.images() == []


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ([entry(".wh..")], ".wh.."),
        ([entry("etc/.wh...")], "etc/.wh..."),
        ([entry("/".join(["d"] * 200) + "/f", b"deep")], "deeper than 128"),
        ([entry("alias", kind=tarfile.LNKTYPE, link="etc")], "alias"),
        ([entry("empty", kind=tarfile.SYMTYPE, link="")], "empty"),
    ],
    ids=["whiteout-of-parent", "whiteout-of-grandparent", "too-deep", "hard-link-to-a-directory", "empty-link"],
)
async def test_malformed_entries_are_refused(backend, tmp_path, bad, named):
    oci_layout(tmp_path / "image", [LOWER, bad])
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "image"))
    assert named in error.message
    assert list((tmp_path / "state/images").iterdir()) == []


async def test_a_directory_made_over_a_link_hides_nothing_below_it(backend, tmp_path):
    # /var/run a symbolic link below, a directory above (opaque, with a
    # whiteout in it): overlayfs writes layers like this.
    lower = [entry("var", kind=tarfile.DIRTYPE), entry("var/run", kind=tarfile.SYMTYPE, link="/run")]
    upper = [entry("var/run", kind=tarfile.DIRTYPE), entry("var/run/.wh..wh..opq"), entry("var/run/.wh.old"),
             entry("var/run/pid", b"1\n")]  # fmt: skip
    oci_layout(tmp_path / "image", [lower, upper])
    image = await backend.import_image(tmp_path / "image")
    root = tmp_path / "state/images" / image.digest.removeprefix("sha256:") / "root"
    assert (root / "var/run").is_dir() and not (root / "var/run").is_symlink()
    assert (root / "var/run/pid").read_text() == "1\n"


async def test_what_cannot_be_read_as_an_image_is_refused_without_waiting(backend, tmp_path):
    oci_layout(tmp_path / "image", [LOWER])
    index = json.loads((tmp_path / "image/index.json").read_text())
    manifest = json.loads((tmp_path / "image/blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    layer = tmp_path / "image/blobs/sha256" / manifest["layers"][0]["digest"][7:]
    layer.unlink()
    layer.symlink_to("/dev/zero")  # endless, were it followed
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "image"))
    assert "symbolic link" in error.message
    layer.unlink()
    os.mkfifo(layer)  # would block, were it opened waiting
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "image"))
    fifo = tmp_path / "source.fifo"
    os.mkfifo(fifo)
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(fifo))
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(layer_tar(LOWER)[:1030])  # within a file's data
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(truncated))
    assert list((tmp_path / "state/images").iterdir()) == []


async def test_directories_of_different_content_have_different_digests(backend, tmp_path):
    # One tree's file could spell another tree's two entries, were the
    # fields not kept apart.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    (first / "a").write_text("hello")
    (first / "b").write_text("script")
    second.mkdir()
    (second / "a").write_text('hello", 32768, 420, "b"]\n["b", 32768, 420, "script')
    assert (await backend.import_image(first)).digest != (await backend.import_image(second)).digest


async def test_an_image_half_deleted_is_imported_again(backend, tmp_path):
    oci_layout(tmp_path / "image", [LOWER])
    image = await backend.import_image(tmp_path / "image")
    directory = tmp_path / "state/images" / image.digest.removeprefix("sha256:")
    (directory / "image.json").unlink()  # a delete that stopped half way
    assert await backend.images() == []
    assert await backend.import_image(tmp_path / "image") == image
    assert [listed.digest for listed in await backend.images()] == [image.digest]


async def test_a_blob_that_does_not_match_its_digest_is_refused(backend, tmp_path):
    oci_layout(tmp_path / "image", [LOWER])
    index = json.loads((tmp_path / "image/index.json").read_text())
    manifest = json.loads((tmp_path / "image/blobs/sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    layer = tmp_path / "image/blobs/sha256" / manifest["layers"][0]["digest"][7:]
    layer.write_bytes(layer.read_bytes()[:-1] + b"!")
    error = await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "image"))
    assert manifest["layers"][0]["digest"] in error.message
    assert list((tmp_path / "state/images").iterdir()) == []


async def test_what_is_no_image_is_refused(backend, tmp_path):
    (tmp_path / "notes.txt").write_text("not a tar")
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(tmp_path / "notes.txt"))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.import_image(tmp_path / "missing"))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.import_image(42))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.delete_image("latest"))


def test_the_cli_imports_lists_and_deletes_images(tmp_path):
    manifest = oci_layout(tmp_path / "image", [LOWER, UPPER])
    state = tmp_path / "state"

    def cli(*arguments: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-P", "-m", "sandboxns", "image", *arguments, "--state-dir", str(state)]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    imported = cli("import", str(tmp_path / "image"))
    assert imported.returncode == 0 and imported.stdout.strip() == manifest, imported
    assert "skipped layer 2: dev/null" in imported.stderr
    assert cli("list").stdout.split()[0] == manifest
    assert [image["digest"] for image in json.loads(cli("list", "--json").stdout)] == [manifest]
    assert cli("delete", manifest).returncode == 0
    assert cli("list").stdout == ""
    missing = cli("delete", manifest)
    assert missing.returncode != 0 and f"no image {manifest}" in missing.stderr
    hostile = tmp_path / "hostile"
    oci_layout(hostile, [[entry("../escape", b"out")]])
    refusal = cli("import", str(hostile))
    assert refusal.returncode != 0 and "'../escape' leaves the image root" in refusal.stderr, refusal
