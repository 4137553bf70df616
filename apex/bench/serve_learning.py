"""Tasks learned through `apex serve` for `apex bench serve` (``apex.bench.serve``) and the
serve tests: the time a learner takes to a task's threshold with local actors (`apex run`) and
with its experience coming through `apex serve` processes, each with a client process
(``apex.bench.cartpole_client``: a vectorised Gymnasium simulator), and the table of their
medians over seeds. CartPole for both Ape-X DQN and IMPALA; a recurrent IMPALA on a memory
task (Recall, kept in tests/envs.py: from a clone); continuous actions (Pendulum) for APPO and
Ape-X DDPG; two agents with a policy each (Meet, kept in tests/multiagent_envs.py)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apex.bench.timing import median_time
from apex.bench.transport import free_base_port
from apex.errors import ApexError


@dataclass(frozen=True)
class ServeTask:
    env_id: str  # what the clients step (module:id imports the module that registers it)
    threshold: float  # the learner's --stop-return
    presets: dict[str, str]  # by algorithm: the learner's --config
    env_kwargs: dict[str, Any] | None = None  # the clients' (the preset's env.kwargs)
    limit_s: float = 120.0
    allow_imports: tuple[str, ...] = ()  # the servers' --allow-import: the env.id's module
    multi_agent: bool = False  # env_id is a PettingZoo env (module:function): its presets are "" (--env, --set)
    learner_sets: tuple[str, ...] = ()  # the learner's --set, where it has no preset


TASKS = {
    "cartpole": ServeTask("CartPole-v1", 475.0, {"apex_dqn": "cartpole_apex", "impala": "cartpole_impala"}),
    "recall": ServeTask(
        "tests.envs:apex-test/Recall-v0", 0.9, {"impala": "recall_impala"}, {"delay": 10}, allow_imports=("tests.envs",)
    ),
    "pendulum": ServeTask(
        "Pendulum-v1", -250.0, {"appo": "pendulum_appo", "apex_ddpg": "pendulum_apex_ddpg"}, limit_s=300.0
    ),
    # two agents that must meet on a ring, a policy each (from a clone: tests/multiagent_envs.py)
    "meet": ServeTask(
        "tests.multiagent_envs:meet",
        0.75,
        {"apex_dqn": "", "impala": ""},
        allow_imports=("tests.multiagent_envs",),
        multi_agent=True,
        learner_sets=("multi_agent.mapping=per_agent",),
    ),
}
PRESETS = TASKS["cartpole"].presets
LEARN_LIMIT_S = TASKS["cartpole"].limit_s
# "both": the servers' clients take turns, ZeroMQ then HTTP (one run for both transports)
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
    """CartPole to 475: ``time_to_threshold`` of the cartpole task."""
    return time_to_threshold("cartpole", algo, transport, workdir, limit_s, servers, envs, seed)


def time_to_threshold(
    task: str,
    algo: str,
    transport: str,
    workdir: Path,
    limit_s: float | None = None,
    servers: int = 2,
    envs: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Seconds from the learner's start to its stop at the task's threshold (None if
    ``limit_s``, by default the task's, came first), with local actors (``transport``
    "local": `apex run`, the preset's actors) or through ``servers`` `apex serve` processes
    ("zmq", "http", "both": the servers' clients alternate, or "node": CartPole's JavaScript
    client over HTTP), each with one client process of ``envs`` environments."""
    spec = TASKS[task]
    limit_s = spec.limit_s if limit_s is None else limit_s
    logdir = workdir / f"{task}-{algo}-{transport}-{seed}"
    port = free_base_port()
    preset = spec.presets[algo]
    sets = [flag for setting in spec.learner_sets for flag in ("--set", setting)]
    stops = [
        *(["--config", preset] if preset else ["--algo", algo, "--env", spec.env_id, *sets]),
        "--seed",
        str(seed),
        "--stop-return",
        str(spec.threshold),
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
        _run_served(stops, port, transport, workdir, logdir.name, limit_s, servers, envs, seed, spec)
    summary = json.loads((logdir / "summary.json").read_text())
    reached = str(summary["stop_reason"]).startswith("return_mean_100")
    stopped = summary["stopped_unix_s"]
    return {
        "task": task,
        "algo": algo,
        "transport": transport,
        "seed": seed,
        "reached": reached,
        "seconds": round(stopped - started, 1) if reached else None,
        "startup_s": round(summary["first_update_unix_s"] - started, 1) if summary.get("first_update_unix_s") else None,
        "env_steps": summary["env_steps"],
        "env_steps_per_s": round(summary["env_steps"] / (stopped - started)),
        "best_return": summary.get("best_return_mean_100"),
        **(
            {"policy_updates": {name: p["learner_updates"] for name, p in summary["policies"].items()}}
            if "policies" in summary
            else {}
        ),
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
    task: ServeTask,
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
            imports = [flag for module in task.allow_imports for flag in ("--allow-import", module)]
            others.append(start_server(port, front, workdir / f"{name}-serve{i}.log", *imports))
            mode = ("zmq", "http")[i % 2] if transport == "both" else transport
            address = f"127.0.0.1:{front + 1 if mode == 'zmq' else front}"
            log = workdir / f"{name}-client{i}.log"
            others.append(_start_client(mode, address, envs, limit_s + 60, seed * servers + i, task, log))
        learner.wait(timeout=limit_s + 120)
    finally:
        stop_processes([learner, *others])


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each, then each waited for (30 s, then killed)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
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


# the JavaScript client of CartPole (from a clone: deploy/ is not in the wheel)
NODE_CLIENT = Path(__file__).resolve().parents[2] / "deploy" / "clients" / "cartpole.mjs"


def _start_client(
    transport: str, address: str, envs: int, seconds: float, seed: int, task: ServeTask, log: Path
) -> subprocess.Popen[bytes]:
    """A client process of ``envs`` of the task's environments asking the server at
    ``address``: ``apex.bench.cartpole_client`` over ``transport`` (zmq, http), or for "node"
    deploy/clients/cartpole.mjs run by Node over HTTP."""
    if transport == "node":
        node = shutil.which("node")
        if node is None or not NODE_CLIENT.exists() or task.env_id != "CartPole-v1":
            raise ApexError(
                "the node client needs Node 18+ on PATH, a clone's deploy/clients/cartpole.mjs and the cartpole task"
            )
        program = [node, str(NODE_CLIENT), f"http://{address}"]
    else:
        program = [sys.executable, "-m", "apex.bench.cartpole_client", transport, address]
        program += ["--env", task.env_id, "--env-kwargs", json.dumps(task.env_kwargs or {})]
        program += ["--multi-agent"] if task.multi_agent else []
    return subprocess.Popen(
        [*program, "--envs", str(envs), "--seconds", str(seconds), "--seed", str(seed)],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),  # not closed here: the child writes it all its life
    )


def learn_table(seeds: int, workdir: Path, tasks: tuple[str, ...] = tuple(TASKS)) -> list[dict[str, Any]]:
    """Every task's algorithms and transports ``seeds`` times; a row of medians per (task,
    algorithm, transport)."""
    runs = []
    for task in tasks:
        for algo in TASKS[task].presets:
            for seed in range(seeds):
                for transport in TRANSPORTS:
                    runs.append(time_to_threshold(task, algo, transport, workdir, seed=seed))
                    r = runs[-1]
                    outcome = "not reached" if r["seconds"] is None else f"reached in {r['seconds']} s"
                    print(
                        f"  {task} {algo} {transport} seed {seed}: {outcome} ({r['env_steps']:,} env steps)", flush=True
                    )
    rows = []
    for task in tasks:
        for algo in TASKS[task].presets:
            mine = [r for r in runs if r["task"] == task and r["algo"] == algo]
            local_median = median_time([r["seconds"] for r in mine if r["transport"] == "local"])
            for transport in TRANSPORTS:
                group = [r for r in mine if r["transport"] == transport]
                times = [r["seconds"] for r in group]
                median = median_time(times)
                rows.append(
                    {
                        "task": task,
                        "threshold": TASKS[task].threshold,
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
