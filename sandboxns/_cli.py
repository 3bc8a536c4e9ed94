"""The ``sandboxns`` command."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import trio

from ._backend import open_backend
from ._errors import ErrorCode, SandboxError
from ._layers import remove_tree
from ._lease import clear_lease, lease_status, session_ids
from ._open import open_sandbox
from ._registry import DRIVERS
from ._rootfs_images import ImageStore, check_digest
from ._session import DEFAULT_TIMEOUT, Session
from ._snapshots import SnapshotStore, snapshot_id_of
from ._spec import SandboxSpec
from ._state import (
    default_state_directory,
    delete_expired_sessions,
    delete_image,
    delete_session,
    delete_snapshot,
    stored_session_state,
)

# Exit statuses of `sandboxns run` itself, as coreutils' timeout and env use them.
EXIT_TIMED_OUT = 124
EXIT_SANDBOX_ERROR = 125
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_STATUSES = "Exits with CMD's exit status; see below for the statuses of its own."
EXIT_STATUSES_DETAIL = f"""exit statuses:
  N          CMD exited with N
  128+N      signal N killed CMD
  {EXIT_TIMED_OUT}        CMD ran out of --timeout (it was killed)
  {EXIT_SANDBOX_ERROR}        the sandbox could not be set up or failed (sandboxns says why on stderr)
  {EXIT_CANNOT_EXECUTE}        CMD cannot be executed (not a program, no permission), or the request was
             refused (a bad option, spec or environment variable)
  {EXIT_NOT_FOUND}        CMD does not exist in the sandbox, or something named on the command line
             (a workspace, image, spec file or session) does not"""


class _Forwarder:
    """Copies a command's output to our own stdout/stderr as it arrives."""

    def __init__(self) -> None:
        self._targets = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}

    def feed(self, name: str, chunk: bytes) -> bool:
        target = self._targets[name]
        target.write(chunk)
        target.flush()
        return False


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """``--env K=V`` sets a variable; ``--env K`` copies K from our own
    environment, so a secret need not appear in a process list."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key:
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"--env expects KEY=VALUE or KEY, not {pair!r}")
        if not sep:
            if key not in os.environ:
                raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"--env {key}: {key} is not set here")
            value = os.environ[key]
        env[key] = value
    return env


def _command(args: argparse.Namespace, usage: str) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"no command given (usage: {usage})")
    return command


async def _run_forwarding(session: Session, args: argparse.Namespace, command: list[str]) -> int:
    """Run the command with our stdio, the way a shell would; returns our
    exit status."""
    env = {**session.environment, **_parse_env(args.env)}
    timeout = session.timeout if args.timeout is None else args.timeout
    # Our input is copied in as it arrives, never handed over: the guest
    # could reopen a file given as our stdin for writing through
    # /proc/self/fd/0. A terminal gives no input (we are not a terminal
    # emulator, and reading it would take what the user types next).
    stdin_fd = None if sys.stdin is None or os.isatty(0) else 0
    result = await session.execute(
        command[0], command[1:], env=env, cwd=args.cwd, timeout=timeout, output=_Forwarder(), stdin=stdin_fd
    )
    if result.timed_out:
        print(f"sandboxns: command timed out after {timeout:g}s; its processes were killed", file=sys.stderr)
        return EXIT_TIMED_OUT
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code


async def _until_signalled(main, args: argparse.Namespace) -> int:
    """Run ``main(args)``; SIGINT, SIGTERM and SIGHUP end it alike: the
    command is terminated (SIGTERM, then SIGKILL after a grace), what the
    run made is removed, and we exit 128+N like a shell's child. Signals
    that come during that cleanup are taken and ignored: it always
    finishes (SIGKILL is the way to cut it short)."""
    if threading.current_thread() is not threading.main_thread():
        return await main(args)  # only the main thread can receive signals
    received: list[int] = []
    status = error = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            main_scope = trio.CancelScope()

            async def run_main() -> None:
                nonlocal status, error
                with main_scope:
                    try:
                        status = await main(args)
                    except Exception as exc:  # noqa: BLE001 (raised below as itself, not in the nursery's group)
                        error = exc
                nursery.cancel_scope.cancel()

            nursery.start_soon(run_main)
            async for signum in signals:
                if not received:
                    received.append(signum)
                    main_scope.cancel()
    if received:
        return 128 + received[0]
    if error is not None:
        raise error
    return status


async def _run(args: argparse.Namespace) -> int:
    command = _command(args, "sandboxns run -- CMD [ARG...]")
    if args.spec is not None:
        return await _run_spec(args, command)
    if args.state_dir is not None and args.image is None:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "--state-dir goes with --spec or --image")
    temporary = None
    workspace = args.workspace
    if workspace is None:
        temporary = workspace = _make_throwaway_workspace()
    try:
        if args.image is not None:
            return await _run_on_image(args, command, Path(workspace))
        async with open_sandbox(
            workspace, driver=args.driver or "native", network=args.network or "deny-all"
        ) as session:
            return await _run_forwarding(session, args, command)
    finally:
        if temporary is not None:
            # The guest shaped this tree (any depth, modes, symlinks):
            # remove_tree copes with all of it; shutil.rmtree does not.
            with contextlib.suppress(SandboxError):
                remove_tree(Path(temporary))
            # The directory of throwaway workspaces goes with the last of
            # them; a run starting beside us recreates it (see above).
            with contextlib.suppress(OSError):
                Path(temporary).parent.rmdir()


def _make_throwaway_workspace() -> str:
    scratch = default_state_directory() / "tmp"
    while True:
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            return tempfile.mkdtemp(prefix="run-", dir=scratch)
        except FileNotFoundError:
            continue  # a run that just ended removed the directory


async def _run_on_image(args: argparse.Namespace, command: list[str], workspace: Path) -> int:
    """A throwaway session of the backend in --state-dir, over the
    workspace, on an image imported there; deleted afterwards."""
    state = args.state_dir or default_state_directory()
    async with open_backend(driver=args.driver or "native", state_directory=state) as backend:
        handle = await backend.create(
            workspace=workspace,
            image=check_digest(args.image),
            network=args.network or "deny-all",
            destroy_on_close=True,
        )
        try:
            return await _run_forwarding(handle.session, args, command)
        finally:
            with trio.CancelScope(shield=True):
                await handle.aclose()


def _load_valid_spec(path: str) -> SandboxSpec:
    spec = SandboxSpec.load(path)
    problems = spec.validate()
    if problems:
        raise SandboxError(
            ErrorCode.SANDBOX_INVALID_ARGUMENT,
            f"{path} is not a valid spec ('sandboxns validate {path}' lists everything): {problems[0]}",
        )
    return spec


async def _run_spec(args: argparse.Namespace, command: list[str]) -> int:
    for option in ("workspace", "network", "driver", "image"):
        if getattr(args, option) is not None:
            raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, f"--{option} comes from the spec; leave it out")
    spec = _load_valid_spec(args.spec)
    state = args.state_dir or default_state_directory()
    async with spec.build(state_directory=state) as sandbox:
        try:
            return await _run_forwarding(sandbox.session, args, command)
        finally:  # interrupted too: the session stays, so say where
            if not sandbox.handle.destroy_on_close:
                print(
                    f"sandboxns: session {sandbox.handle.session_id} kept (its spec does not delete it on close); "
                    f"run more in it with: sandboxns exec --state-dir {state} --session "
                    f"{sandbox.handle.session_id} -- CMD",
                    file=sys.stderr,
                )


async def _exec(args: argparse.Namespace) -> int:
    command = _command(args, "sandboxns exec --state-dir DIR --session ID -- CMD [ARG...]")
    spec = None if args.spec is None else _load_valid_spec(args.spec)
    if spec is not None and args.network is not None:
        raise SandboxError(ErrorCode.SANDBOX_INVALID_ARGUMENT, "--network comes from the spec; leave it out")
    state = stored_session_state(args.state_dir, args.session)
    async with open_backend(driver=state["backend"], state_directory=args.state_dir) as backend:
        network = spec.network_policy() if spec is not None else args.network or "deny-all"
        handle = await backend.create(state=state, template=state["template"], network=network)
        try:
            if spec is not None:
                spec.configure_session(handle.session)
            return await _run_forwarding(handle.session, args, command)
        finally:
            await handle.shutdown()


def _validate(args: argparse.Namespace) -> int:
    spec = SandboxSpec.load(args.spec)
    problems = spec.validate()
    for problem in problems:
        print(f"{args.spec}: {problem}")
    if problems:
        return 1
    print(f"{args.spec}: valid sandbox spec {spec.id!r}")
    return 0


def _exit_status_for(error: SandboxError) -> int:
    if error.code is ErrorCode.SANDBOX_NOT_FOUND:
        return EXIT_NOT_FOUND
    if error.code is ErrorCode.SANDBOX_INVALID_ARGUMENT:
        return EXIT_CANNOT_EXECUTE
    return EXIT_SANDBOX_ERROR


def _command_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, metavar="S", help=f"seconds (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K[=V]",
        help="set a variable, or copy K from this environment (repeatable)",
    )
    parser.add_argument("--cwd", metavar="DIR", help="working directory in the workspace (default /workspace)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")


def _listing_and_deleting(
    commands, noun: str, description: str, *, list_help: str, delete_help: str, refusal: str
) -> argparse.ArgumentParser:
    """``sandboxns NOUN list|delete --state-dir DIR``; returns the list
    command's parser."""
    parser = commands.add_parser(noun, help=f"list or delete the {noun}s in a state directory", description=description)
    nouns = parser.add_subparsers(dest=f"{noun}_command", required=True)
    listing = nouns.add_parser("list", help=list_help)
    listing.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    delete = nouns.add_parser("delete", help=delete_help, description=refusal)
    delete.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    delete.add_argument(noun, help=f"{noun} id (from '{noun} list')")
    return listing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxns", description="Run commands in Linux-namespace sandboxes.")
    commands = parser.add_subparsers(dest="subcommand", required=True)
    run = commands.add_parser(
        "run",
        help="run one command in a throwaway sandbox",
        description="Run CMD in a throwaway sandbox whose /workspace is DIR (default: a new empty "
        f"directory, removed afterwards). {EXIT_STATUSES}",
        epilog=EXIT_STATUSES_DETAIL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--workspace", metavar="DIR", help="host directory to mount read-write at /workspace")
    run.add_argument("--network", choices=("deny-all", "internet", "allow-all"), help="default deny-all")
    run.add_argument("--driver", choices=sorted(DRIVERS), help="default native")
    run.add_argument(
        "--spec",
        metavar="FILE",
        help="build the sandbox a spec file describes instead (a backend session in --state-dir, kept or "
        "deleted afterwards as its lifecycle says)",
    )
    run.add_argument(
        "--image",
        metavar="DIGEST",
        help="run on this image's root filesystem (see 'sandboxns image import'), not the host's",
    )
    run.add_argument(
        "--state-dir", type=Path, metavar="DIR", help=f"with --spec or --image (default {default_state_directory()})"
    )
    _command_options(run)
    exec_ = commands.add_parser(
        "exec",
        help="run one command in an existing backend session",
        description="Resume session ID of the backend in --state-dir, run CMD in it, and stop it again. The "
        "session's lease is held for the command's duration, so this is refused (SANDBOX_BUSY) while "
        f"another process holds the session. {EXIT_STATUSES}",
        epilog=EXIT_STATUSES_DETAIL,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exec_.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    exec_.add_argument("--session", required=True, metavar="ID")
    exec_.add_argument("--network", choices=("deny-all", "internet", "allow-all"), help="default deny-all")
    exec_.add_argument("--spec", metavar="FILE", help="take the environment, network and limits from this spec")
    _command_options(exec_)
    validate = commands.add_parser(
        "validate", help="check a sandbox spec file", description="List every problem in a sandbox spec; exit 1 if any."
    )
    validate.add_argument("spec", metavar="FILE", help="a .toml, .json or SANDBOX.md spec")
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
    _listing_and_deleting(
        commands,
        "session",
        "Sessions are made through the API, specs and 'sandboxns mcp'; these are for operators.",
        list_help="show every session and who holds it",
        delete_help="delete a stopped session and its workspace",
        refusal="Refused (SANDBOX_BUSY) while anyone holds the session or any of its processes remain.",
    )
    gc = commands.add_parser(
        "gc",
        help="delete stopped sessions past their retention",
        description="Delete every session in --state-dir that was created with a retention and has been stopped "
        "for longer, printing each one (a running backend does this every minute). A session anyone holds is "
        "never deleted.",
    )
    gc.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    gc.add_argument("--dry-run", action="store_true", help="only list the sessions that would be deleted")
    listing = _listing_and_deleting(
        commands,
        "snapshot",
        "Snapshots are made through the API (SessionHandle.snapshot and fork); these are for operators.",
        list_help="show every snapshot, oldest first",
        delete_help="delete a snapshot",
        refusal="Refused while a session or another snapshot stands on it.",
    )
    listing.add_argument("--json", action="store_true", help="one JSON list of the snapshots' records")
    image = commands.add_parser(
        "image",
        help="import, list or delete root filesystem images in a state directory",
        description="An image is an OCI image layout (a directory, or a tar of one: skopeo copy ... oci:, "
        "podman save --format oci-archive) or a plain root filesystem (a directory or a tar: docker export, "
        "debootstrap). Imported once, content-addressed by its digest.",
    )
    image_commands = image.add_subparsers(dest="image_command", required=True)
    importing = image_commands.add_parser("import", help="import an image and print its digest")
    importing.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    importing.add_argument("path", help="the image: a directory or a tar")
    listing = image_commands.add_parser("list", help="show every image")
    listing.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    listing.add_argument("--json", action="store_true", help="one JSON list of the images")
    delete = image_commands.add_parser("delete", help="delete an image")
    delete.add_argument("--state-dir", required=True, type=Path, metavar="DIR")
    delete.add_argument("digest", help="the image's digest (sha256:...)")
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
    mcp.add_argument("--network", choices=("deny-all", "internet", "allow-all"), default="deny-all")
    mcp.add_argument("--driver", choices=sorted(DRIVERS), default="native")
    return parser


def _session_dir(state_dir: Path, session_id: str) -> Path:
    if session_id not in session_ids(state_dir):
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no session {session_id!r} in {state_dir}")
    return state_dir / "sessions" / session_id


def _existing_state_directory(path: Path) -> Path:
    """An operator command's --state-dir, which must exist: a mistyped one
    is not an empty backend."""
    if not path.is_dir():
        raise SandboxError(ErrorCode.SANDBOX_NOT_FOUND, f"no state directory {path}")
    return path


def _list_sessions(state_dir: Path) -> None:
    for session_id in session_ids(_existing_state_directory(state_dir)):
        status = lease_status(state_dir / "sessions" / session_id)
        print(f"{session_id}  {status.describe()}")


def _lease(args: argparse.Namespace) -> int:
    if args.lease_command == "list":
        _list_sessions(args.state_dir)
        return 0
    print(trio.run(clear_lease, _session_dir(_existing_state_directory(args.state_dir), args.session), args.force))
    return 0


def _session(args: argparse.Namespace) -> int:
    if args.session_command == "list":
        _list_sessions(args.state_dir)
        return 0
    delete_session(_existing_state_directory(args.state_dir), args.session)
    print(f"{args.session}  deleted")
    return 0


def _gc(args: argparse.Namespace) -> int:
    _existing_state_directory(args.state_dir)
    outcome = "expired" if args.dry_run else "deleted"
    for session_id in delete_expired_sessions(args.state_dir, dry_run=args.dry_run):
        print(f"{session_id}  {outcome}")
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    _existing_state_directory(args.state_dir)
    if args.snapshot_command == "delete":
        delete_snapshot(args.state_dir, snapshot_id_of(args.snapshot))
        print(f"{args.snapshot}  deleted")
        return 0
    snapshots = SnapshotStore(args.state_dir / "snapshots").all()
    if args.json:
        print(json.dumps([snapshot.to_dict() for snapshot in snapshots], indent=1))
        return 0
    for snapshot in snapshots:
        created = datetime.datetime.fromtimestamp(snapshot.created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        print(f"{snapshot.id}  {created}  {snapshot.bytes} bytes  depth {snapshot.depth}  {snapshot.name or ''}")
    return 0


def _image(args: argparse.Namespace) -> int:
    store = ImageStore(args.state_dir / "images")
    if args.image_command == "import":
        image = store.import_path(args.path)
        print(image.digest)
        for skipped in image.skipped:
            print(f"skipped {skipped}", file=sys.stderr)
    elif args.image_command == "delete":
        delete_image(args.state_dir, check_digest(args.digest))
        print(f"{args.digest}  deleted")
    elif args.json:
        print(json.dumps([dataclasses.asdict(image) for image in store.list()], indent=1))
    else:
        for image in store.list():
            print(f"{image.digest}  {image.layers} layer(s)  {image.source}")
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
        if args.subcommand == "gc":
            return _gc(args)
        if args.subcommand == "session":
            return _session(args)
        if args.subcommand == "snapshot":
            return _snapshot(args)
        if args.subcommand == "image":
            return _image(args)
        if args.subcommand == "validate":
            return _validate(args)
        if args.subcommand == "exec":
            return trio.run(_until_signalled, _exec, args)
        if args.subcommand == "mcp":
            from ._mcp import run_mcp

            trio.run(run_mcp, args)
            return 0
        return trio.run(_until_signalled, _run, args)
    except SandboxError as error:
        print(f"sandboxns: {error.message}", file=sys.stderr)
        return _exit_status_for(error)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
