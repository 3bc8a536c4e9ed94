"""Sessions on an imported root filesystem image, on both drivers: the
guest's / is the image (its files, its whiteouts applied, its Env), never
the host's runtime trees; templates, resumed sessions and snapshots keep
their image; an image in use is not deleted; bad digests are refused and
leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from conftest import refused
from oci_images import busybox_entries, busybox_layout, entry, layer_tar

import sandboxns
from sandboxns import ErrorCode

pytestmark = pytest.mark.smoke

OTHER_IMAGE = "sha256:" + "0" * 64


@pytest.fixture
async def image(backend, tmp_path) -> sandboxns.Image:
    return await backend.import_image(tmp_path / "busybox")


@pytest.fixture(autouse=True)
def busybox(tmp_path):
    busybox_layout(tmp_path / "busybox")


async def sh(session, script: str, **options) -> sandboxns.RunResult:
    return await session.run("sh", ["-c", script], **options)


async def test_the_guest_sees_the_image_and_not_the_host(backend, image):
    template = await backend.prewarm(template="t", files={"notes.txt": b"from the template\n"}, image=image.digest)
    assert template.image == image.digest
    handle = await backend.create(template=template.template_key)
    assert handle.image == image.digest
    seen = await sh(handle.session, "cat /etc/os-release notes.txt; ls /; ls /usr/share")
    assert seen.exit_code == 0, seen
    assert seen.stdout.splitlines()[:2] == ["ID=sandboxns-busybox", "from the template"]
    assert set(seen.stdout.splitlines()[2:]) == {
        "bin",
        "dev",
        "etc",
        "proc",
        "run",
        "tmp",
        "usr",
        "workspace",
        "lower",
        "upper",
    }
    # The host's runtime trees are not there, nor is what the whiteout removed.
    for path in ("/usr/bin", "/lib", "/etc/removed-above", "/usr/bin/python3", "/etc/ld.so.cache"):
        assert (await sh(handle.session, f"test -e {path}")).exit_code == 1, path
    # The image's Env is the default environment, over sandboxns's own.
    env = await handle.session.run("env")
    assert {"PATH=/bin", "GREETING=from the image", "HOME=/workspace"} <= set(env.stdout.splitlines()), env
    # Only the workspace (and a command's /tmp) is writable; the image is not.
    wrote = await sh(handle.session, "echo x > /workspace/w && cat w; touch /bin/planted /etc/planted; echo $?")
    assert wrote.stdout.split() == ["x", "1"], wrote
    assert "Read-only file system" in wrote.stderr
    identity = await sh(handle.session, "id -u; grep -c . /etc/passwd")
    assert identity.stdout.split() == ["1000", "2"], identity  # sandboxns's /etc/passwd over the image's


async def test_a_session_over_a_host_directory_runs_on_an_image(backend, image, workspace):
    (workspace / "mine").write_text("host file\n")
    handle = await backend.create(workspace=workspace, image=image.digest)
    result = await sh(handle.session, "cat /etc/os-release mine; echo $GREETING")
    assert result.stdout.splitlines() == ["ID=sandboxns-busybox", "host file", "from the image"], result


async def test_a_template_key_depends_on_its_image(backend, image):
    files = {"a": b"1"}
    plain = await backend.prewarm(template="t", files=files)
    on_image = await backend.prewarm(template="t", files=files, image=image.digest)
    assert plain.template_key != on_image.template_key and plain.image is None
    host_rooted = await backend.create(template=plain.template_key)
    assert host_rooted.image is None
    assert (await sh(host_rooted.session, "test -e /usr/bin/env")).exit_code == 0


async def test_resumed_sessions_and_snapshots_keep_their_image(backend, image):
    template = await backend.prewarm(template="t", files={}, image=image.digest)
    handle = await backend.create(template=template.template_key)
    await sh(handle.session, "echo kept > state")
    snapshot = await handle.snapshot()
    assert snapshot.image == image.digest
    state = handle.capture_state()
    await handle.aclose()
    resumed = await backend.create(state=state, template=template.template_key)
    assert (await sh(resumed.session, "cat /etc/os-release state")).stdout.split() == ["ID=sandboxns-busybox", "kept"]
    await resumed.aclose()
    await refused(
        ErrorCode.SANDBOX_STATE_MISMATCH, backend.create(state=state, template=template.template_key, image=OTHER_IMAGE)
    )
    fork = await backend.create(snapshot=snapshot)
    assert fork.image == image.digest
    assert (await sh(fork.session, "echo $GREETING; cat state")).stdout.splitlines() == ["from the image", "kept"]
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(snapshot=snapshot, image=OTHER_IMAGE))
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(template=template.template_key, image=OTHER_IMAGE))


async def test_an_image_in_use_is_not_deleted(backend, image, state_dir, tmp_path):
    template = await backend.prewarm(template="t", files={}, image=image.digest)
    handle = await backend.create(template=template.template_key)
    error = await refused(ErrorCode.SANDBOX_BUSY, backend.delete_image(image.digest))
    assert handle.session_id in error.message
    assert (await sh(handle.session, "cat /etc/os-release")).stdout == "ID=sandboxns-busybox\n"
    snapshot = await handle.snapshot()
    await handle.delete()
    error = await refused(ErrorCode.SANDBOX_BUSY, backend.delete_image(image.digest))
    assert snapshot.id in error.message
    await backend.delete_snapshot(snapshot.id)
    # A template's image may go: its sessions wait for the same image again.
    await backend.delete_image(image.digest)
    assert await backend.images() == []
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(template=template.template_key))
    assert os.listdir(state_dir / "sessions") == []
    assert (await backend.import_image(tmp_path / "busybox")).digest == image.digest
    handle = await backend.create(template=template.template_key)
    assert (await sh(handle.session, "cat /etc/os-release")).stdout == "ID=sandboxns-busybox\n"


async def test_bad_or_unknown_images_are_refused_leaving_nothing(backend, state_dir, workspace):
    for bad in ("busybox", "sha256:abc", 7, "sha256:" + "A" * 64):
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(workspace=workspace, image=bad))
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.prewarm(template="t", files={}, image=bad))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.create(workspace=workspace, image=OTHER_IMAGE))
    await refused(ErrorCode.SANDBOX_NOT_FOUND, backend.prewarm(template="t", files={}, image=OTHER_IMAGE))
    assert os.listdir(state_dir / "sessions") == []
    assert not (state_dir / "templates").exists() or os.listdir(state_dir / "templates") == []


async def test_a_spec_names_an_image_to_import(driver_name, tmp_path):
    spec_file = tmp_path / "sandbox.toml"
    spec_file.write_text(
        textwrap.dedent(
            f"""\
            id = "on-busybox"
            driver = "{driver_name}"
            image = "busybox"
            [template]
            files = {{ "hello.txt" = "hi" }}
            [env]
            vars = {{ EXTRA = "from the spec" }}
            """
        )
    )
    spec = sandboxns.SandboxSpec.load(spec_file)
    async with spec.build(state_directory=tmp_path / "state") as sandbox:
        result = await sh(
            sandbox.session, "cat /etc/os-release hello.txt; echo; echo $GREETING; echo $EXTRA; echo $PATH"
        )
    assert result.stdout.splitlines() == ["ID=sandboxns-busybox", "hi", "from the image", "from the spec", "/bin"]
    bad = spec_file.with_name("bad.toml")
    bad.write_text('id = "bad"\nimage = "sha256:nope"\n')
    problems = sandboxns.SandboxSpec.load(bad).validate()
    assert [problem.field for problem in problems] == ["image"], problems


def test_the_cli_runs_a_command_on_an_imported_image(tmp_path):
    state = tmp_path / "state"
    cli = [sys.executable, "-P", "-m", "sandboxns"]
    imported = subprocess.run(
        [*cli, "image", "import", "--state-dir", str(state), str(tmp_path / "busybox")],
        check=False,
        capture_output=True,
        text=True,
    )
    digest = imported.stdout.split()[0]
    ran = subprocess.run(
        [*cli, "run", "--state-dir", str(state), "--image", digest, "--", "sh", "-c", "cat /etc/os-release; exit 3"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert (ran.returncode, ran.stdout) == (3, "ID=sandboxns-busybox\n"), ran
    # Its throwaway session is gone, so the image may go too.
    deleted = subprocess.run(
        [*cli, "image", "delete", "--state-dir", str(state), digest], check=False, capture_output=True, text=True
    )
    assert deleted.returncode == 0, deleted
    assert os.listdir(state / "sessions") == []


async def test_an_image_sandbox_runs_wrapped_commands_on_its_image(driver_name, tmp_path):
    from sandboxns import adapters

    sandbox = adapters.image_sandbox(tmp_path / "tasks", image=tmp_path / "busybox", driver=driver_name)
    workspace = await sandbox.workspace("task 1")
    assert workspace["cwd"] == "/workspace" and sandbox.image is not None
    argv = sandbox.wrap(
        ["sh", "-c", "cat /etc/os-release; echo $GREETING $TOKEN > out"], env={"TOKEN": "t"}, id="task 1"
    )
    ran = await trio.run_process(argv, env={**os.environ, "TOKEN": "t"}, capture_stdout=True, capture_stderr=True)
    assert ran.stdout == b"ID=sandboxns-busybox\n", ran
    assert (Path(workspace["host_path"]) / "out").read_text() == "from the image t\n"
    # Another task on the same image imports nothing again.
    await sandbox.workspace("task 2")
    assert [image.digest for image in await _images(sandbox.state_directory)] == [sandbox.image]
    assert (await sandbox.cleanup("task 1"))["removed"]
    assert (await sandbox.cleanup("task 2"))["removed"]
    await refused(
        ErrorCode.SANDBOX_NOT_FOUND, _raising(adapters.image_sandbox, tmp_path / "t", image=tmp_path / "none")
    )


async def _images(state_directory):
    async with sandboxns.open_backend(state_directory=state_directory) as backend:
        return await backend.images()


async def _raising(function, *args, **kwargs):
    return function(*args, **kwargs)


@pytest.mark.parametrize("form", ["directory", "tar"])
async def test_a_plain_root_filesystem_is_a_sessions_root(backend, tmp_path, workspace, form):
    # What debootstrap or docker export make: one tree, no layers.
    packed = tmp_path / "rootfs.tar"
    packed.write_bytes(layer_tar([*busybox_entries(), entry("etc/os-release", b"ID=plain-rootfs\n")]))
    source = packed
    if form == "directory":
        source = tmp_path / "rootfs"
        source.mkdir()
        await trio.run_process(["tar", "-xf", packed, "-C", source])
    image = await backend.import_image(source)
    handle = await backend.create(workspace=workspace, image=image.digest)
    result = await sh(handle.session, "cat /etc/os-release; echo $PATH")
    assert result.stdout.splitlines() == [
        "ID=plain-rootfs",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ]


async def test_a_fork_pool_never_hands_out_a_fork_on_another_root(driver_name, state_dir, tmp_path):
    if driver_name != "native":
        pytest.skip("only the native driver pools forks")
    async with sandboxns.open_backend(state_directory=state_dir) as backend:
        image = await backend.import_image(tmp_path / "busybox")
        template = await backend.prewarm(template="host", files={})
        async with await backend.create(template=template.template_key, destroy_on_close=True) as origin:
            snapshot = await origin.snapshot()
        await backend.pool_forks(size=1)
        await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, backend.create(snapshot=snapshot, image=image.digest))


async def test_an_images_proxy_and_ca_settings_never_replace_the_gateways(backend, tmp_path, workspace):
    busybox_layout(
        tmp_path / "proxied",
        env=("PATH=/bin", "HTTPS_PROXY=http://elsewhere:1", "SSL_CERT_FILE=/etc/mine.pem", "KEPT=1"),
    )
    image = await backend.import_image(tmp_path / "proxied")
    assert image.env["HTTPS_PROXY"] == "http://elsewhere:1"  # recorded as the image says
    policy = {"allow": [{"origin": "https://example.test", "headers": {"authorization": "Bearer x"}}]}
    handle = await backend.create(workspace=workspace, image=image.digest, network=policy)
    assert "HTTPS_PROXY" not in handle.session.environment and handle.session.environment["KEPT"] == "1"
    seen = dict(line.split("=", 1) for line in (await handle.session.run("env")).stdout.splitlines())
    assert seen["HTTPS_PROXY"].startswith("http://127.0.0.1:") and seen.get("SSL_CERT_FILE") != "/etc/mine.pem", seen


async def test_an_env_entry_that_is_no_variable_is_skipped_and_reported(backend, tmp_path, workspace):
    busybox_layout(tmp_path / "odd", env=("PATH=/bin", "=x", "NOEQUALS", "A\0B=c", "OK=1"))
    image = await backend.import_image(tmp_path / "odd")
    assert image.env == {"PATH": "/bin", "OK": "1"}
    assert [line for line in image.skipped if "config Env" in line] == [
        "config Env entry '=x': not NAME=VALUE",
        "config Env entry 'NOEQUALS': not NAME=VALUE",
        "config Env entry 'A\\x00B=c': not NAME=VALUE",
    ]
    handle = await backend.create(workspace=workspace, image=image.digest)
    assert (await handle.session.run("env")).exit_code == 0


async def test_an_images_files_are_the_guests_whoever_owns_the_workspace(backend, image, workspace):
    template = await backend.prewarm(template="t", files={}, image=image.digest)
    if os.geteuid() == 0:
        os.chown(workspace, 12345, 12345)  # a root host's guest then writes it as that user's
    for handle in (
        await backend.create(template=template.template_key),
        await backend.create(workspace=workspace, image=image.digest),
    ):
        owners = await sh(handle.session, "id -u; stat -c %u /etc/os-release /bin/busybox")
        uid, *owned = owners.stdout.split()
        assert owned == [uid, uid], owners


async def test_an_image_the_bwrap_driver_cannot_mount_is_refused_leaving_nothing(
    backend, driver_name, tmp_path, workspace, state_dir
):
    crowded = [entry(f"etc/conf-{index}", b"x") for index in range(450)]
    busybox_layout(tmp_path / "crowded", more=crowded)
    image = await backend.import_image(tmp_path / "crowded")
    if driver_name == "native":
        handle = await backend.create(workspace=workspace, image=image.digest)
        assert (await sh(handle.session, "ls /etc | wc -l")).stdout.split() == ["456"]  # its 451 and the session's 5
        return
    error = await refused(ErrorCode.SANDBOX_LIMIT, backend.create(workspace=workspace, image=image.digest))
    assert "native driver" in error.message
    assert os.listdir(state_dir / "sessions") == []
