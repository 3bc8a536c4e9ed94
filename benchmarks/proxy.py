"""The egress proxy against no proxy at all: what the session's proxy port
costs the tools that use it.

An https upstream in its own process (the system Python's http.server with
a trustme certificate for localhost) serves a small page, a 100 MiB body,
and a PEP 503 index of 20 wheels built here. Three measurements, each the
same client run directly on the host and inside a native sandbox whose
allow-list names the upstream, through 127.0.0.1:3128 (a CONNECT tunnel:
TLS from the client to the upstream, the gateway relaying), alternating:

  latency     a new connection, TLS handshake and small GET each time
  download    100 MiB through one connection
  pip         `pip install` of the 20 wheels into an empty target

Usage: python benchmarks/proxy.py [-n GETS] [--rounds R] [--json FILE]
Needs the test extra (trustme, and the tests' wheel builder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import trustme
from measuring import percentiles, write_json

import sandboxns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from egress_upstreams import build_wheel, demo_packages, normalise, tool_env

PYTHON = "/usr/bin/python3"
BIG = 100 * 1024 * 1024
PACKAGES = 20

# Serves the directory it is started in over https; /big is BIG bytes.
UPSTREAM = """
import http.server, ssl, sys
class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path != "/big":
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", "BIG_BYTES")
        self.end_headers()
        chunk = bytes(1 << 20)
        for _ in range(BIG_MIB):
            self.wfile.write(chunk)
    def log_message(self, *args):
        pass
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain(sys.argv[1])
server = Server(("127.0.0.1", 0), Handler)
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
""".replace("BIG_BYTES", str(BIG)).replace("BIG_MIB", str(BIG >> 20))

# argv: mode (direct|proxy), port, CA file, what (latency N | download)
CLIENT = """
import json, socket, ssl, sys, time
mode, port, ca, what = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
context = ssl.create_default_context(cafile=ca)
def connect():
    if mode == "direct":
        raw = socket.create_connection(("127.0.0.1", port))
    else:
        raw = socket.create_connection(("127.0.0.1", 3128))
        raw.sendall(b"CONNECT localhost:%d HTTP/1.1\\r\\nHost: localhost:%d\\r\\n\\r\\n" % (port, port))
        answer = b""
        while not answer.endswith(b"\\r\\n\\r\\n"):
            answer += raw.recv(4096)  # nothing follows the answer until our ClientHello
        assert answer.startswith(b"HTTP/1.1 200"), answer
    return context.wrap_socket(raw, server_hostname="localhost")
def get(tls, path):
    tls.sendall(b"GET %s HTTP/1.1\\r\\nHost: localhost:%d\\r\\nConnection: close\\r\\n\\r\\n" % (path, port))
    size = 0
    while chunk := tls.recv(1 << 20):
        size += len(chunk)
    return size
if what == "latency":
    samples = []
    for _ in range(int(sys.argv[5])):
        started = time.perf_counter()
        with connect() as tls:
            get(tls, b"/small")
        samples.append(time.perf_counter() - started)
    print(json.dumps({"samples": samples}))
else:
    started = time.perf_counter()
    with connect() as tls:
        size = get(tls, b"/big")
    print(json.dumps({"seconds": time.perf_counter() - started, "bytes": size}))
"""


def make_index(root: Path) -> list[str]:
    """The PACKAGES demo wheels as a static PEP 503 index under root."""
    packages = demo_packages(PACKAGES)
    (root / "files").mkdir()
    for name, requires in packages.items():
        filename, data = build_wheel(name, requires)
        (root / "files" / filename).write_bytes(data)
        page = root / "simple" / normalise(name)
        page.mkdir(parents=True)
        (page / "index.html").write_text(f'<a href="../../files/{filename}">{filename}</a>\n')
    return list(packages)


async def measure(gets: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-proxy-") as scratch_name:
        scratch = Path(scratch_name)
        ca = trustme.CA()
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(scratch / "server.pem"))
        served = scratch / "served"
        served.mkdir()
        (served / "small").write_bytes(b"ok")
        packages = make_index(served)
        workspace = scratch / "workspace"
        workspace.mkdir()
        ca.cert_pem.write_to_path(str(workspace / "ca.pem"))
        upstream = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is timed
            [PYTHON, "-c", UPSTREAM, str(scratch / "server.pem")], cwd=served, stdout=subprocess.PIPE, text=True
        )
        try:
            port = int(upstream.stdout.readline())
            policy = {"allow": [{"origin": f"https://localhost:{port}"}]}
            async with sandboxns.open_sandbox(workspace, network=policy) as session:
                return await _rounds(session, port, scratch, workspace, packages, gets, rounds)
        finally:
            upstream.kill()
            upstream.wait()


async def _rounds(session, port: int, scratch: Path, workspace: Path, packages: list[str], gets: int, rounds: int):
    results: dict[str, list] = {"latency/direct": [], "latency/proxy": [], "download/direct": [], "download/proxy": []}
    results |= {"pip/direct": [], "pip/proxy": []}
    guest_ca, host_ca = "/workspace/ca.pem", str(workspace / "ca.pem")

    async def client(mode: str, *what: str) -> dict:
        arguments = [mode, str(port), guest_ca if mode == "proxy" else host_ca, *what]
        if mode == "direct":
            done = await trio.run_process([PYTHON, "-c", CLIENT, *arguments], capture_stdout=True)
            return json.loads(done.stdout)
        done = await session.run(PYTHON, ["-c", CLIENT, *arguments], timeout=600)
        assert done.exit_code == 0, done.stderr
        return json.loads(done.stdout)

    async def pip(mode: str) -> float:
        index = f"https://localhost:{port}/simple/"
        target = "/workspace/target" if mode == "proxy" else str(workspace / "target")
        shutil.rmtree(workspace / "target", ignore_errors=True)
        argv = [PYTHON, "-m", "pip", "install", "-q", "--no-cache-dir", "--index-url", index, "--target", target]
        argv += packages
        started = time.perf_counter()
        if mode == "direct":
            env = tool_env(scratch / "home", host_ca, os.environ["PATH"])
            await trio.run_process(argv, env=env)
        else:
            env = {**tool_env("/workspace/home", guest_ca, "/usr/bin:/bin"), "NO_PROXY": "", "no_proxy": ""}
            done = await session.run(argv[0], argv[1:], env=env, timeout=600)
            assert done.exit_code == 0, done.stderr
        return time.perf_counter() - started

    (workspace / "home").mkdir()
    (scratch / "home").mkdir()
    for round_ in range(rounds + 1):  # the first round warms up and is dropped
        for mode in ("direct", "proxy"):
            latency = await client(mode, "latency", str(gets))
            download = await client(mode, "download")
            assert download["bytes"] > BIG, download
            seconds = await pip(mode)
            if round_:
                results[f"latency/{mode}"] += latency["samples"]
                results[f"download/{mode}"].append(download["bytes"] / download["seconds"])
                results[f"pip/{mode}"].append(seconds)
    summary = {name: percentiles(results[name]) for name in ("latency/direct", "latency/proxy")}
    for mode in ("direct", "proxy"):
        summary[f"download/{mode}"] = {"MiB_per_s": round(statistics.median(results[f"download/{mode}"]) / 2**20, 1)}
        summary[f"pip/{mode}"] = {"median_s": round(statistics.median(results[f"pip/{mode}"]), 3)}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=500, help="small GETs per variant and round (default 500)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = trio.run(measure, args.n, args.rounds)
    direct, proxy = results["latency/direct"], results["latency/proxy"]
    print(
        f"small https GET, new connection each: direct p50 {direct['p50_ms']:.3f} ms, through the proxy"
        f" {proxy['p50_ms']:.3f} ms, added {proxy['p50_ms'] - direct['p50_ms']:.3f} ms"
    )
    down = [results[f"download/{mode}"]["MiB_per_s"] for mode in ("direct", "proxy")]
    print(f"100 MiB download: direct {down[0]} MiB/s, through the proxy {down[1]} MiB/s ({down[1] / down[0]:.0%})")
    pips = [results[f"pip/{mode}"]["median_s"] for mode in ("direct", "proxy")]
    print(
        f"pip install of {PACKAGES} wheels: direct {pips[0]} s, through the proxy {pips[1]} s ({pips[1] / pips[0]:.2f}x)"
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
