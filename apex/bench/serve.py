"""`apex bench serve`: what `apex serve` sustains, in env steps/s and request latency, for 1, 8
and 64 concurrent CartPole episodes, one episode a request and batched (all episodes in one
request: ``PolicyClient.get_actions``, ``HttpPolicyClient.get_actions``), over HTTP/JSON and
ZeroMQ/msgpack.

A real learner (CartPole Ape-X, ingesting what it gets but not training, so that its updates
do not take a core from the path measured) and a real `apex serve` run as processes; the
clients are asyncio tasks in this process, each episode a real CartPole stepped here, one
request a step (the previous step's reward rides on the action request) plus an end and a
start per episode. Latency is each request's round trip as the client sees it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeVar

import numpy as np

from apex.bench.timing import median_time, print_table
from apex.bench.transport import free_base_port
from apex.errors import ApexError

if TYPE_CHECKING:
    import gymnasium as gym

    from apex.client import HttpPolicyClient, PolicyClient

T = TypeVar("T")

CONCURRENCY = (1, 8, 64)
MODES = ("http", "http_batched", "zmq", "zmq_batched")
GOALS = {"http_requests_per_s": 2000.0, "zmq_batched_env_steps_per_s": 20000.0}


def _env() -> gym.Env[Any, Any]:
    import gymnasium as gym

    return gym.make("CartPole-v1", disable_env_checker=True)


class Load:
    """Counts and latencies of one scenario."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.steps = 0
        self.requests = 0
        self.errors = 0

    def timed(self, started: float) -> None:
        self.latencies.append(time.perf_counter() - started)
        self.requests += 1


async def _http_episodes(port: int, concurrency: int, seconds: float, load: Load) -> None:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/episodes"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            started = time.perf_counter()
            async with session.post(url + path, json=body) as response:
                data: dict[str, Any] = await response.json()
            load.timed(started)
            if response.status != 200:
                load.errors += 1
            return data

        async def one(seed: int, deadline: float) -> None:
            env = _env()
            while time.perf_counter() < deadline:
                episode = (await post("", {}))["episode_id"]
                obs, _ = env.reset(seed=seed)
                reward = None
                while time.perf_counter() < deadline:
                    body = {"observation": obs.tolist(), **({} if reward is None else {"reward": reward})}
                    action = (await post(f"/{episode}/action", body))["action"]
                    obs, reward, terminated, truncated, _ = env.step(action)
                    load.steps += 1
                    if terminated or truncated:
                        await post(
                            f"/{episode}/end",
                            {
                                "observation": obs.tolist(),
                                "terminated": terminated,
                                "truncated": truncated,
                                "reward": reward,
                            },
                        )
                        break

        deadline = time.perf_counter() + seconds
        await asyncio.gather(*(one(i, deadline) for i in range(concurrency)))


async def _zmq_episodes(port: int, concurrency: int, seconds: float, load: Load) -> None:
    """Each episode its own DEALER socket and one request a step, as many small clients would."""
    import msgpack
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()

    async def one(seed: int, deadline: float) -> None:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")

        async def request(**fields: Any) -> dict[str, Any]:
            started = time.perf_counter()
            await sock.send(msgpack.packb(fields))
            reply: dict[str, Any] = msgpack.unpackb(await sock.recv(), raw=False)
            load.timed(started)
            if not reply["ok"]:
                load.errors += 1
            return reply

        env = _env()
        try:
            while time.perf_counter() < deadline:
                (episode,) = (await request(op="start", count=1))["episode_ids"]
                obs, _ = env.reset(seed=seed)
                reward: SupportsFloat = 0.0
                while time.perf_counter() < deadline:
                    reply = await request(
                        op="act", episode_ids=[episode], observations=[obs.tolist()], rewards=[reward]
                    )
                    obs, reward, terminated, truncated, _ = env.step(reply["actions"][0])
                    load.steps += 1
                    if terminated or truncated:
                        await request(
                            op="end",
                            episode_ids=[episode],
                            observations=[obs.tolist()],
                            terminated=terminated,
                            truncated=truncated,
                            rewards=[reward],
                        )
                        break
        finally:
            sock.close()

    deadline = time.perf_counter() + seconds
    await asyncio.gather(*(one(i, deadline) for i in range(concurrency)))


def play_batched(
    client: PolicyClient | HttpPolicyClient, num_envs: int, seconds: float, seed: int = 0, load: Load | None = None
) -> int:
    """A vectorised simulator (gymnasium's NumPy CartPole, ``num_envs`` of them) that asks
    ``client`` (a PolicyClient) for all its actions in one request a step; returns env steps.
    Its environments reset on the step after an episode ends (gymnasium's next-step
    autoreset): an ended episode is reported with its final observation, and that
    environment's next observation starts a new one."""
    import gymnasium as gym

    counts = load or Load()

    def timed(call: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        out = call(*args)
        counts.timed(started)
        return out

    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="vector_entry_point")
    obs, _ = envs.reset(seed=seed)
    ids = np.asarray(timed(client.start_episodes, num_envs), dtype=object)
    spare: list[str] = []  # episodes started ahead, one request for many
    rewards = np.zeros(num_envs)
    resetting = np.zeros(num_envs, bool)  # ended last step: this step resets them
    actions = np.zeros(num_envs, np.int64)
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            playing = ~resetting
            if playing.any():  # (with one environment, none plays on the step that resets it)
                actions[playing] = timed(client.get_actions, list(ids[playing]), obs[playing], rewards[playing])
            obs, rewards, terminated, truncated, _ = envs.step(actions)
            counts.steps += int(playing.sum())
            if resetting.any():  # their observations start new episodes, from ids started ahead
                needed = int(resetting.sum())
                if len(spare) < needed:
                    spare += timed(client.start_episodes, max(needed, num_envs))
                ids[resetting], spare = spare[:needed], spare[needed:]
                rewards[resetting] = 0.0
            ended = playing & (terminated | truncated)
            if ended.any():  # without waiting: ZeroMQ pipelines it, HTTP sends it inside the next get_actions
                client.end_episodes(
                    list(ids[ended]), obs[ended], terminated[ended], truncated[ended], rewards[ended], wait=False
                )
            resetting = ended
    finally:
        envs.close()
    return counts.steps


def _batched(mode: str, port: int, concurrency: int, seconds: float, load: Load) -> None:
    from apex.client import HttpPolicyClient, PolicyClient

    client_type = PolicyClient if mode == "zmq_batched" else HttpPolicyClient
    with client_type(f"127.0.0.1:{port}") as client:
        play_batched(client, concurrency, seconds, load=load)


def _measure(mode: str, port: int, zmq_port: int, concurrency: int, seconds: float) -> dict[str, Any]:
    load = Load()
    started = time.perf_counter()
    if mode == "http":
        asyncio.run(_http_episodes(port, concurrency, seconds, load))
    elif mode == "zmq":
        asyncio.run(_zmq_episodes(zmq_port, concurrency, seconds, load))
    else:
        _batched(mode, zmq_port if mode == "zmq_batched" else port, concurrency, seconds, load)
    elapsed = time.perf_counter() - started
    latencies = np.asarray(load.latencies) * 1e3
    return {
        "mode": mode,
        "episodes": concurrency,
        "env_steps_per_s": round(load.steps / elapsed, 1),
        "requests_per_s": round(load.requests / elapsed, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)), 3),
        "p99_ms": round(float(np.percentile(latencies, 99)), 3),
        "errors": load.errors,
    }


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


PRESETS = {"apex_dqn": "cartpole_apex", "impala": "cartpole_impala"}
LEARN_LIMIT_S = 120.0


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
        out = subprocess.run(
            [sys.executable, "-m", "apex", "run", *stops],
            capture_output=True,
            text=True,
            timeout=limit_s + 120,
            check=False,
        )
        if out.returncode != 0:
            raise ApexError(f"bench serve: apex run failed: {out.stderr.strip().splitlines()[-1:]}")
    else:
        learner = subprocess.Popen(
            [sys.executable, "-m", "apex", "learner", *stops],
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / f"{logdir.name}-learner.log", "w"),  # noqa: SIM115 - the child writes it all its life
        )
        others = []
        try:
            for i in range(servers):
                front = free_base_port()
                others.append(
                    subprocess.Popen(
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
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=open(workdir / f"{logdir.name}-serve{i}.log", "w"),  # noqa: SIM115 - the child writes it all its life
                    )
                )
                address = f"127.0.0.1:{front + 1 if transport == 'zmq' else front}"
                others.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "apex.bench.cartpole_client",
                            transport,
                            address,
                            "--envs",
                            str(envs),
                            "--seconds",
                            str(limit_s + 60),
                            "--seed",
                            str(seed * servers + i),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
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


def _learn_table(seeds: int, workdir: Path) -> list[dict[str, Any]]:
    runs = []
    for algo in PRESETS:
        for seed in range(seeds):
            for transport in ("local", "zmq", "http"):
                runs.append(time_to_475(algo, transport, workdir, seed=seed))
                r = runs[-1]
                outcome = "not reached" if r["seconds"] is None else f"475 in {r['seconds']} s"
                print(f"  {algo} {transport} seed {seed}: {outcome} ({r['env_steps']:,} env steps)", flush=True)
    rows = []
    for algo in PRESETS:
        local = [r["seconds"] for r in runs if r["algo"] == algo and r["transport"] == "local"]
        for transport in ("local", "zmq", "http"):
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


def run(seconds: float = 5.0, seeds: int = 3) -> dict[str, Any]:
    """Throughput (``seconds`` per scenario), then CartPole to 475 with local actors and
    through the servers, ``seeds`` runs each (0: throughput only)."""
    if seeds < 0:
        raise ApexError(f"--seeds must be >= 0 for bench serve, got {seeds}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="apex-bench-serve-") as tmp:
        port, front = free_base_port(), free_base_port()
        log = Path(tmp) / "serve.log"
        never = "1000000"  # the learner ingests and does not train (apex_dqn.replay.min_size = capacity)
        learner = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "apex",
                "learner",
                "--port",
                str(port),
                "--logdir",
                str(Path(tmp) / "run"),
                "--set",
                f"apex_dqn.replay.capacity={never}",
                "--set",
                f"apex_dqn.replay.min_size={never}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(Path(tmp) / "learner.log", "w"),  # noqa: SIM115 - the child writes it all its life
        )
        server = subprocess.Popen(
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
                "--max-episodes",
                "4096",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),  # noqa: SIM115 - the child writes it all its life
        )
        try:
            _wait_up(front, server, log)
            for mode in MODES:
                for concurrency in CONCURRENCY:
                    rows.append(_measure(mode, front, front + 1, concurrency, seconds))
                    r = rows[-1]
                    print(
                        f"  {mode} x{concurrency}: {r['env_steps_per_s']:,.0f} env steps/s, "
                        f"{r['requests_per_s']:,.0f} requests/s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms",
                        flush=True,
                    )
        finally:
            for process in (server, learner):
                process.terminate()
            for process in (server, learner):
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
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
    learning = []
    if seeds:
        with tempfile.TemporaryDirectory(prefix="apex-bench-serve-learn-") as tmp:
            learning = _learn_table(seeds, Path(tmp))
        print_table(
            f"serve: CartPole to 475, local actors (2 x 16 envs) against 2 servers with a client of 32 envs each "
            f"(median of {seeds}, seconds from the learner's start)",
            ["algo", "transport", "reached", "median s", "x local", "env steps", "env steps/s", "runs s"],
            [
                [
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
    return {"seconds": seconds, "rows": rows, "figures": figures, "goals": GOALS, "learning": learning}
