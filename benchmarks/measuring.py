"""What the benchmark scripts share: summarising samples, counting
commands per second, and writing results."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Awaitable, Callable

import trio


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean in milliseconds of samples in seconds."""
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000

    return {
        "p50_ms": round(at(0.50), 3),
        "p90_ms": round(at(0.90), 3),
        "p99_ms": round(at(0.99), 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
        "n": len(ordered),
    }


async def interleaved_rates(
    variants: dict[str, Callable[[], Awaitable[object]]], concurrency: int, seconds: float, rounds: int = 4
) -> dict[str, float]:
    """Commands per second of each variant with ``concurrency`` callers,
    ``seconds`` each in all, measured in ``rounds`` alternating slices so a
    drift in the machine's background load (deferred namespace teardown,
    another tenant) falls on every variant alike rather than on whichever
    ran first."""
    counts = dict.fromkeys(variants, 0)
    for _ in range(rounds):
        for name, run in variants.items():
            counts[name] += await _count(run, concurrency, seconds / rounds)
    return {name: count / seconds for name, count in counts.items()}


async def _count(run: Callable[[], Awaitable[object]], concurrency: int, seconds: float) -> int:
    """How many times ``concurrency`` callers complete ``run`` in ``seconds``,
    each calling it again as soon as it returns."""
    count = 0
    deadline = trio.current_time() + seconds

    async def caller() -> None:
        nonlocal count
        while trio.current_time() < deadline:
            await run()
            count += 1

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(caller)
    return count


def write_json(path: str | None, results: dict) -> None:
    """Write the results to ``path`` (a script's --json), if given."""
    if path:
        with open(path, "w") as out:
            json.dump(results, out, indent=2)
            out.write("\n")


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user and system) of ``pid`` and every live descendant,
    each with what its reaped children used: all a sandbox's processes
    have used, read from /proc (clock ticks, so measure many commands)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, pending, seen = 0, [pid], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile: its parent's counts have it
    return total / ticks
