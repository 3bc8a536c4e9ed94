"""What the benchmark scripts share: summarising samples, counting
commands per second, and writing results."""

from __future__ import annotations

import json
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


async def per_second(run: Callable[[], Awaitable[object]], concurrency: int, seconds: float) -> float:
    """How many times per second ``concurrency`` callers complete ``run``,
    each calling it again as soon as it returns, for ``seconds``."""
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
    return count / seconds


def write_json(path: str | None, results: dict) -> None:
    """Write the results to ``path`` (a script's --json), if given."""
    if path:
        with open(path, "w") as out:
            json.dump(results, out, indent=2)
            out.write("\n")
