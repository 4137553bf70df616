"""A simulator that steps its own CartPoles and asks `apex serve` for actions over ZeroMQ,
many episodes per request (apex.client.PolicyClient's batched forms): what the serve tests
and `apex bench serve` run as separate processes, and an example to start from.

    python -m tests.clients.cartpole_zmq tcp://127.0.0.1:8001 --envs 64 --seconds 60
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

from apex.client import PolicyClient, PolicyServerError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token")
    args = parser.parse_args()
    envs = [gym.make("CartPole-v1") for _ in range(args.envs)]
    with PolicyClient(args.address, token=args.token) as client:
        ids = client.start_episodes(args.envs)
        obs = np.stack([env.reset(seed=args.seed * 1000 + i)[0] for i, env in enumerate(envs)])
        rewards = np.zeros(args.envs)
        deadline = time.monotonic() + args.seconds
        steps = 0
        while time.monotonic() < deadline:
            try:
                actions = client.get_actions(ids, obs, rewards)
            except PolicyServerError as e:
                if e.status == 503:
                    continue
                raise
            ended, final, terminated, truncated = [], [], [], []
            for i, env in enumerate(envs):
                o, r, term, trunc, _ = env.step(int(actions[i]))
                rewards[i] = r
                if term or trunc:
                    ended.append(i)
                    final.append(o)
                    terminated.append(term)
                    truncated.append(trunc)
                    o, _ = env.reset()
                obs[i] = o
            steps += args.envs
            if ended:
                client.end_episodes([ids[i] for i in ended], np.stack(final), terminated, truncated, rewards[ended])
                for i, new in zip(ended, client.start_episodes(len(ended))):
                    ids[i] = new
                rewards[ended] = 0.0
    print(f"steps {steps}", flush=True)


if __name__ == "__main__":
    main()
