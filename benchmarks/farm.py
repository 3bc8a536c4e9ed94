"""Farm-scale numbers for the native driver: what many sessions and many
commands cost.

  create      backend.create() p50, cold for 10 / 1,000 / 10,000-file
              templates and handed out from a warm pool
  throughput  commands/s with 8 concurrent callers: session.run("true")
              against bare trio.run_process(["true"])
  admission   commands/s through the backend's limit of 8 with 8 callers,
              and with 64 callers backing off when refused
  idle        memory per idle session: sandbox side (PSS of its processes)
              and host side (this process's RSS growth); all open at once
  churn       sessions created and deleted back to back: latency per batch
              (does it degrade?) and what is left afterwards

Usage: python benchmarks/farm.py [--sessions N] [--churn N] [--seconds S] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio
from create_latency import template_files
from measuring import interleaved_rates, write_json

import sandboxns

TRUE = "/usr/bin/true"
# How long a refused caller waits before trying again (a polite client).
BACKOFF = 0.005


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        found += children
        pending += children
    return found


def p50_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


async def measure_create(backend, reps: int) -> dict:
    results = {}
    for count in (10, 1000, 10000):
        key = (await backend.prewarm(template=f"t{count}", files=template_files(count))).template_key
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            handle = await backend.create(template=key)
            samples.append(time.perf_counter() - started)
            await handle.delete()
        results[f"cold/{count}"] = p50_ms(samples)
    key = (await backend.prewarm(template="t1000", files=template_files(1000))).template_key
    await backend.pool(template=key, size=4)
    samples = []
    for _ in range(reps):
        await backend.pool(template=key, size=4)  # wait for the refill, untimed
        started = time.perf_counter()
        handle = await backend.create(template=key)
        samples.append(time.perf_counter() - started)
        await handle.delete()
    await backend.pool(template=key, size=0)
    results["pool/1000"] = p50_ms(samples)
    return results


async def measure_throughput(backend, seconds: float, concurrency: int = 8) -> dict:
    key = (await backend.prewarm(template="empty", files={})).template_key
    handle = await backend.create(template=key)

    async def native() -> None:
        await handle.session.run(TRUE)

    async def bare() -> None:
        await trio.run_process([TRUE])

    rates = await interleaved_rates({"bare": bare, "native": native}, concurrency, seconds)
    await handle.delete()
    return {**{k: round(v, 1) for k, v in rates.items()}, "native/bare": round(rates["native"] / rates["bare"], 3)}


async def measure_admission(backend, seconds: float) -> dict:
    """Commands/s through a backend's admission limit (8) with 8 callers,
    and with 64 callers that back off a little when refused: the limit must not
    cost throughput, only turn the excess away."""
    key = (await backend.prewarm(template="empty", files={})).template_key
    handles = [await backend.create(template=key) for _ in range(8)]
    results = {}
    for callers in (8, 64):
        done = refused = 0
        deadline = trio.current_time() + seconds

        async def caller(session, deadline=deadline) -> None:
            nonlocal done, refused
            while trio.current_time() < deadline:
                try:
                    await session.run(TRUE)
                    done += 1
                except sandboxns.SandboxError:
                    refused += 1
                    await trio.sleep(BACKOFF)

        async with trio.open_nursery() as nursery:
            for i in range(callers):
                nursery.start_soon(caller, handles[i % len(handles)].session)
        results[f"{callers}_callers_per_s"] = round(done / seconds, 1)
        results[f"{callers}_callers_refused_per_s"] = round(refused / seconds, 1)
    for handle in handles:
        await handle.delete()
    return results


async def measure_idle(backend, sessions: int) -> dict:
    key = (await backend.prewarm(template="idle", files=template_files(10))).template_key
    before_pids = set(descendants(os.getpid()))
    before_rss = rss_kib()
    handles = []
    for _ in range(sessions):
        handles.append(await backend.create(template=key))
    pids = set(descendants(os.getpid())) - before_pids
    sandbox_kib = sum(pss_kib(pid) for pid in pids)
    host_kib = rss_kib() - before_rss
    # All of them still work.
    results = [await handle.session.run(TRUE) for handle in handles[:: max(1, sessions // 20)]]
    assert all(r.exit_code == 0 for r in results)
    for handle in handles:
        await handle.delete()
    return {
        "sessions": sessions,
        "processes_per_session": round(len(pids) / sessions, 2),
        "sandbox_kib_per_session": round(sandbox_kib / sessions, 1),
        "host_kib_per_session": round(host_kib / sessions, 1),
    }


async def measure_churn(backend, total: int) -> dict:
    key = (await backend.prewarm(template="churn", files=template_files(10))).template_key
    fds_before = len(os.listdir("/proc/self/fd"))
    mounts_before = Path("/proc/self/mountinfo").read_text().count("\n")
    batches = []
    batch = max(1, total // 10)
    for _ in range(total // batch):
        samples = []
        for _ in range(batch):
            started = time.perf_counter()
            handle = await backend.create(template=key)
            await handle.delete()
            samples.append(time.perf_counter() - started)
        batches.append(p50_ms(samples))
    return {
        "sessions": total,
        "p50_ms_per_batch": batches,
        "leaked_fds": len(os.listdir("/proc/self/fd")) - fds_before,
        "leaked_mounts": Path("/proc/self/mountinfo").read_text().count("\n") - mounts_before,
        "leftover_processes": len(descendants(os.getpid())),
        "leftover_sessions": len(os.listdir(backend.state_directory / "sessions")),
    }


async def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="sandboxns-farm-") as state:
        async with sandboxns.open_backend(state_directory=state) as backend:
            idle = await measure_idle(backend, args.sessions)  # first: the host's RSS is least noisy now
            return {
                "create_p50_ms": await measure_create(backend, args.reps),
                "throughput_per_s": await measure_throughput(backend, args.seconds),
                "admission": await measure_admission(backend, args.seconds),
                "idle": idle,
                "churn": await measure_churn(backend, args.churn),
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30, help="creates per variant (default 30)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput variant (default 3)")
    parser.add_argument("--sessions", type=int, default=500, help="idle sessions open at once (default 500)")
    parser.add_argument("--churn", type=int, default=1000, help="sessions created and deleted (default 1000)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    # Each session holds a few fds (control socket, pidfd, workspace, lease).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    results = trio.run(measure, args)
    print(json.dumps(results, indent=2))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
