"""The clients of `apex bench serve` (``apex.bench.serve``): CartPole episodes stepped in
this process against `apex serve`, one episode a request over HTTP/JSON and ZeroMQ/msgpack
(asyncio tasks) or all of them in one request a step (``play_batched``), counting steps,
requests and each request's round trip."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeVar

import numpy as np

if TYPE_CHECKING:
    import gymnasium as gym

    from apex.client import HttpPolicyClient, PolicyClient

T = TypeVar("T")


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
    client: PolicyClient | HttpPolicyClient,
    num_envs: int,
    seconds: float,
    seed: int = 0,
    load: Load | None = None,
    env_id: str = "CartPole-v1",
    env_kwargs: dict[str, Any] | None = None,
) -> int:
    """A vectorised simulator (``num_envs`` of Gymnasium's ``env_id``: NumPy CartPole by
    default) that asks ``client`` (a PolicyClient) for all its actions in one request a step;
    returns env steps. Its environments reset on the step after an episode ends (gymnasium's
    next-step autoreset): an ended episode is reported with its final observation, and that
    environment's next observation starts a new one. ``module:id`` imports the module that
    registers the id first (as env.id does)."""
    counts = load or Load()

    def timed(call: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        out = call(*args)
        counts.timed(started)
        return out

    envs = client_envs(env_id, num_envs, env_kwargs or {})
    obs, _ = envs.reset(seed=seed)
    ids = np.asarray(timed(client.start_episodes, num_envs), dtype=object)
    spare: list[str] = []  # episodes started ahead, one request for many
    rewards = np.zeros(num_envs)
    resetting = np.zeros(num_envs, bool)  # ended last step: this step resets them
    space = envs.single_action_space
    actions = np.zeros((num_envs, *(space.shape or ())), space.dtype)
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


def play_teams(
    client: PolicyClient | HttpPolicyClient, env_id: str, num_envs: int, seconds: float, seed: int = 0
) -> int:
    """A multi-agent simulator: ``num_envs`` PettingZoo ParallelEnvs (``module:function``) whose
    agents' actions come from ``client`` in one request a step, each request carrying what the
    environments gave (observations, rewards, done flags, by agent); an environment whose
    agents are all done ends its episode and starts another. Returns agent steps."""
    import importlib

    module, _, name = env_id.partition(":")
    envs = [getattr(importlib.import_module(module), name)() for _ in range(num_envs)]
    observations = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    ids = client.start_episodes(num_envs)
    rewards: list[dict[str, Any]] = [{} for _ in envs]
    terminated: list[dict[str, Any]] = [{} for _ in envs]
    truncated: list[dict[str, Any]] = [{} for _ in envs]
    steps, deadline = 0, time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            actions = client.get_actions(ids, observations, rewards, terminated=terminated, truncated=truncated)
            over = []
            for i, env in enumerate(envs):
                steps += len(actions[i])
                observations[i], rewards[i], terminated[i], truncated[i], _ = env.step(actions[i])
                if not env.agents:
                    over.append(i)
            if over:
                client.end_episodes(
                    [ids[i] for i in over],
                    [observations[i] for i in over],
                    [terminated[i] for i in over],
                    [truncated[i] for i in over],
                    [rewards[i] for i in over],
                )
                for i, new in zip(over, client.start_episodes(len(over))):
                    ids[i], observations[i] = new, envs[i].reset()[0]
                    rewards[i], terminated[i], truncated[i] = {}, {}, {}
    finally:
        for env in envs:
            env.close()
    return steps


def client_envs(env_id: str, num_envs: int, kwargs: dict[str, Any]) -> gym.vector.VectorEnv[Any, Any, Any]:
    """``num_envs`` of ``env_id`` (``module:id``: the module imported first, to register it),
    vectorised as Gymnasium's own CartPole is, or in one process otherwise."""
    import importlib

    import gymnasium as gym

    module, _, name = env_id.rpartition(":")
    if module:
        importlib.import_module(module)
    return gym.make_vec(name, num_envs=num_envs, **kwargs)


def _batched(mode: str, port: int, concurrency: int, seconds: float, load: Load) -> None:
    # (a client process of its own: it imports what it plays with, not the benchmark's torch)
    from apex.client import HttpPolicyClient, PolicyClient

    client_type = PolicyClient if mode == "zmq_batched" else HttpPolicyClient
    with client_type(f"127.0.0.1:{port}") as client:
        play_batched(client, concurrency, seconds, load=load)


def measure(mode: str, port: int, zmq_port: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """One scenario: ``concurrency`` episodes in ``mode`` for ``seconds`` against the server's
    HTTP ``port`` and ZeroMQ ``zmq_port``; its row of the table."""
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
