"""`apex bench serve`: what `apex serve` sustains, in env steps/s and request latency, for 1, 8
and 64 concurrent CartPole episodes, one episode a request and batched (all episodes in one
request: ``PolicyClient.get_actions``, ``HttpPolicyClient.get_actions``), over HTTP/JSON and
ZeroMQ/msgpack.

A real learner (CartPole Ape-X, ingesting what it gets but not training, so that its updates
do not take a core from the path measured) and a real `apex serve` run as processes; the
clients are asyncio tasks in this process, each episode a real CartPole stepped here, one
request a step (the previous step's reward rides on the action request) plus an end and a
start per episode. Latency is each request's round trip as the client sees it.

Then the batched clients alone and under a flood of idle connections
(``apex.bench.serve_idle``). Then tasks learned through it beside local actors
(``apex.bench.serve_learning``): CartPole to 475 (Ape-X DQN, IMPALA), a memory task with a
recurrent IMPALA, Pendulum's continuous actions (APPO, Ape-X DDPG). ``apex.bench.serve_clients``
holds the clients; this module names their ``play_batched`` and ``time_to_475`` as before.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apex.bench.serve_clients import measure, play_batched
from apex.bench.serve_idle import idle_flood
from apex.bench.serve_learning import TASKS, learn_table, start_server, stop_processes, time_to_475
from apex.bench.timing import print_table
from apex.bench.transport import free_base_port
from apex.errors import ApexError

__all__ = ["CONCURRENCY", "GOALS", "MODES", "play_batched", "run", "time_to_475"]

CONCURRENCY = (1, 8, 64)
IDLE_CONNECTIONS = 20_000  # the flood's held connections (the README's known limit)
MODES = ("http", "http_batched", "zmq", "zmq_batched")
GOALS = {"http_requests_per_s": 2000.0, "zmq_batched_env_steps_per_s": 20000.0}


def run(
    seconds: float = 5.0, seeds: int = 3, tasks: str | None = None, idle_connections: int = IDLE_CONNECTIONS
) -> dict[str, Any]:
    """Throughput (``seconds`` per scenario); the batched clients' throughput alone and under
    a flood of ``idle_connections`` (0: none); then each of ``tasks`` (comma-separated;
    default all of ``TASKS``) learned with local actors and through the servers, ``seeds``
    runs each (0: none)."""
    if seeds < 0:
        raise ApexError(f"--seeds must be >= 0 for bench serve, got {seeds}")
    names = tuple(TASKS) if tasks is None else tuple(n.strip() for n in tasks.split(",") if n.strip())
    if not names or any(n not in TASKS for n in names):
        raise ApexError(f"--serve-tasks {tasks!r}: choose among {', '.join(TASKS)}, comma-separated")
    if idle_connections < 0:
        raise ApexError(f"--idle-connections must be >= 0, got {idle_connections}")
    rows = _throughput(seconds)
    figures = _print_throughput(rows, seconds)
    flood = _idle_flood(seconds, idle_connections) if idle_connections else []
    learning = _learning(seeds, names)
    return {
        "seconds": seconds,
        "rows": rows,
        "figures": figures,
        "goals": GOALS,
        "idle_flood": flood,
        "learning": learning,
    }


@contextlib.contextmanager
def _serving() -> Iterator[int]:
    """An ingesting learner and one `apex serve` (HTTP on the port given, ZeroMQ on the next)
    for the time of the block."""
    with tempfile.TemporaryDirectory(prefix="apex-bench-serve-") as tmp:
        port, front = free_base_port(), free_base_port()
        log = Path(tmp) / "serve.log"
        learner = _ingesting_learner(port, Path(tmp))
        # every scenario's episodes come from this one address, and those cut at a scenario's
        # end stay open until they expire: room for all of them
        server = start_server(port, front, log, "--max-episodes", "4096", "--set", "serve.max_episodes_per_client=4096")
        try:
            _wait_up(front, server, log)
            yield front
        finally:
            stop_processes([server, learner])


def _throughput(seconds: float) -> list[dict[str, Any]]:
    """Every mode and number of episodes for ``seconds`` each, through one server; a row each."""
    rows = []
    with _serving() as front:
        for mode in MODES:
            for concurrency in CONCURRENCY:
                rows.append(measure(mode, front, front + 1, concurrency, seconds))
                r = rows[-1]
                print(
                    f"  {mode} x{concurrency}: {r['env_steps_per_s']:,.0f} env steps/s, "
                    f"{r['requests_per_s']:,.0f} requests/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms",
                    flush=True,
                )
    return rows


def _idle_flood(seconds: float, count: int) -> list[dict[str, Any]]:
    with _serving() as front:
        return idle_flood(front, seconds, count)


def _ingesting_learner(port: int, tmp: Path) -> subprocess.Popen[bytes]:
    """A CartPole Ape-X learner on ``port`` that ingests and does not train."""
    never = "1000000"  # the learner ingests and does not train (apex_dqn.replay.min_size = capacity)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "learner",
            "--port",
            str(port),
            "--logdir",
            str(tmp / "run"),
            "--set",
            f"apex_dqn.replay.capacity={never}",
            "--set",
            f"apex_dqn.replay.min_size={never}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "learner.log", "w"),  # not closed here: the child writes it all its life
    )


def _wait_up(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    import http.client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ApexError(f"bench serve: apex serve exited: {log.read_text().strip().splitlines()[-1:]}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/v1/health")
            if b'"connected": true' in connection.getresponse().read():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise ApexError("bench serve: apex serve did not come up within 60 s")


def _print_throughput(rows: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """Prints the throughput table and the figures against their goals; returns the figures."""
    best = {mode: max((r for r in rows if r["mode"] == mode), key=lambda r: r["env_steps_per_s"]) for mode in MODES}
    figures = {
        "http_requests_per_s": max(r["requests_per_s"] for r in rows if r["mode"] == "http"),
        "zmq_batched_env_steps_per_s": best["zmq_batched"]["env_steps_per_s"],
    }
    print_table(
        f"serve: CartPole episodes through apex serve ({seconds:g} s each; learner ingesting, not training)",
        ["transport", "episodes", "env steps/s", "requests/s", "p50 ms", "p99 ms", "errors"],
        [
            [
                r["mode"],
                r["episodes"],
                f"{r['env_steps_per_s']:,.0f}",
                f"{r['requests_per_s']:,.0f}",
                r["p50_ms"],
                r["p99_ms"],
                r["errors"],
            ]
            for r in rows
        ],
    )
    for key, goal in GOALS.items():
        print(f"  {key}: {figures[key]:,.0f} (goal {goal:,.0f}: {'met' if figures[key] >= goal else 'missed'})")
    return figures


def _learning(seeds: int, tasks: tuple[str, ...]) -> list[dict[str, Any]]:
    """The tasks to their thresholds by every algorithm and transport, ``seeds`` runs each, and
    their table."""
    if not seeds:
        return []
    with tempfile.TemporaryDirectory(prefix="apex-bench-serve-learn-") as tmp:
        learning = learn_table(seeds, Path(tmp), tasks)
    print_table(
        f"serve: tasks to their thresholds, local actors (the preset's) against 2 servers with a client "
        f"of 32 envs each (median of {seeds}, seconds from the learner's start)",
        ["task", "algo", "transport", "reached", "median s", "x local", "env steps", "env steps/s", "runs s"],
        [
            [
                f"{r['task']} {r['threshold']:g}",
                r["algo"],
                r["transport"],
                f"{r['reached']}/{r['runs']}",
                "-" if r["median_s"] is None else r["median_s"],
                "-" if r["ratio_to_local"] is None else r["ratio_to_local"],
                f"{r['env_steps']:,}",
                f"{r['env_steps_per_s']:,}",
                ", ".join("-" if t is None else f"{t:g}" for t in r["seconds"]),
            ]
            for r in learning
        ],
    )
    return learning
