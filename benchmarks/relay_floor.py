"""What any relay between a client and its upstream costs on this machine:
the floor under the egress proxy's added latency.

The same small https GET as proxy.py's latency measurement (a new
connection, a TLS handshake and a GET each time, against the same upstream,
all on the host), made directly and through three relays that forward
bytes and judge nothing:

  c            a relay in C, a blocking thread per direction (the least a
               user-space relay can do: one wakeup per flight)
  c-connect    the same, after answering the client's CONNECT itself, as
               the proxy does
  gateway      the gateway's own relay (sandboxns._tunnel.relay on trio),
               without the CONNECT and the ClientHello checks before it

Each relay's added p50 is what the proxy could at best get down to with a
relay of that kind; the proxy's own figure adds its CONNECT handling and
its checks of the TLS hellos (see RESULTS.md).

Usage: python benchmarks/relay_floor.py [-n GETS] [--rounds R]
Needs gcc and the test extra (trustme).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import trustme
from measuring import percentiles
from proxy import PYTHON, UPSTREAM

RELAY_C = r"""
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct direction { int from, to; };
static int upstream_port, answers_connect;

static void *copy(void *arg)
{
    struct direction *d = arg;
    char buffer[65536];
    ssize_t got, sent;
    while ((got = read(d->from, buffer, sizeof buffer)) > 0)
        for (ssize_t at = 0; at < got; at += sent)
            if ((sent = write(d->to, buffer + at, got - at)) <= 0)
                goto out;
out:
    shutdown(d->to, SHUT_WR);
    return NULL;
}

static void *serve(void *arg)
{
    int client = (int)(long)arg, one = 1;
    if (answers_connect) {
        char head[4096];
        size_t got = 0;
        while (got < 4 || memcmp(head + got - 4, "\r\n\r\n", 4)) {
            ssize_t n = read(client, head + got, sizeof head - got);
            if (n <= 0) { close(client); return NULL; }
            got += n;
        }
        static const char ok[] = "HTTP/1.1 200 Connection established\r\n\r\n";
        write(client, ok, sizeof ok - 1);
    }
    int upstream = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(upstream_port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    connect(upstream, (struct sockaddr *)&to, sizeof to);
    setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct direction out = {client, upstream}, back = {upstream, client};
    pthread_t thread;
    pthread_create(&thread, NULL, copy, &out);
    copy(&back);
    pthread_join(thread, NULL);
    close(client);
    close(upstream);
    return NULL;
}

int main(int argc, char **argv)
{
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in at = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t length = sizeof at;
    upstream_port = atoi(argv[1]);
    answers_connect = argc > 2;
    bind(listener, (struct sockaddr *)&at, sizeof at);
    listen(listener, 128);
    getsockname(listener, (struct sockaddr *)&at, &length);
    dprintf(1, "%d\n", ntohs(at.sin_port));
    for (;;) {
        pthread_t thread;
        pthread_create(&thread, NULL, serve, (void *)(long)accept(listener, NULL, NULL));
        pthread_detach(thread);
    }
}
"""

RELAY_TRIO = """
import sys, trio
from sandboxns._tunnel import relay
async def main(upstream_port):
    async def serve(client):
        upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
        async with client, upstream:
            await relay(client, upstream, 60)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(serve, listeners)
trio.run(main, int(sys.argv[1]))
"""

# argv: port, CA file, GETs, "connect" to send a CONNECT first
CLIENT = """
import json, socket, ssl, sys, time
port, ca, gets, connect = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4
context = ssl.create_default_context(cafile=ca)
samples = []
for _ in range(gets):
    started = time.perf_counter()
    raw = socket.create_connection(("127.0.0.1", port))
    if connect:
        raw.sendall(b"CONNECT localhost:443 HTTP/1.1\\r\\nHost: localhost:443\\r\\n\\r\\n")
        answer = b""
        while not answer.endswith(b"\\r\\n\\r\\n"):
            answer += raw.recv(4096)
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"GET /small HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n")
        while tls.recv(65536):
            pass
    samples.append(time.perf_counter() - started)
print(json.dumps(samples))
"""


def started(argv: list[str], **options) -> tuple[subprocess.Popen, int]:
    """A server process that prints its port first."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **options)
    return process, int(process.stdout.readline())


def measure(gets: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sandboxns-bench-relay-") as scratch_name:
        scratch = Path(scratch_name)
        ca = trustme.CA()
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(scratch / "server.pem"))
        ca.cert_pem.write_to_path(str(scratch / "ca.pem"))
        (scratch / "small").write_bytes(b"ok")
        (scratch / "relay.c").write_text(RELAY_C)
        subprocess.run(["gcc", "-O2", "-pthread", "-o", scratch / "relay", scratch / "relay.c"], check=True)
        processes = []
        try:
            upstream, port = started([PYTHON, "-c", UPSTREAM, str(scratch / "server.pem")], cwd=scratch)
            processes.append(upstream)
            variants = {"direct": (port, False)}
            for name, argv, connect in (
                ("c", [scratch / "relay", str(port)], False),
                ("c-connect", [scratch / "relay", str(port), "connect"], True),
                ("gateway", [sys.executable, "-c", RELAY_TRIO, str(port)], False),
            ):
                process, relay_port = started(argv, cwd=scratch)  # not a checkout's uncompiled sandboxns
                processes.append(process)
                variants[name] = (relay_port, connect)
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for round_ in range(rounds + 1):  # the first round warms up and is dropped
                for name, (target, connect) in variants.items():
                    argv = [PYTHON, "-c", CLIENT, str(target), str(scratch / "ca.pem"), str(gets)]
                    done = subprocess.run(argv + (["connect"] if connect else []), capture_output=True, check=True)
                    if round_:
                        samples[name] += json.loads(done.stdout)
        finally:
            for process in processes:
                process.kill()
                process.wait()
    return {name: percentiles(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="GETs per variant and round (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    args = parser.parse_args()
    results = measure(args.n, args.rounds)
    direct = results["direct"]["p50_ms"]
    for name, result in results.items():
        added = "" if name == "direct" else f", added {result['p50_ms'] - direct:.3f} ms"
        print(f"{name:10} p50 {result['p50_ms']:.3f} ms{added}")
    return 0


if __name__ == "__main__":
    socket.setdefaulttimeout(60)
    sys.exit(main())
