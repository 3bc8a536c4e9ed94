"""The ``sandboxns`` command."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import trio

from ._errors import ErrorCode, SandboxError
from ._lease import clear_lease, lease_status, session_ids
from ._open import DRIVERS, open_sandbox
from ._session import DEFAULT_ENV, DEFAULT_TIMEOUT, check_command

# Exit statuses of `sandboxns run` itself, as coreutils' timeout and env use them.
EXIT_TIMED_OUT = 124
EXIT_SANDBOX_ERROR = 125
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def state_directory() -> Path:
    """Where sandboxns keeps state when nobody says otherwise."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "sandboxns"


class _Forwarder:
    """Copies a command's output to our own stdout/stderr as it arrives."""

    truncated = False

    def __init__(self) -> None:
        self._targets = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}

    def feed(self, name: str, chunk: bytes) -> bool:
        target = self._targets[name]
        target.write(chunk)
        target.flush()
        return False

    def output(self, name: str) -> bytes:
        return b""


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = dict(DEFAULT_ENV)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"--env expects KEY=VALUE, not {pair!r}")
        env[key] = value
    return env


async def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT, "no command given (usage: sandboxns run -- CMD [ARG...])"
        )
    argv, env, cwd, timeout = check_command(command[0], command[1:], _parse_env(args.env), None, args.timeout)
    # The guest may read our input only when it is a pipe or file: a terminal
    # fd inside the sandbox would be a channel back to the user's session.
    stdin_fd = None if os.isatty(0) else 0
    temporary = None
    workspace = args.workspace
    if workspace is None:
        scratch = state_directory() / "tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        temporary = workspace = tempfile.mkdtemp(prefix="run-", dir=scratch)
    try:
        async with open_sandbox(workspace, driver=args.driver, network=args.network) as session:
            result = await session._execute(
                argv, env=env, cwd=cwd, timeout=timeout, output=_Forwarder(), stdin=stdin_fd
            )
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    if result.timed_out:
        print(f"sandboxns: command timed out after {timeout:g}s; its processes were killed", file=sys.stderr)
        return EXIT_TIMED_OUT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code


def _exit_status_for(error: SandboxError) -> int:
    if error.code is ErrorCode.SANDBOX_NOT_FOUND:
        return EXIT_NOT_FOUND
    if error.code is ErrorCode.SANDBOX_INVALID_ARGUMENT:
        return EXIT_CANNOT_EXECUTE
    return EXIT_SANDBOX_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxns", description="Run commands in Linux-namespace sandboxes.")
    commands = parser.add_subparsers(dest="subcommand", required=True)
    run = commands.add_parser(
        "run",
        help="run one command in a throwaway sandbox",
        description="Run CMD in a throwaway sandbox whose /workspace is DIR (default: a new empty "
        "directory, removed afterwards). Exits with CMD's exit status (128+N if signal N killed it), "
        f"{EXIT_TIMED_OUT} on timeout, {EXIT_SANDBOX_ERROR} if the sandbox could not be set up.",
    )
    run.add_argument("--workspace", metavar="DIR", help="host directory to mount read-write at /workspace")
    run.add_argument("--network", choices=("deny-all", "allow-all"), default="deny-all")
    run.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S", help="seconds (default %(default)s)"
    )
    run.add_argument("--env", action="append", default=[], metavar="K=V", help="set a variable (repeatable)")
    run.add_argument("--driver", choices=sorted(DRIVERS), default="native")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    commands.add_parser("doctor", help="check that this host can run sandboxes, and say what to fix")
    lease = commands.add_parser(
        "lease",
        help="inspect or clear backend session leases",
        description="Operator commands for a backend's state directory. A session whose owner died is "
        "recovered automatically when that is provably safe; these are for the cases where it is not.",
    )
    lease_commands = lease.add_subparsers(dest="lease_command", required=True)
    listing = lease_commands.add_parser("list", help="show every session and who holds it")
    listing.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    clear = lease_commands.add_parser(
        "clear",
        help="make a session attachable again",
        description="Refuses while the session has processes or a live owner, unless --force: then its "
        "processes are killed first and the lease is replaced, so a live former owner loses it.",
    )
    clear.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    clear.add_argument("session", help="session id (from 'lease list')")
    clear.add_argument("--force", action="store_true", help="kill the session's remaining processes first")
    mcp = commands.add_parser(
        "mcp",
        help="serve a sandbox session's coding tools over MCP (stdio)",
        description="Start (or create) one backend session and serve its coding tools over MCP on stdin/stdout. "
        "The session is a new one from a template of the files in --files (default: empty), or one over the "
        "host directory --workspace. Needs the mcp extra.",
    )
    mcp.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    source = mcp.add_mutually_exclusive_group()
    source.add_argument("--files", metavar="DIR", help="snapshot this directory as the session's template")
    source.add_argument("--workspace", metavar="DIR", help="bind this host directory as /workspace")
    mcp.add_argument("--template", default="mcp", help="the template's name (with --files; default %(default)s)")
    mcp.add_argument("--network", choices=("deny-all", "allow-all"), default="deny-all")
    mcp.add_argument("--driver", choices=sorted(DRIVERS), default="native")
    return parser


def _session_dir(state_dir: Path, session_id: str) -> Path:
    if session_id not in session_ids(state_dir):
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no session {session_id!r} in {state_dir}")
    return state_dir / "sessions" / session_id


def _lease(args: argparse.Namespace) -> int:
    if args.lease_command == "list":
        for session_id in session_ids(args.state_dir):
            status = lease_status(args.state_dir / "sessions" / session_id)
            print(f"{session_id}  {status.describe()}")
        return 0
    print(trio.run(clear_lease, _session_dir(args.state_dir, args.session), args.force))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.subcommand == "doctor":
        from ._doctor import main as doctor

        return doctor()
    # Like any command-line tool in a pipeline: a closed stdout ends us quietly.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        if args.subcommand == "lease":
            return _lease(args)
        if args.subcommand == "mcp":
            from ._mcp import run_mcp

            trio.run(run_mcp, args)
            return 0
        return trio.run(_run, args)
    except SandboxError as error:
        print(f"sandboxns: {error.message}", file=sys.stderr)
        return _exit_status_for(error)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
