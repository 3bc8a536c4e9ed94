"""The benchmark suite in one command: ``python -m benchmarks``.

Runs, with a progress bar on stderr:

  spawn        latency of /usr/bin/true: bare, native, bwrap driver, bare
               bwrap, and the peers sandlock and srt where installed
  throughput   commands/s at 1, 2, 4 and 8 concurrent callers: bare and
               native (one session; and one session per caller)
               alternating, then the bwrap driver
  create       backend.create() for 10 / 1,000 / 10,000-file templates (the
               default overlay layout; create_latency.py also measures copies)
  cpu          CPU per sequential /usr/bin/true: this process's, and the
               spawned side's (a bare spawn's child; the native session's
               launcher, holder, inits and commands)

and writes ``results.json`` and, with matplotlib installed (the ``bench``
extra), ``results.png`` into ``--out``. The gateway and farm-scale numbers
have their own scripts (gateway.py, farm.py).

Usage: python -m benchmarks [-n N] [--seconds S] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import trio

# `python -m benchmarks` in a checkout puts the checkout first on sys.path,
# and its sandboxns has no compiled parts unless installed in place (pip
# install -e): then use the installed package instead.
_checkout = Path(__file__).resolve().parent.parent
if not any((_checkout / "sandboxns").glob("_sbx*.so")):
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _checkout]
sys.path.insert(0, str(Path(__file__).parent))  # the scripts import each other as top-level modules

import create_latency
import spawn_latency
from measuring import interleaved_rates, percentiles, process_tree_cpu

import sandboxns

CONCURRENCY = (1, 2, 4, 8)


class Progress:
    """One line on stderr: the step and a bar."""

    def __init__(self) -> None:
        self.interactive = sys.stderr.isatty()
        self.last = ""

    def __call__(self, step: str, done: float) -> None:
        bar = "#" * int(done * 30)
        line = f"{step:<12} [{bar:<30}] {done * 100:3.0f}%"
        if self.interactive:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif step != self.last or done >= 1:
            print(line, file=sys.stderr, flush=True)
        self.last = step

    def done(self) -> None:
        if self.interactive:
            print(file=sys.stderr)


async def throughput(seconds: float, progress: Progress) -> dict[str, dict[str, float]]:
    async def bare() -> None:
        await trio.run_process([spawn_latency.TRUE])

    def through(session: sandboxns.Session):
        async def run() -> None:
            await session.run(spawn_latency.TRUE)

        return run

    results: dict[str, dict[str, float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        runners = {"bare": bare}
        for driver in ("native", "bwrap"):
            workspace = stack.enter_context(tempfile.TemporaryDirectory(prefix="sandboxns-bench-"))
            try:
                session = await stack.enter_async_context(sandboxns.open_sandbox(workspace, driver=driver))
            except sandboxns.SandboxError:
                continue  # bwrap not installed
            runners[driver] = through(session)
        # The farm's case: each caller an agent with a session of its own.
        sessions = []
        for _ in range(max(CONCURRENCY)):
            workspace = stack.enter_context(tempfile.TemporaryDirectory(prefix="sandboxns-bench-"))
            sessions.append(await stack.enter_async_context(sandboxns.open_sandbox(workspace)))

        async def own_sessions() -> None:
            session = sessions.pop()  # never empty: one per caller
            try:
                await session.run(spawn_latency.TRUE)
            finally:
                sessions.append(session)

        runners["native_sessions"] = own_sessions
        results = {name: {} for name in runners}
        # bare and native alternate (one session, and one per caller); the
        # bwrap driver is measured on its own after them, for the reason
        # spawn_latency.py gives.
        groups = [{name: runners[name] for name in ("bare", "native", "native_sessions")}]
        if "bwrap" in runners:
            groups.append({"bwrap": runners["bwrap"]})
        steps = len(CONCURRENCY) * len(groups)
        for step, (group, concurrency) in enumerate(((g, c) for g in groups for c in CONCURRENCY), 1):
            rates = await interleaved_rates(group, concurrency, seconds)
            for name, rate in rates.items():
                results[name][str(concurrency)] = round(rate, 1)
            progress("throughput", step / steps)
    return results


async def cpu_per_command(n: int) -> dict[str, dict[str, float]]:
    """Microseconds of CPU per command, sequential: the host's (this
    process) and the spawned side's."""

    async def bare() -> None:
        await trio.run_process([spawn_latency.TRUE])

    def reaped_children() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    results = {}
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-") as workspace:
        async with sandboxns.open_sandbox(workspace) as session:

            async def native() -> None:
                await session.run(spawn_latency.TRUE)

            variants = {
                "bare": (bare, reaped_children),
                "native": (native, lambda: process_tree_cpu(session.driver._pid)),
            }
            for name, (run, spawned) in variants.items():
                for _ in range(20):
                    await run()
                host, side = time.process_time(), spawned()
                for _ in range(n):
                    await run()
                results[name] = {
                    "host_us": round((time.process_time() - host) / n * 1e6, 1),
                    "spawned_us": round((spawned() - side) / n * 1e6, 1),
                }
    return results


async def run_suite(args: argparse.Namespace) -> dict:
    progress = Progress()
    samples = await spawn_latency.sample(args.n, progress)
    results = {
        "spawn": {name: percentiles(values) for name, values in samples.items()},
        "spawn_samples_ms": {name: [round(v * 1000, 4) for v in values] for name, values in samples.items()},
        "throughput_per_s": await throughput(args.seconds, progress),
    }
    progress("create", 0.0)
    results["create_p50_ms"] = {
        name: stats["p50_ms"]
        for name, stats in (await create_latency.measure(max(3, args.n // 100), ("overlay",))).items()
    }
    progress("create", 1.0)
    progress("cpu", 0.0)
    results["cpu_per_command"] = await cpu_per_command(max(200, args.n * 2))
    progress("cpu", 1.0)
    progress.done()
    return results


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (latency, rates) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in ("bare", "native", "bwrap", "bwrap_cli", "sandlock") if n in results["spawn_samples_ms"]]
    latency.boxplot([results["spawn_samples_ms"][n] for n in names], showfliers=False)
    latency.set_xticks(range(1, len(names) + 1), names)
    latency.set_ylabel("ms per command (/usr/bin/true)")
    latency.set_title("Spawn latency")
    for name, by_concurrency in results["throughput_per_s"].items():
        rates.plot([int(c) for c in by_concurrency], list(by_concurrency.values()), marker="o", label=name)
    rates.set_xlabel("concurrent callers")
    rates.set_ylabel("commands per second")
    rates.set_title("Throughput")
    rates.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="spawn latency rounds (default 1000)")
    # Each point alternates bare and native in 4 slices, and every slice
    # starts and drains its callers: in 0.5 s slices (2 s points) that edge
    # cost the variant with the longer command more (69.6 % against 73.6 %
    # in 1 s slices, the same session). "Sustained" means the steady state.
    parser.add_argument("--seconds", type=float, default=4.0, help="per throughput point (default 4)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks"), help="where to write results")
    args = parser.parse_args()
    started = time.monotonic()
    results = trio.run(run_suite, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    spawn = results["spawn"]
    print(f"{'variant':<10} {'p50 ms':>8} {'p99 ms':>8} {'vs native':>10}")
    for name, stats in spawn.items():
        print(
            f"{name:<10} {stats['p50_ms']:>8.3f} {stats['p99_ms']:>8.3f} {stats['p50_ms'] / spawn['native']['p50_ms']:>9.2f}x"
        )
    print("throughput (commands/s):", json.dumps(results["throughput_per_s"]))
    print("create p50 (ms):", json.dumps(results["create_p50_ms"]))
    print("CPU per command (us):", json.dumps(results["cpu_per_command"]))
    drew = plot(results, args.out / "results.png")
    print(f"wrote {args.out / 'results.json'}" + (f" and {args.out / 'results.png'}" if drew else
          " (install the bench extra for the plot)") + f" in {time.monotonic() - started:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
