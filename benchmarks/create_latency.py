"""Session create latency against template size.

For templates of 10, 1,000 and 10,000 small files, measures the wall time of
``backend.create(template=...)`` until the session is ready to run commands,
for the two workspace layouts, interleaved:

  overlay  the template is the read-only lower layer of an overlay (default)
  copy     the template is copied into the session (the fallback where
           unprivileged overlayfs is unavailable; reflinked where possible)

Each created session is deleted again outside the timed part.

Usage: python benchmarks/create_latency.py [-n REPS] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import trio
from measuring import percentiles, write_json

import sandboxns

SIZES = (10, 1_000, 10_000)
LAYOUTS = ("overlay", "copy")


def template_files(count: int) -> dict[str, bytes]:
    """``count`` 64-byte files, 100 to a directory, like a small source tree."""
    return {f"pkg{i // 100}/module{i}.py": (b"# %d\n" % i).ljust(64, b"x") for i in range(count)}


async def measure(reps: int, layouts: tuple[str, ...] = LAYOUTS) -> dict[str, dict[str, float]]:
    samples: dict[str, list[float]] = {f"{layout}/{size}": [] for size in SIZES for layout in layouts}
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-") as state:
        async with sandboxns.open_backend(state_directory=state) as backend:
            keys = {
                size: (await backend.prewarm(template=f"t{size}", files=template_files(size))).template_key
                for size in SIZES
            }
            for rep in range(reps + 1):  # the first round warms caches and is dropped
                for size in SIZES:
                    for layout in layouts:
                        backend._overlay = layout == "overlay"
                        started = time.perf_counter()
                        handle = await backend.create(template=keys[size])
                        elapsed = time.perf_counter() - started
                        await handle.delete()
                        if rep:
                            samples[f"{layout}/{size}"].append(elapsed)
    return {name: percentiles(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20, help="creates per layout and size (default 20)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = trio.run(measure, args.n)
    print(f"{'files':>6} {'overlay p50 ms':>15} {'copy p50 ms':>12} {'copy/overlay':>13}")
    for size in SIZES:
        overlay, copy = results[f"overlay/{size}"]["p50_ms"], results[f"copy/{size}"]["p50_ms"]
        print(f"{size:>6} {overlay:>15.3f} {copy:>12.3f} {copy / overlay:>12.2f}x")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
