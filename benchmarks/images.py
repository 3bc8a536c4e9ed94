"""Sessions on a root filesystem image against sessions on the host's trees.

Builds an image from the host's own /usr/bin/true and /bin/sh with the
libraries they load (so the same programs run in both), padded with files
of random bytes to --mib MiB, imports it (as a plain root filesystem
directory, and as an OCI layout of one uncompressed layer: import time per
MiB), then measures on each driver, alternating the two kinds so a drift in
the machine's load falls on both alike:

  create      Backend.create() from an empty template, then delete (p50)
  true        run('/usr/bin/true') in a live session (p50)

Goals (issue 19): create on a 200 MiB image <= 1.2x create without one;
run(true) on an image within 1.1x of the host's trees.

Usage: python benchmarks/images.py [-n REPS] [--mib 200] [--drivers native,bwrap] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import trio
from measuring import percentiles, write_json

import sandboxns

PROGRAMS = ("/usr/bin/true", "/bin/sh")
PAD_FILE_BYTES = 64 * 1024


def build_root(root: Path, mib: int) -> None:
    """The programs, their libraries (at the paths the host has them),
    merged-/usr links, and ``mib`` MiB of padding."""
    needed = set(PROGRAMS)
    for program in PROGRAMS:
        listed = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
        needed |= {word for word in listed.split() if word.startswith("/")}
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{name}"):
            (root / "usr" / name).mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(os.readlink(f"/{name}"))
    for path in sorted(needed):  # where the loader looks, through the links just made
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)
    pad = root / "usr/share/pad"
    for index in range(mib * 1024 * 1024 // PAD_FILE_BYTES):
        directory = pad / f"{index // 256}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{index}.bin").write_bytes(os.urandom(PAD_FILE_BYTES))


def oci_layout(root: Path, layout: Path) -> None:
    """``root`` as an OCI image layout of one uncompressed layer."""
    blobs = layout / "blobs/sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layer = layout / "layer.tar"
    with tarfile.open(layer, "w") as packed:
        for path in sorted(root.rglob("*")):
            packed.add(path, arcname=str(path.relative_to(root)), recursive=False)
    layer_data = layer.read_bytes()
    layer.unlink()
    config = blob(json.dumps({"config": {"Env": ["PATH=/usr/bin:/bin"]}, "rootfs": {"type": "layers"}}).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **blob(layer_data)}],
    }
    described = blob(json.dumps(manifest).encode())
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{**described}]}))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


async def timed_import(backend, source: Path, mib: int) -> tuple[str, dict]:
    started = time.perf_counter()
    image = await backend.import_image(source)
    elapsed = time.perf_counter() - started
    return image.digest, {"seconds": round(elapsed, 2), "ms_per_mib": round(elapsed * 1000 / mib, 1)}


async def by_driver(driver: str, sources: dict[str, Path], mib: int, reps: int) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-images-") as state:
        async with sandboxns.open_backend(driver=driver, state_directory=state) as backend:
            for kind, source in sources.items():
                digest, results[f"import_{kind}"] = await timed_import(backend, source, mib)
                if kind == "directory":
                    for image in await backend.images():
                        await backend.delete_image(image.digest)  # the layout's import is measured afresh
            plain = await backend.prewarm(template="plain", files={})
            on_image = await backend.prewarm(template="image", files={}, image=digest)
            creates: dict[str, list[float]] = {"host": [], "image": []}
            for _ in range(reps):
                for name, template in (("host", plain), ("image", on_image)):
                    started = time.perf_counter()
                    handle = await backend.create(template=template.template_key)
                    creates[name].append(time.perf_counter() - started)
                    await handle.delete()
            runs: dict[str, list[float]] = {"host": [], "image": []}
            host = await backend.create(template=plain.template_key, destroy_on_close=True)
            imaged = await backend.create(template=on_image.template_key, destroy_on_close=True)
            async with host, imaged:
                for rep in range(reps * 10 + 1):
                    for name, handle in (("host", host), ("image", imaged)):
                        started = time.perf_counter()
                        result = await handle.session.run("/usr/bin/true")
                        assert result.exit_code == 0, result
                        if rep:  # the first of each warms the caches
                            runs[name].append(time.perf_counter() - started)
    for what, samples in (("create", creates), ("true", runs)):
        summary = {name: percentiles(values) for name, values in samples.items()}
        summary["ratio"] = round(summary["image"]["p50_ms"] / summary["host"]["p50_ms"], 3)
        results[what] = summary
    return results


async def measure(reps: int, mib: int, drivers: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-image-src-") as scratch:
        root, layout = Path(scratch, "root"), Path(scratch, "layout")
        root.mkdir()
        build_root(root, mib)
        oci_layout(root, layout)
        sources = {"directory": root, "oci_layout": layout}
        results: dict = {"image_mib": mib}
        for driver in drivers:
            print(f"{driver}: {mib} MiB image", file=sys.stderr, flush=True)
            results[driver] = await by_driver(driver, sources, mib, reps)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=30, help="creates per kind (default 30; ten times as many runs)")
    parser.add_argument("--mib", type=int, default=200, help="the image's size (default 200)")
    parser.add_argument("--drivers", default="native,bwrap")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    results = trio.run(measure, args.n, args.mib, args.drivers.split(","))
    for driver in args.drivers.split(","):
        shown = results[driver]
        print(
            f"{driver:<7} import {shown['import_directory']['ms_per_mib']} ms/MiB (directory), "
            f"{shown['import_oci_layout']['ms_per_mib']} ms/MiB (OCI layout); "
            f"create p50 {shown['create']['host']['p50_ms']} -> {shown['create']['image']['p50_ms']} ms "
            f"({shown['create']['ratio']}x); run(true) p50 {shown['true']['host']['p50_ms']} -> "
            f"{shown['true']['image']['p50_ms']} ms ({shown['true']['ratio']}x)"
        )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
