"""sandboxns doctor: the host readiness report."""

import os

from sandboxns._doctor import Check, format_report, main, run_checks


def test_run_checks_names_each_check_once():
    names = [check.name for check in run_checks()]
    assert len(names) == len(set(names))
    assert {"user-namespaces", "holder", "sandbox"} <= set(names)


def test_this_host_is_ready(capsys):
    # Both the root and the unprivileged test runs happen on hosts where user
    # namespaces work, so every required check passes.
    assert main() == 0
    output = capsys.readouterr().out
    for name in ("kernel", "user-namespaces", "apparmor-userns", "pidfd", "holder", "sandbox"):
        assert name in output
    assert "FAIL" not in output


def test_the_workspace_cap_check_says_what_this_host_lacks():
    [check] = [check for check in run_checks() if check.name == "workspace-cap"]
    assert not check.required
    if os.geteuid() == 0:  # root hosts, like CI's, have loop devices and e2fsprogs
        assert check.ok, check.detail
    else:
        assert not check.ok and "CAP_SYS_ADMIN" in check.detail


def test_format_report_marks_failures():
    report = format_report(
        [
            Check("kernel", True, "Linux 6.8", True),
            Check("user-namespaces", False, "run 'sysctl -w user.max_user_namespaces=15000'", True),
            Check("bwrap", False, "run 'apt-get install -y bubblewrap'", False),
        ]
    )
    lines = report.splitlines()
    assert lines[0].startswith("ok  ")
    assert lines[1].startswith("FAIL") and "user.max_user_namespaces" in lines[1]
    assert lines[2].startswith("warn")
    assert "user-namespaces" in lines[-1] and "bwrap" in lines[-1]


def test_the_images_check_runs_a_program_on_an_image_root():
    # Sessions on images work on every host the tests run on (root and not).
    [check] = [check for check in run_checks() if check.name == "images"]
    assert not check.required
    assert check.ok, check.detail
