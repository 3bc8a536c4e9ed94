"""Snapshot and fork latency against workspace size, and commands on a deep
stack of layers.

For workspaces of 10, 1,000 and 100,000 small files, written by a command
in the session (so they lie in its own upper layer, the case a snapshot
must move rather than share), then written back and snapshotted once,
untimed, SETTLE_SECONDS before the timed ones, measures on each driver:

  snapshot     handle.snapshot(), each after a one-file write (p50)
  fork1        handle.fork(1): a snapshot and a session over it (p50); on
               the native driver from backend.pool_forks(size=2), as a farm
               that forks would run it
  flatten      the snapshot that merges a stack grown past MAX_STACK_DEPTH
               into one layer (native; once per size)

then fork(16) against 16 creates from a template, and `find /workspace |
wc -l` (a stat-heavy command) in a 10,000-file workspace on 1 read-only
layer and on 32 (the template under 31 snapshots), alternating. The bwrap
driver copies (see README), so it is measured up to COPY_SIZE_LIMIT files
only: each of its snapshots and forks copies the whole workspace.

The state directory is made in TMPDIR; its file system (recorded in the
results) counts: on ext4 after much creating and deleting, making a file
or directory (which a snapshot and each overlay mount do a few times) gets
slow. TMPDIR=/dev/shm measures on tmpfs.

Usage: python benchmarks/snapshots.py [-n REPS] [--sizes 10,1000,100000]
                                      [--drivers native,bwrap] [--json FILE]
                                      [--plot FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import trio
from create_latency import template_files
from measuring import percentiles, write_json

import sandboxns
from sandboxns._snapshots import MAX_STACK_DEPTH

COPY_SIZE_LIMIT = 10_000
SETTLE_SECONDS = 3
# Writes argv[1] files of 64 bytes, 1,000 to a directory.
WRITE = """
import os, sys
for i in range(int(sys.argv[1])):
    directory = f"/workspace/d{i // 1000}"
    if i % 1000 == 0:
        os.mkdir(directory)
    with open(f"{directory}/f{i}", "w") as f:
        f.write(f"{i}".ljust(64, "x"))
"""


async def run_ok(handle, argv: list[str]) -> None:
    result = await handle.session.run(argv[0], argv[1:], timeout=3600)
    assert result.exit_code == 0, result


async def timed(operation) -> tuple[float, object]:
    started = time.perf_counter()
    value = await operation
    return time.perf_counter() - started, value


async def by_size(backend, size: int, reps: int) -> dict:
    """snapshot, fork1 and (native) flatten for one workspace size."""
    empty = await backend.prewarm(template="empty", files={})
    results: dict[str, list[float]] = {"snapshot": [], "fork1": []}
    if backend.name == "native":
        await backend.pool_forks(size=2)
    async with await backend.create(template=empty.template_key, destroy_on_close=True) as origin:
        await run_ok(origin, ["python3", "-c", WRITE, str(size)])
        # The timings are not of the kernel's aftermath of the setup: its
        # files written back to disk, and the overlay they were written
        # through (which the first snapshot replaces) gone, its cached
        # inodes freed (RCU frees 100,000 of them over the next second or
        # so, on the CPUs the snapshots then share; see RESULTS.md).
        await trio.to_thread.run_sync(os.sync)
        await origin.snapshot()
        await trio.sleep(SETTLE_SECONDS)
        for rep in range(reps):
            await origin.session.write_file(f"step-{rep}", b"x")
            elapsed, _ = await timed(origin.snapshot())
            results["snapshot"].append(elapsed)
            elapsed, [fork] = await timed(origin.fork(1))
            results["fork1"].append(elapsed)
            await fork.delete()
            if backend.name == "native":
                await backend.pool_forks(size=2)  # refilled, as between a farm's forks
        summary = {name: percentiles(values) for name, values in results.items()}
        if backend.name == "native":
            # Snapshot until the stack flattens: that one merges it whole.
            while True:
                await origin.session.write_file("flatten", b"x")
                elapsed, snapshot = await timed(origin.snapshot())
                if snapshot.depth == 1:
                    summary["flatten_ms"] = round(elapsed * 1000, 1)
                    break
    return summary


async def fork16(backend, reps: int) -> dict:
    """Against session starts: without the fork pool."""
    await backend.pool_forks(size=0)
    files = template_files(1000)
    template = await backend.prewarm(template="fork16", files=files)
    creates, forks = [], []
    async with await backend.create(template=template.template_key, destroy_on_close=True) as origin:
        for _ in range(reps):
            elapsed, handle = await timed(backend.create(template=template.template_key))
            creates.append(elapsed)
            await handle.delete()
            elapsed, handles = await timed(origin.fork(16))
            forks.append(elapsed)
            for handle in handles:
                await handle.delete()
    return {"create": percentiles(creates), "fork16": percentiles(forks)}


async def deep_stack(backend, reps: int) -> dict:
    """find | wc -l on 1 layer and on 32, alternating."""
    template = await backend.prewarm(template="deep", files=template_files(10_000))
    shallow = await backend.create(template=template.template_key, destroy_on_close=True)
    deep = await backend.create(template=template.template_key, destroy_on_close=True)
    async with shallow, deep:
        for step in range(MAX_STACK_DEPTH - 1):
            await deep.session.write_file(f"pkg{step}/changed-{step}.py", b"x")
            await deep.snapshot()
        samples: dict[str, list[float]] = {"depth1": [], "depth32": []}
        for rep in range(reps + 1):
            for name, handle in (("depth1", shallow), ("depth32", deep)):
                started = time.perf_counter()
                await run_ok(handle, ["sh", "-c", "find /workspace | wc -l"])
                if rep:
                    samples[name].append(time.perf_counter() - started)
    summary = {name: percentiles(values) for name, values in samples.items()}
    summary["ratio"] = round(summary["depth32"]["p50_ms"] / summary["depth1"]["p50_ms"], 3)
    return summary


async def measure(reps: int, sizes: list[int], drivers: list[str]) -> dict:
    results: dict = {"state_directory_fs": file_system_of(tempfile.gettempdir())}
    for driver in drivers:
        with tempfile.TemporaryDirectory(prefix="sandboxns-bench-snap-") as state:
            async with sandboxns.open_backend(driver=driver, state_directory=state) as backend:
                for size in sizes:
                    if driver == "bwrap" and size > COPY_SIZE_LIMIT:
                        continue
                    print(f"{driver}: {size} files", file=sys.stderr, flush=True)
                    results[f"{driver}/{size}"] = await by_size(backend, size, reps)
                if driver == "native":
                    print("native: fork(16) and a deep stack", file=sys.stderr, flush=True)
                    results["native/fork16"] = await fork16(backend, max(3, reps // 3))
                    results["native/deep"] = await deep_stack(backend, reps * 2)
    return results


def file_system_of(path: str) -> str:
    """The type of the file system ``path`` is on, as stat(1) names it."""
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()


def plot(results: dict, sizes: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for driver in ("native", "bwrap"):
        for what, style in (("snapshot", "o-"), ("fork1", "s--")):
            points = [results[f"{driver}/{size}"][what]["p50_ms"] for size in sizes if f"{driver}/{size}" in results]
            if points:
                axes.plot(sizes[: len(points)], points, style, label=f"{driver} {what}")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("files in the workspace")
    axes.set_ylabel("p50 ms")
    axes.set_title("Snapshot and fork(1)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=10, help="repetitions per size (default 10; at most 14)")
    parser.add_argument("--sizes", default="10,1000,100000")
    parser.add_argument("--drivers", default="native,bwrap")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plot", metavar="FILE", help="a chart of snapshot and fork(1) p50 (needs matplotlib)")
    args = parser.parse_args()
    # Each rep stacks two layers on the origin (its snapshot and its fork's),
    # over the template and the settling snapshot.
    if not 1 <= args.n <= (MAX_STACK_DEPTH - 3) // 2:
        parser.error(f"-n must be from 1 to {(MAX_STACK_DEPTH - 3) // 2}")
    sizes = [int(size) for size in args.sizes.split(",")]
    results = trio.run(measure, args.n, sizes, args.drivers.split(","))
    print(f"state directory on {results['state_directory_fs']}")
    for name, summary in results.items():
        if not isinstance(summary, dict):
            continue
        shown = {k: (v["p50_ms"] if isinstance(v, dict) else v) for k, v in summary.items()}
        print(f"{name:<16} " + "  ".join(f"{k} {v}" for k, v in shown.items()))
    write_json(args.json, results)
    if args.plot:
        plot(results, sizes, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
