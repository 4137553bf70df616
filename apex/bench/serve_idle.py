"""`apex bench serve`'s idle-connection flood: the batched clients' throughput alone, then
while COUNT TCP connections are held open to the frontend they use without a byte sent (the
README's known limit, 20,000 of them), and the share kept.

The connections are held by flooder processes (this module run as a script), each at most
PER_FLOODER of them (a process's open files are bounded) and each opening a new connection for
every one the server closes (past serve.max_connections, or idle past serve.idle_timeout_s),
all of them together at most RATE a second, until SIGTERM:

    python -m apex.bench.serve_idle PORT COUNT [--rate R]

Every second a flooder writes to stdout a JSON line of the connections it holds, the connects
it tried and the closes it saw so far.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apex.bench.serve_clients import measure
from apex.bench.serve_learning import stop_processes
from apex.bench.timing import print_table

__all__ = ["FLOOD_EPISODES", "PER_FLOODER", "RATE", "idle_flood"]

FLOOD_EPISODES = 64  # the honest batched client's
PER_FLOODER = 9_000  # connections one flooder holds (with room in a 10,000-file limit)
RATE = 2_000.0  # new connections a second, all flooders together
RAMP_S = 30.0  # for the flooders to open their connections


def idle_flood(front: int, seconds: float, count: int) -> list[dict[str, Any]]:
    """``FLOOD_EPISODES`` batched episodes for ``seconds`` through the HTTP frontend on
    ``front`` and the ZeroMQ one on ``front + 1``, each alone and then while ``count`` idle
    connections are held to it; a row a frontend, and their table."""
    rows = []
    for mode, target in (("http_batched", front), ("zmq_batched", front + 1)):
        quiet = measure(mode, front, front + 1, FLOOD_EPISODES, seconds)
        with _flooding(target, count) as counts:
            held = _wait_held(counts, count)
            flooded = measure(mode, front, front + 1, FLOOD_EPISODES, seconds)
            after = counts()
        rows.append(
            {
                "mode": mode,
                "idle_connections": count,
                "held_before": held,
                "held_after": after["open"],
                "connects": after["connects"],
                "closed_by_server": after["closed"],
                "quiet_env_steps_per_s": quiet["env_steps_per_s"],
                "flooded_env_steps_per_s": flooded["env_steps_per_s"],
                "kept": round(flooded["env_steps_per_s"] / max(quiet["env_steps_per_s"], 1e-9), 2),
                "flooded_p99_ms": flooded["p99_ms"],
                "errors": flooded["errors"],
            }
        )
        print(f"  {mode} under {held:,} idle connections: kept {rows[-1]['kept']:.0%} of its throughput", flush=True)
    print_table(
        f"serve: {FLOOD_EPISODES} batched episodes alone and while up to {count:,} idle connections are held to the "
        f"same frontend ({seconds:g} s each; what the server closes is opened again, {RATE:,.0f}/s at most)",
        ["transport", "env steps/s alone", "flooded", "kept", "p99 ms flooded", "held", "connects", "closed"],
        [
            [
                r["mode"],
                f"{r['quiet_env_steps_per_s']:,.0f}",
                f"{r['flooded_env_steps_per_s']:,.0f}",
                f"{r['kept']:.0%}",
                r["flooded_p99_ms"],
                f"{r['held_before']:,} -> {r['held_after']:,}",
                f"{r['connects']:,}",
                f"{r['closed_by_server']:,}",
            ]
            for r in rows
        ],
    )
    return rows


@contextlib.contextmanager
def _flooding(port: int, count: int) -> Iterator[Any]:
    """Flooders holding ``count`` connections to ``port`` for the time of the block, which gets
    a function summing their last reports."""
    shares = [count // math.ceil(count / PER_FLOODER)] * math.ceil(count / PER_FLOODER)
    shares[-1] += count - sum(shares)
    rate = RATE / len(shares)
    with tempfile.TemporaryDirectory(prefix="apex-bench-serve-idle-") as tmp:
        logs = [Path(tmp) / f"flooder-{i}.jsonl" for i in range(len(shares))]
        flooders = []
        try:
            for log, share in zip(logs, shares, strict=True):
                command = [sys.executable, "-m", "apex.bench.serve_idle", str(port), str(share), "--rate", str(rate)]
                with open(log, "w") as out:  # the child holds its own copy
                    flooders.append(subprocess.Popen(["nice", "-n", "10", *command], stdout=out))
            yield lambda: _sum_counts(logs)
        finally:
            stop_processes(flooders)


def _sum_counts(logs: list[Path]) -> dict[str, int]:
    total = {"open": 0, "connects": 0, "closed": 0}
    for log in logs:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        for line in reversed(lines[-2:]):  # the last whole one
            try:
                last = json.loads(line)
            except ValueError:
                continue
            for key in total:
                total[key] += int(last.get(key, 0))
            break
    return total


def _wait_held(counts: Any, count: int) -> int:
    """Waits until the flooders hold ``count`` connections, or RAMP_S passed, or they stopped
    gaining (the server closes them as fast as they open); returns how many they hold."""
    deadline = time.monotonic() + RAMP_S
    held, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = counts()["open"]
        if now >= count:
            return int(now)
        if now > held:
            held, since = now, time.monotonic()
        elif time.monotonic() - since > 5:
            break
    return max(held, 0)


# -- the flooder process


def _raise_file_limit(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(count + 256, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _connect(port: int) -> socket.socket | None:
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError:  # out of files: try again once the server has closed some
        return None
    sock.setblocking(False)
    code = sock.connect_ex(("127.0.0.1", port))
    if code not in (0, errno.EINPROGRESS):
        sock.close()
        return None
    return sock


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--rate", type=float, default=RATE, help="new connections a second at most")
    args = parser.parse_args()
    _raise_file_limit(args.count)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    selector = selectors.DefaultSelector()
    held: set[socket.socket] = set()
    tried = closed = 0
    budget, last = 0.0, time.monotonic()
    next_report = last + 1.0
    while not stopping:
        now = time.monotonic()
        budget = min(args.rate, budget + (now - last) * args.rate)  # connects allowed now
        last = now
        while len(held) < args.count and budget >= 1:
            budget -= 1
            tried += 1
            sock = _connect(args.port)
            if sock is None:
                break  # out of ports or files: try again later
            selector.register(sock, selectors.EVENT_READ, sock)
            held.add(sock)
        for key, _ in selector.select(timeout=0.05):
            sock = key.data
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:  # the server closed it (or refused it): open another
                selector.unregister(sock)
                held.discard(sock)
                sock.close()
                closed += 1
        if now >= next_report:
            print(json.dumps({"open": len(held), "connects": tried, "closed": closed}), flush=True)
            next_report = now + 1.0
    for sock in held:
        sock.close()


if __name__ == "__main__":
    main()
