"""Spawn latency: how much a fully isolated command costs over a bare spawn.

Measures, in one run, the wall time of running /usr/bin/true, interleaved
round by round within each group below (so machine noise hits the variants
of a group alike):

  bare       trio.run_process(["/usr/bin/true"]) -- no sandbox at all
  native     session.run("/usr/bin/true") on a warm native session

  bwrap      session.run("/usr/bin/true") through the bwrap driver (the same
             contract: one bwrap per command plus its bookkeeping)
  bwrap_cli  trio.run_process(["bwrap", "--unshare-all", ..., "/usr/bin/true"]),
             the bare bwrap invocation a hand-rolled wrapper would make

  sandlock   sandlock.Sandbox(...).run(["/usr/bin/true"]), if installed
  srt        the srt CLI (@anthropic-ai/sandbox-runtime), if installed

The groups run one after the other. Every bwrap call makes and drops a
network namespace, whose teardown the kernel defers to a worker thread
that then takes a core from whatever runs next; interleaved with bwrap,
native's p50 rose by ~0.15 ms and bare's by ~0.03 ms (native relies on the
second core to prepare its next command), so bwrap's own cost would be
charged to its neighbours.

Usage: python benchmarks/spawn_latency.py [-n N] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import trio
from measuring import percentiles, write_json

import sandboxns

TRUE = "/usr/bin/true"


def bwrap_argv() -> list[str] | None:
    """A bwrap invocation with a mount plan equivalent to the native driver's."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    for name in ("usr", "bin", "sbin", "lib", "lib64"):
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", TRUE]


def peer_variants(stack: contextlib.ExitStack) -> dict[str, tuple[Callable[[], Awaitable[object]], int]]:
    """The peers, where installed: sandlock (Landlock + seccomp, from PyPI)
    and srt (the @anthropic-ai/sandbox-runtime CLI). Each comes with how
    rarely to sample it: srt starts node for every command."""
    peers: dict[str, tuple[Callable[[], Awaitable[object]], int]] = {}
    try:
        import sandlock
    except ImportError:
        pass
    else:
        box = sandlock.Sandbox(
            fs_readable=["/usr", "/lib", "/lib64", "/bin", "/etc"], fs_writable=["/tmp"], clean_env=True
        )

        async def run_sandlock() -> None:
            # sandlock's API is blocking; calling it inline measures it alone.
            assert box.run([TRUE]).exit_code == 0

        peers["sandlock"] = (run_sandlock, 1)
    srt = shutil.which("srt")
    if srt is not None:
        settings = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".json"))  # noqa: SIM115
        json.dump({"network": {"allowedDomains": [], "deniedDomains": []},
                   "filesystem": {"denyRead": [], "allowWrite": ["/tmp"], "denyWrite": []}}, settings)  # fmt: skip
        settings.flush()

        async def run_srt() -> None:
            await trio.run_process([srt, "-s", settings.name, TRUE])

        peers["srt"] = (run_srt, 50)
    return peers


async def sample(n: int, progress: Callable[[str, float], None] = lambda name, done: None) -> dict[str, list[float]]:
    """Raw wall times (seconds) per variant, interleaved round by round."""
    bwrap = bwrap_argv()
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for driver in ("native", "bwrap") if bwrap is not None else ("native",):
            workspace = stack.enter_context(tempfile.TemporaryDirectory(prefix="sandboxns-bench-"))
            sessions[driver] = await stack.enter_async_context(sandboxns.open_sandbox(workspace, driver=driver))

        def through(session: sandboxns.Session) -> Callable[[], Awaitable[object]]:
            async def run() -> None:
                result = await session.run(TRUE)
                assert result.exit_code == 0, result

            return run

        async def bare() -> None:
            await trio.run_process([TRUE])

        async def bwrap_cli() -> None:
            await trio.run_process(bwrap)

        # name -> (run, sample every how many rounds)
        ours: dict[str, tuple[Callable[[], Awaitable[object]], int]] = {
            "bare": (bare, 1), "native": (through(sessions["native"]), 1),
        }  # fmt: skip
        bwraps: dict[str, tuple[Callable[[], Awaitable[object]], int]] = {}
        if bwrap is not None:
            bwraps = {"bwrap": (through(sessions["bwrap"]), 1), "bwrap_cli": (bwrap_cli, 1)}
        peers = peer_variants(stack.enter_context(contextlib.ExitStack()))
        samples: dict[str, list[float]] = {}
        # Each group on its own (see the module's docstring); the peers last,
        # as one of them starts node and another blocks the loop.
        for phase, group in (("spawn latency", ours), ("bwrap", bwraps), ("peers", peers)):
            samples.update({name: [] for name in group})
            for _ in range(max(5, n // 20) if group else 0):  # warm-up
                for run, _every in group.values():
                    await run()
            for round_ in range(n if group else 0):
                for name, (run, every) in group.items():
                    if round_ % every:
                        continue
                    started = time.perf_counter()
                    await run()
                    samples[name].append(time.perf_counter() - started)
                progress(phase, (round_ + 1) / n)
    return samples


async def measure(n: int) -> dict[str, dict[str, float]]:
    return {name: percentiles(values) for name, values in (await sample(n)).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=500, help="runs per variant (default 500)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = trio.run(measure, args.n)
    bare = results["bare"]["p50_ms"]
    print(f"{'variant':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'p50/bare':>9}")
    for name, stats in results.items():
        ratio = stats["p50_ms"] / bare
        print(f"{name:<10} {stats['p50_ms']:>8.3f} {stats['p90_ms']:>8.3f} {stats['p99_ms']:>8.3f} {ratio:>8.2f}x")
    for other in ("bwrap", "bwrap_cli", "sandlock", "srt"):
        if other in results:
            speedup = results[other]["p50_ms"] / results["native"]["p50_ms"]
            print(f"native is {speedup:.2f}x faster than {other} at p50")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
