"""Egress gateway latency: what the gateway adds to a small HTTP GET.

One loopback upstream (a small threaded HTTP server in its own process)
answers every GET with 2 bytes. The same client script, with the system
Python, times GETs (connect, request, whole answer; a new connection each
time) two ways:

  direct   on the host, TCP straight to the upstream
  gateway  inside a native sandbox with an allow-list policy, through
           /run/sandboxns-network.sock and the host-side gateway

at 1, 8, 16 and 64 concurrent requests (the gateway admits 16 at a time per
backend and answers the rest 503; the client backs off 5 ms and retries).

Usage: python benchmarks/gateway.py [-n REQUESTS] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import trio
from measuring import percentiles, write_json

import sandboxns

PYTHON = "/usr/bin/python3"
# 16 is the gateway's own limit per backend; 64 callers show what the excess
# costs (refused with 503; the client backs off 5 ms and retries).
CONCURRENCY = (1, 8, 16, 64)

UPSTREAM = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # the default 5 makes 64 callers wait on SYN retries
server = Server(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

CLIENT = """
import json, socket, sys, threading, time
mode, port, total, concurrency = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
request = b"GET /small HTTP/1.1\\r\\nHost: localhost:%d\\r\\nConnection: close\\r\\n\\r\\n" % port
samples, refused = [], [0]
def worker(count):
    done = 0
    while done < count:
        started = time.perf_counter()
        if mode == "gateway":
            s = socket.socket(socket.AF_UNIX)
            s.connect("/run/sandboxns-network.sock")
        else:
            s = socket.create_connection(("127.0.0.1", port))
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        if answer.startswith(b"HTTP/1.1 503"):  # over the gateway's limit: back off, retry
            refused[0] += 1
            time.sleep(0.005)
            continue
        assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        samples.append(time.perf_counter() - started)
        done += 1
threads = [threading.Thread(target=worker, args=(total // concurrency,)) for _ in range(concurrency)]
began = time.perf_counter()
for thread in threads: thread.start()
for thread in threads: thread.join()
print(json.dumps({"samples": samples, "refused": refused[0], "seconds": time.perf_counter() - began}))
"""


async def measure(total: int) -> dict[str, dict[str, float]]:
    upstream = subprocess.Popen([PYTHON, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)  # noqa: ASYNC220
    try:
        port = int(upstream.stdout.readline())
        policy = {"allow": [{"origin": f"http://localhost:{port}", "headers": {"authorization": "Bearer bench"}}]}
        results = {}
        with tempfile.TemporaryDirectory(prefix="sandboxns-bench-") as workspace:
            async with sandboxns.open_sandbox(workspace, network=policy) as session:
                for concurrency in CONCURRENCY:
                    arguments = [str(port), str(total), str(concurrency)]
                    for round_ in range(2):  # the first round warms up and is dropped
                        direct = await trio.run_process(
                            [PYTHON, "-c", CLIENT, "direct", *arguments], capture_stdout=True
                        )
                        through = await session.run(PYTHON, ["-c", CLIENT, "gateway", *arguments], timeout=300)
                        assert through.exit_code == 0, through.stderr
                    for name, output in (("direct", direct.stdout), ("gateway", through.stdout)):
                        run = json.loads(output)
                        results[f"{name}/{concurrency}"] = {
                            **percentiles(run["samples"]),
                            "per_s": round(len(run["samples"]) / run["seconds"], 1),
                            "refused": run["refused"],
                        }
        return results
    finally:
        upstream.kill()
        upstream.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2000, help="GETs per variant and concurrency (default 2000)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = trio.run(measure, args.n)
    print(
        f"{'concurrent':>10} {'direct p50':>11} {'gateway p50':>12} {'added p50':>10} {'direct/s':>9} {'gateway/s':>10} {'503s':>6}"
    )
    for concurrency in CONCURRENCY:
        direct, through = results[f"direct/{concurrency}"], results[f"gateway/{concurrency}"]
        print(
            f"{concurrency:>10} {direct['p50_ms']:>9.3f}ms {through['p50_ms']:>10.3f}ms"
            f" {through['p50_ms'] - direct['p50_ms']:>8.3f}ms {direct['per_s']:>9.0f} {through['per_s']:>10.0f}"
            f" {through['refused']:>6}"
        )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
