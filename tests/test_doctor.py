"""sandboxns doctor: the host readiness report."""

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
