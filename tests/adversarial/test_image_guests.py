"""A hostile guest on an imported image: the probes of the other escape
tests, in a root filesystem that is not the host's, and what an image's own
links (absolute, climbing) lead to: the guest's root, never the host's."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest
from oci_images import busybox_layout, entry

import sandboxns

pytestmark = pytest.mark.smoke

# Links an image may carry, which a guest follows inside its own root.
LINKS = [
    entry("host-etc", kind=tarfile.SYMTYPE, link="/etc"),
    entry("climb", kind=tarfile.SYMTYPE, link="../../../../../.."),
    entry("etc/shadow-link", kind=tarfile.SYMTYPE, link="/etc/shadow"),
    entry("proc-root", kind=tarfile.SYMTYPE, link="/proc/1/root"),
]


@pytest.fixture
async def guest(backend, tmp_path):
    busybox_layout(tmp_path / "image", more=LINKS)
    image = await backend.import_image(tmp_path / "image")
    template = await backend.prewarm(template="hostile", files={}, image=image.digest)
    return await backend.create(template=template.template_key)


@pytest.fixture
def image_root(guest, backend) -> Path:
    """The guest's image's tree on the host."""
    return backend.state_directory / "images" / guest.image.removeprefix("sha256:") / "root"


async def sh(handle, script: str) -> sandboxns.RunResult:
    return await handle.session.run("sh", ["-c", script])


def fingerprint(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry of an image's tree: its mode and content (or link)."""
    seen = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory, name)
            status = path.lstat()
            if path.is_symlink():
                content = os.readlink(path)
            elif path.is_file():
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                content = ""
            seen[str(path.relative_to(root))] = (status.st_mode, content)
    return seen


@pytest.mark.parametrize("path", ["/", "/bin", "/etc", "/usr/share", "/dev", "/run", "/proc", "/host-etc", "/climb"])
async def test_nothing_of_the_image_is_writable(guest, path):
    result = await sh(guest, f"touch {path}/planted")
    assert result.exit_code != 0, result


async def test_the_image_on_the_host_is_unchanged_by_what_a_guest_tries(guest, image_root):
    before = fingerprint(image_root)
    result = await sh(
        guest,
        "chmod 4777 /bin/busybox; rm -f /etc/os-release; ln -sf / /bin/sh; mv /usr/share/lower /workspace/;"
        "echo x > /climb/etc/os-release; echo x > /etc/shadow-link; touch /host-etc/new",
    )
    assert "Read-only file system" in result.stderr, result
    assert fingerprint(image_root) == before


async def test_an_images_links_lead_into_the_guests_root(guest):
    result = await sh(
        guest, "cat /host-etc/os-release /climb/etc/os-release; ls /climb; cat /etc/shadow-link; ls /proc-root"
    )
    lines = result.stdout.splitlines()
    assert lines[:2] == ["ID=sandboxns-busybox"] * 2, result
    assert "workspace" in lines and "home" not in lines and "root" not in lines, result
    # The host's /etc/shadow is not there, and pid 1's root is out of reach.
    assert "can't open '/etc/shadow-link': No such file or directory" in result.stderr, result
    assert "ls: /proc-root: Permission denied" in result.stderr, result


async def test_no_privilege_mount_or_namespace_on_an_image(guest):
    status = await sh(guest, "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    fields = dict(line.split(":\t") for line in status.stdout.splitlines())
    assert fields == {"NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0" * 16, "CapBnd": "0" * 16}, status
    assert (await sh(guest, "mount -t tmpfs none /tmp")).exit_code != 0
    assert (await sh(guest, "unshare -U -r true")).exit_code != 0
    assert (await sh(guest, "mknod /tmp/sda b 8 0")).exit_code != 0


async def test_an_image_guest_sees_only_its_processes_devices_and_loopback(guest):
    processes = await sh(guest, "ls /proc | grep -c '^[0-9]'")
    assert int(processes.stdout) <= 4, processes  # its init, sh, ls, grep
    devices = set((await sh(guest, "ls /dev")).stdout.split())
    assert devices <= {"null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm", "fd"} | {
        "stdin", "stdout", "stderr", "core",
    }  # fmt: skip
    interfaces = await sh(guest, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert interfaces.stdout.split() == ["lo"], interfaces
