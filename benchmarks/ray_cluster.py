"""The Ray hop: sandboxns.ray on a local three-node cluster against one local
backend, on this one machine (whose cores the three nodes share).

  latency      p50 of run("/usr/bin/true") through a RemoteSessionHandle
               and through a local session handle, alternating (the goal:
               at most 1.5 ms added)
  throughput   commands/s with CALLERS callers in all, each taking the next
               of CALLERS sessions: through the cluster (the sessions
               spread over its nodes) and through one local backend,
               measured in alternating slices (the goal: at least 60 % of
               local)

Both through the cluster as its opener calls it (over the direct channels
to the nodes) and as any other caller does (a Ray actor call each: "ray").

Usage: python benchmarks/ray_cluster.py [-n REPS] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ray
import trio
from measuring import interleaved_rates, percentiles, write_json
from ray.cluster_utils import Cluster

import sandboxns
import sandboxns.ray

CALLERS = 8
NODES = 3


@contextlib.contextmanager
def local_cluster():
    """Three Ray nodes on this machine, each declaring the resource, Ray's
    files in a directory of their own."""
    ray_files = Path(tempfile.mkdtemp(prefix="sbxray-", dir="/tmp"))
    os.environ["RAY_TMPDIR"] = str(ray_files)
    node = {"num_cpus": 1, "resources": {sandboxns.ray.RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        with contextlib.chdir(ray_files):  # not this checkout on the workers' path
            ray.init(address=cluster.address, logging_level="ERROR")
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_files, ignore_errors=True)


async def measure(reps: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-ray-") as state:
        cluster = await sandboxns.ray.open_cluster(
            state_directory=f"{state}/{{node_id}}", max_concurrent_commands=CALLERS
        )
        async with (
            cluster,
            sandboxns.open_backend(state_directory=f"{state}/local", max_concurrent_commands=CALLERS) as local,
        ):
            remote_template = await cluster.prewarm(template="bench", files={})
            local_template = await local.prewarm(template="bench", files={})
            remote = [await cluster.create(template=remote_template.template_key) for _ in range(CALLERS)]
            # The same cluster as a caller in another trio run sees it.
            through_ray = copy.copy(cluster)
            through_ray._home_run = None
            by_ray = [await through_ray.create(template=remote_template.template_key) for _ in range(CALLERS)]
            nearby = [await local.create(template=local_template.template_key) for _ in range(CALLERS)]
            samples: dict[str, list[float]] = {"remote": [], "ray": [], "local": []}
            for rep in range(reps + 10):  # the first ten warm up
                for name, handle in (("remote", remote[0]), ("ray", by_ray[0]), ("local", nearby[0])):
                    started = time.perf_counter()
                    result = await handle.session.run("/usr/bin/true")
                    elapsed = time.perf_counter() - started
                    assert result.exit_code == 0, result
                    if rep >= 10:
                        samples[name].append(elapsed)
            latency = {name: percentiles(values) for name, values in samples.items()}
            latency["added_p50_ms"] = round(latency["remote"]["p50_ms"] - latency["local"]["p50_ms"], 3)
            latency["ray_added_p50_ms"] = round(latency["ray"]["p50_ms"] - latency["local"]["p50_ms"], 3)

            def cycling(handles):
                turn = iter(range(sys.maxsize))

                async def run() -> None:
                    result = await handles[next(turn) % len(handles)].session.run("/usr/bin/true")
                    assert result.exit_code == 0, result

                return run

            rates = await interleaved_rates(
                {"remote": cycling(remote), "ray": cycling(by_ray), "local": cycling(nearby)}, CALLERS, seconds
            )
            spread = sorted(sum(1 for handle in remote if handle.node == node) for node in cluster.nodes)
            for handle in (*remote, *by_ray, *nearby):
                await handle.delete()
    return {
        "nodes": NODES,
        "callers": CALLERS,
        "sessions_per_node": spread,
        "latency": latency,
        "commands_per_second": {name: round(rate, 1) for name, rate in rates.items()},
        "remote_over_local": round(rates["remote"] / rates["local"], 3),
        "ray_over_local": round(rates["ray"] / rates["local"], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="latency samples per variant (default 300)")
    parser.add_argument("--seconds", type=float, default=8.0, help="throughput time per variant (default 8)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    with local_cluster():
        results = trio.run(measure, args.n, args.seconds)
    latency = results["latency"]
    print(
        f"run(true) p50: through the cluster {latency['remote']['p50_ms']} ms, local {latency['local']['p50_ms']} ms"
        f" (+{latency['added_p50_ms']} ms); by Ray calls {latency['ray']['p50_ms']} ms (+{latency['ray_added_p50_ms']} ms)"
    )
    rates = results["commands_per_second"]
    print(
        f"{CALLERS} callers: {rates['remote']} commands/s through the cluster, {rates['local']} local"
        f" ({results['remote_over_local']:.0%}); by Ray calls {rates['ray']} ({results['ray_over_local']:.0%});"
        f" sessions per node {results['sessions_per_node']}"
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
