"""The sandboxns command line."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import host_processes_with, sleep_marker

pytestmark = pytest.mark.smoke


def sandboxns(*args: str, cwd, env=None, input=None) -> subprocess.CompletedProcess:
    # Run from a scratch directory so the source tree is not importable.
    return subprocess.run(
        [sys.executable, "-m", "sandboxns", *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        input=input,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_run_streams_output_and_returns_the_exit_code(driver_name, tmp_path):
    done = sandboxns(
        "run",
        "--driver",
        driver_name,
        "--",
        "/bin/sh",
        "-c",
        "echo out; echo err >&2; exit 7",
        cwd=tmp_path,
        env={"XDG_STATE_HOME": str(tmp_path / "state")},
    )
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")


def test_run_over_a_workspace_with_env_and_stdin(driver_name, tmp_path):
    (tmp_path / "ws").mkdir()
    done = sandboxns(
        "run",
        "--driver",
        driver_name,
        "--workspace",
        str(tmp_path / "ws"),
        "--env",
        "GREETING=hi",
        "--",
        "/bin/sh",
        "-c",
        "cat > note; echo $GREETING; pwd",
        cwd=tmp_path,
        input=b"from stdin",
    )
    assert done.returncode == 0
    assert done.stdout == b"hi\n/workspace\n"
    assert (tmp_path / "ws" / "note").read_bytes() == b"from stdin"


def test_default_workspace_is_new_empty_and_removed(tmp_path):
    state = tmp_path / "state"
    done = sandboxns("run", "--", "/bin/sh", "-c", "ls -A; touch x", cwd=tmp_path, env={"XDG_STATE_HOME": str(state)})
    assert (done.returncode, done.stdout) == (0, b"")
    assert not (state / "sandboxns" / "tmp").exists()  # nor the directory of throwaway workspaces


def test_signal_timeout_and_errors_map_to_exit_statuses(driver_name, tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    assert (
        sandboxns(
            "run", "--driver", driver_name, "--", "/bin/sh", "-c", "kill -KILL $$", cwd=tmp_path, env=env
        ).returncode
        == 128 + 9
    )
    timed_out = sandboxns(
        "run", "--driver", driver_name, "--timeout", "0.3", "--", "/bin/sleep", "100", cwd=tmp_path, env=env
    )
    assert timed_out.returncode == 124 and b"timed out" in timed_out.stderr
    missing = sandboxns("run", "--driver", driver_name, "--", "/no/such/program", cwd=tmp_path, env=env)
    assert missing.returncode == 127 and b"/no/such/program" in missing.stderr
    no_workspace = sandboxns(
        "run", "--driver", driver_name, "--workspace", str(tmp_path / "nope"), "--", "true", cwd=tmp_path, env=env
    )
    assert no_workspace.returncode == 127 and b"not a directory" in no_workspace.stderr
    not_a_program = sandboxns("run", "--driver", driver_name, "--", "/etc/hostname", cwd=tmp_path, env=env)
    assert not_a_program.returncode == 126 and b"Permission denied" in not_a_program.stderr


def test_run_help_lists_every_exit_status(tmp_path):
    described = sandboxns("run", "--help", cwd=tmp_path).stdout.decode()
    entries = [line for line in described.split("exit statuses:")[1].splitlines() if line[2:3].strip()]
    listed = [line.split()[0] for line in entries]
    assert listed[:2] == ["N", "128+N"] and sorted(listed[2:]) == ["124", "125", "126", "127"]


def test_network_flag(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    deny = sandboxns("run", "--", "/bin/cat", "/proc/net/dev", cwd=tmp_path, env=env)
    allow = sandboxns("run", "--network", "allow-all", "--", "/bin/cat", "/proc/net/dev", cwd=tmp_path, env=env)
    host = Path("/proc/net/dev").read_bytes()
    assert deny.stdout.count(b":") == 1  # lo only
    assert allow.stdout.count(b":") == host.count(b":")


def test_doctor(tmp_path):
    done = sandboxns("doctor", cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert b"user-namespaces" in done.stdout


SPEC = """
id = "cli-box"
driver = "{driver}"
[template.files]
"greeting.txt" = "from the template"
[env]
vars = {{ GREETING = "hi" }}
passthrough = ["CLI_TEST_USER"]
[lifecycle]
destroy_on_close = {destroy}
"""


def test_validate_reports_every_problem(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(SPEC.format(driver="native", destroy="true"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": "x", "driver": "qemu", "limits": {"timeout": "soon"}}')
    assert sandboxns("validate", str(good), cwd=tmp_path).returncode == 0
    done = sandboxns("validate", str(bad), cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout.decode().splitlines() == [
        f"{bad}: driver: must be one of native, bwrap, not 'qemu'",
        f"{bad}: limits.timeout: must be a number, not a string",
    ]


def test_run_with_a_spec_then_exec_in_the_kept_session(driver_name, tmp_path):
    spec = tmp_path / "box.toml"
    spec.write_text(SPEC.format(driver=driver_name, destroy="false"))
    state = tmp_path / "state"
    env = {"CLI_TEST_USER": "alice"}
    done = sandboxns(
        "run", "--spec", str(spec), "--state-dir", str(state), "--",
        "sh", "-c", "cat greeting.txt; echo; echo $GREETING $CLI_TEST_USER; echo more > added.txt",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, b"from the template\nhi alice\n"), done.stderr
    [session] = os.listdir(state / "sessions")
    assert f"--session {session}".encode() in done.stderr
    in_sub = (
        "exec", "--state-dir", str(state), "--session", session, "--spec", str(spec), "--cwd", "sub", "--",
        "sh", "-c", "cat ../added.txt; pwd; echo $GREETING",
    )  # fmt: skip
    no_sub = sandboxns(*in_sub, cwd=tmp_path, env=env)
    assert no_sub.returncode == 127 and b"/workspace/sub" in no_sub.stderr
    made = sandboxns("exec", "--state-dir", str(state), "--session", session, "--", "mkdir", "sub", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    again = sandboxns(*in_sub, cwd=tmp_path, env=env)
    assert (again.returncode, again.stdout) == (0, b"more\n/workspace/sub\nhi\n"), again.stderr
    missing = sandboxns("exec", "--state-dir", str(state), "--session", "0" * 32, "--", "true", cwd=tmp_path)
    assert missing.returncode == 127 and b"no session" in missing.stderr


def test_run_with_a_destroying_spec_leaves_nothing(tmp_path):
    spec = tmp_path / "box.toml"
    spec.write_text(SPEC.format(driver="native", destroy="true"))
    state = tmp_path / "state"
    done = sandboxns(
        "run", "--spec", str(spec), "--state-dir", str(state), "--", "true", cwd=tmp_path, env={"CLI_TEST_USER": "a"}
    )
    assert done.returncode == 0 and os.listdir(state / "sessions") == []
    conflicting = sandboxns("run", "--spec", str(spec), "--network", "allow-all", "--", "true", cwd=tmp_path)
    assert conflicting.returncode == 126 and b"--network comes from the spec" in conflicting.stderr
    unset = sandboxns("run", "--spec", str(spec), "--state-dir", str(state), "--", "true", cwd=tmp_path)
    assert unset.returncode == 126 and b"CLI_TEST_USER" in unset.stderr


def _run_argv(driver_name: str, *command: str) -> list[str]:
    return [sys.executable, "-m", "sandboxns", "run", "--driver", driver_name, "--", *command]


# What the guest's fd 0-2 are, then its attempts to reach the caller's
# redirected files through them. (Reopening its own pipes may be refused:
# on a root host they are root's.)
REOPEN_STDIO = """
readlink /proc/self/fd/0 /proc/self/fd/1 /proc/self/fd/2 >&2
cat
(echo PWNED > /proc/self/fd/0; echo PWNED >> /proc/self/fd/0; true > /proc/self/fd/1) 2>/dev/null
echo after
"""


def test_run_gives_the_guest_pipes_never_the_callers_files(driver_name, tmp_path):
    given = tmp_path / "given"
    given.write_bytes(b"host data\n")
    out = tmp_path / "out"
    out.write_bytes(b"kept\n")
    with given.open("rb") as stdin, out.open("ab") as stdout:
        done = subprocess.run(
            _run_argv(driver_name, "/bin/sh", "-c", REOPEN_STDIO),
            check=False, cwd=tmp_path, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, timeout=60,
            env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [line.split(b":")[0] for line in done.stderr.splitlines()] == [b"pipe"] * 3, done.stderr
    assert given.read_bytes() == b"host data\n"
    assert out.read_bytes() == b"kept\nhost data\nafter\n"


def test_run_copies_stdin_as_it_arrives(driver_name, tmp_path):
    with subprocess.Popen(
        _run_argv(driver_name, "/bin/sh", "-c", "read a; echo got $a; read b; echo got $b"),
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
    ) as running:  # fmt: skip
        running.stdin.write(b"one\n")
        running.stdin.flush()
        # The answer to the first line comes while the second is unwritten.
        assert select.select([running.stdout], [], [], 30)[0], "no answer to the first line"
        assert running.stdout.readline() == b"got one\n"
        running.stdin.write(b"two\n")
        running.stdin.close()
        assert running.stdout.read() == b"got two\n"
        assert running.wait(timeout=30) == 0


def test_run_input_from_files_and_pipes_nobody_reads(driver_name, tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    large = tmp_path / "large"
    large.write_bytes(os.urandom(3 << 20))
    for source, expected in ((large, b"%d\n" % (3 << 20)), (Path(os.devnull), b"0\n")):
        with source.open("rb") as stdin:
            done = subprocess.run(
                _run_argv(driver_name, "/bin/sh", "-c", "wc -c"),
                check=False, cwd=tmp_path, stdin=stdin, capture_output=True, env=env, timeout=60,
            )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, expected), done.stderr
    # A command that exits without reading ends the run, though its input
    # never ends.
    with subprocess.Popen(_run_argv(driver_name, "true"), cwd=tmp_path, stdin=subprocess.PIPE, env=env) as running:
        running.stdin.write(b"never read\n")
        running.stdin.flush()
        assert running.wait(timeout=30) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signalled_run_ends_its_command_and_leaves_nothing(tmp_path, signum):
    marker = sleep_marker()
    state = tmp_path / "state"
    with subprocess.Popen(
        [sys.executable, "-P", "-m", "sandboxns", "run", "--", "/bin/sh", "-c", f"echo ready; exec sleep {marker}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        env={**os.environ, "XDG_STATE_HOME": str(state)},
    ) as run:
        assert run.stdout.readline() == b"ready\n"  # the command runs
        run.send_signal(signum)
        assert run.wait(timeout=30) == 128 + signum
    assert host_processes_with(marker) == []
    assert not (state / "sandboxns" / "tmp").exists()  # no throwaway workspace, nor their directory


def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    state = tmp_path / "state"
    script = "trap 'echo terminating' TERM; echo ready; while :; do sleep 0.1; done"
    with subprocess.Popen(
        [sys.executable, "-P", "-m", "sandboxns", "run", "--", "/bin/sh", "-c", script],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        env={**os.environ, "XDG_STATE_HOME": str(state)},
    ) as run:
        assert run.stdout.readline() == b"ready\n"
        run.send_signal(signal.SIGTERM)
        assert run.stdout.readline() == b"terminating\n"  # the command got SIGTERM: cleanup has begun
        run.send_signal(signal.SIGHUP)
        assert run.wait(timeout=30) == 128 + signal.SIGTERM
    assert not (state / "sandboxns" / "tmp").exists()
