"""CartPole to 475 for `apex bench serve` (``apex.bench.serve``): the time a learner takes
with local actors (`apex run`) and with its experience coming through `apex serve`
processes, each with a client process (``apex.bench.cartpole_client``), and the table of
their medians over seeds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from apex.bench.timing import median_time
from apex.bench.transport import free_base_port
from apex.errors import ApexError

PRESETS = {"apex_dqn": "cartpole_apex", "impala": "cartpole_impala"}
LEARN_LIMIT_S = 120.0
TRANSPORTS = ("local", "zmq", "http")


def time_to_475(
    algo: str,
    transport: str,
    workdir: Path,
    limit_s: float = LEARN_LIMIT_S,
    servers: int = 2,
    envs: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Seconds from the learner's start to its stop at CartPole's 475 (None if ``limit_s``
    came first), with local actors (``transport`` "local": `apex run`, two actors of 16
    environments) or through `servers` `apex serve` processes ("zmq", "http"), each with one
    client process (``apex.bench.cartpole_client``) of ``envs`` environments."""
    logdir = workdir / f"{algo}-{transport}-{seed}"
    port = free_base_port()
    stops = [
        "--config",
        PRESETS[algo],
        "--seed",
        str(seed),
        "--stop-return",
        "475",
        "--stop-seconds",
        str(limit_s),
        "--logdir",
        str(logdir),
        "--port",
        str(port),
    ]
    started = time.time()
    if transport == "local":
        _run_local(stops, limit_s)
    else:
        _run_served(stops, port, transport, workdir, logdir.name, limit_s, servers, envs, seed)
    summary = json.loads((logdir / "summary.json").read_text())
    reached = str(summary["stop_reason"]).startswith("return_mean_100")
    stopped = summary["stopped_unix_s"]
    return {
        "algo": algo,
        "transport": transport,
        "seed": seed,
        "reached": reached,
        "seconds": round(stopped - started, 1) if reached else None,
        "startup_s": round(summary["first_update_unix_s"] - started, 1) if summary.get("first_update_unix_s") else None,
        "env_steps": summary["env_steps"],
        "env_steps_per_s": round(summary["env_steps"] / (stopped - started)),
    }


def _run_local(stops: list[str], limit_s: float) -> None:
    """`apex run` with the preset's local actors, to its stop."""
    out = subprocess.run(
        [sys.executable, "-m", "apex", "run", *stops],
        capture_output=True,
        text=True,
        timeout=limit_s + 120,
        check=False,
    )
    if out.returncode != 0:
        raise ApexError(f"bench serve: apex run failed: {out.stderr.strip().splitlines()[-1:]}")


def _run_served(
    stops: list[str],
    port: int,
    transport: str,
    workdir: Path,
    name: str,
    limit_s: float,
    servers: int,
    envs: int,
    seed: int,
) -> None:
    """`apex learner` on ``port`` with ``servers`` `apex serve` processes and their clients,
    to the learner's stop; their logs in ``workdir``, named after the run's ``name``."""
    learner = subprocess.Popen(
        [sys.executable, "-m", "apex", "learner", *stops],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / f"{name}-learner.log", "w"),  # noqa: SIM115 - the child writes it all its life
    )
    others = []
    try:
        for i in range(servers):
            front = free_base_port()
            others.append(start_server(port, front, workdir / f"{name}-serve{i}.log"))
            address = f"127.0.0.1:{front + 1 if transport == 'zmq' else front}"
            others.append(_start_client(transport, address, envs, limit_s + 60, seed * servers + i))
        learner.wait(timeout=limit_s + 120)
    finally:
        for process in others:
            process.terminate()
        for process in [learner, *others]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_server(port: int, front: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`apex serve` for the learner on ``port``: HTTP on ``front``, ZeroMQ on ``front + 1``
    (``extra``: more of its flags)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "serve",
            "--learner",
            f"127.0.0.1:{port}",
            "--http",
            f"127.0.0.1:{front}",
            "--zmq",
            str(front + 1),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),  # not closed here: the child writes it all its life
    )


def _start_client(transport: str, address: str, envs: int, seconds: float, seed: int) -> subprocess.Popen[bytes]:
    """A client process of ``envs`` CartPoles asking the server at ``address``."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex.bench.cartpole_client",
            transport,
            address,
            "--envs",
            str(envs),
            "--seconds",
            str(seconds),
            "--seed",
            str(seed),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def learn_table(seeds: int, workdir: Path) -> list[dict[str, Any]]:
    """Every algorithm and transport ``seeds`` times; a row of medians per (algorithm, transport)."""
    runs = []
    for algo in PRESETS:
        for seed in range(seeds):
            for transport in TRANSPORTS:
                runs.append(time_to_475(algo, transport, workdir, seed=seed))
                r = runs[-1]
                outcome = "not reached" if r["seconds"] is None else f"475 in {r['seconds']} s"
                print(f"  {algo} {transport} seed {seed}: {outcome} ({r['env_steps']:,} env steps)", flush=True)
    rows = []
    for algo in PRESETS:
        local = [r["seconds"] for r in runs if r["algo"] == algo and r["transport"] == "local"]
        for transport in TRANSPORTS:
            group = [r for r in runs if r["algo"] == algo and r["transport"] == transport]
            times = [r["seconds"] for r in group]
            median = median_time(times)
            local_median = median_time(local)
            rows.append(
                {
                    "algo": algo,
                    "transport": transport,
                    "reached": sum(r["reached"] for r in group),
                    "runs": len(group),
                    "median_s": median,
                    "ratio_to_local": round(median / local_median, 2) if median and local_median else None,
                    "env_steps": int(statistics.median(r["env_steps"] for r in group)),
                    "env_steps_per_s": int(statistics.median(r["env_steps_per_s"] for r in group)),
                    "seconds": times,
                }
            )
    return rows
