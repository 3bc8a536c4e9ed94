"""A StartPlan is checked when it is made, and both drivers start from one
alone: what the plan says is what the guest gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import refused

import sandboxns
from sandboxns import Confinement, ErrorCode, Mount, SandboxError, StartPlan
from sandboxns._driver import Overlay
from sandboxns._network import NetworkPolicy
from sandboxns._registry import driver_class

pytestmark = pytest.mark.smoke


def test_a_plan_holds_the_checked_values(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "data.txt").write_text("x")
    plan = StartPlan(
        str(tmp_path / "link"),
        network={"allow": [{"origin": "https://api.example.com"}]},
        mounts=[Mount(str(tmp_path / "link" / ".." / "data.txt"), "/run/data.txt")],
        confinement=None,
    )
    assert plan.workspace == real
    assert isinstance(plan.network, NetworkPolicy) and plan.network.needs_gateway
    assert plan.mounts == (Mount(str(tmp_path / "data.txt"), "/run/data.txt"),)
    assert plan.confinement == Confinement()
    assert (plan.uid, plan.gid, plan.image_root, plan.overlay, plan.gateway, plan.lease) == (
        1000,
        1000,
        None,
        None,
        None,
        None,
    )
    with pytest.raises(AttributeError):
        plan.uid = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"uid": -1}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"uid": True}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"gid": "1000"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"gid": 2**32 - 1}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"network": "open"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"network": {"allow": "https://a.example"}}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"mounts": [("/etc/hostname", "/run/h")]}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"mounts": [Mount("/etc/hostname", "/etc/hostname")]}, ErrorCode.SANDBOX_PATH_REFUSED),
        ({"confinement": "strict"}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"confinement": Confinement(workspace_size=64 << 20)}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"image_root": "relative/root"}, ErrorCode.SANDBOX_NOT_FOUND),
        ({"image_root": 7}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"overlay": ([], "/tmp")}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
        ({"lease": 3}, ErrorCode.SANDBOX_INVALID_ARGUMENT),
    ],
)
def test_a_bad_plan_is_refused_when_it_is_made(tmp_path, options, code):
    with pytest.raises(SandboxError) as error:
        StartPlan(tmp_path, **options)
    assert error.value.code == code, error.value


@pytest.mark.parametrize("workspace", ["missing", "file", None, "nul\0byte"])
def test_a_workspace_must_be_a_directory(tmp_path, workspace):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SandboxError) as error:
        StartPlan(workspace if workspace is None else tmp_path / workspace)
    expected = ErrorCode.SANDBOX_NOT_FOUND if workspace in ("missing", "file") else ErrorCode.SANDBOX_INVALID_ARGUMENT
    assert error.value.code == expected, error.value


async def test_a_driver_starts_from_a_plan_alone(driver_name, tmp_path):
    await refused(ErrorCode.SANDBOX_INVALID_ARGUMENT, driver_class(driver_name).start(tmp_path))


async def test_the_guest_gets_what_the_plan_says(driver_name, tmp_path):
    workspace, shared = tmp_path / "workspace", tmp_path / "shared"
    workspace.mkdir()
    shared.mkdir()
    (shared / "note").write_text("from the host\n")
    plan = StartPlan(workspace, uid=1234, gid=4321, mounts=[Mount(shared, "/run/shared")])
    driver = await driver_class(driver_name).start(plan)
    try:
        session = sandboxns.Session(driver)
        result = await session.run(
            "/bin/sh", ["-c", "id -u; id -g; pwd; cat /run/shared/note; touch /run/shared/new || echo read-only"]
        )
        assert result.stdout.split("\n") == ["1234", "4321", "/workspace", "from the host", "read-only", ""]
        assert driver.network == NetworkPolicy("deny-all")
    finally:
        await driver.aclose()
    assert not (shared / "new").exists()


async def test_bwrap_refuses_an_overlay_plan(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    plan = StartPlan(tmp_path, overlay=Overlay((Path("/usr"),), scratch))
    await refused(ErrorCode.SANDBOX_UNAVAILABLE, driver_class("bwrap").start(plan))
