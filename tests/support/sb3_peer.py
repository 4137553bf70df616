"""Stable-Baselines3's PPO and SAC on a task of `apex bench learn`, timed as apex is: wall
seconds and env steps until the mean return of the last 100 training episodes reaches the
target. The reference users compare apex's continuous learners with (issue 47); SB3 is not a
dependency of apex: ``pip install stable-baselines3==2.9.2`` (torch through constraints.txt).

    python -m tests.support.sb3_peer --algo ppo --env tests.envs:apex-test/Reach-v0 --target 0

prints one JSON line: algo, env, seed, seconds and env_steps to the target (null if not
reached within --seconds), the best mean and the env steps in all. PPO: MlpPolicy, 8 envs
(DummyVecEnv), n_steps 256, its other defaults (as issue 47 measured it); SAC: its defaults.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections import deque

import numpy as np


def make_env(env: str) -> str:
    """An env id, ``module:id`` importing ``module`` first (where it registers ``id``)."""
    if ":" in env:
        module, env = env.split(":", 1)
        importlib.import_module(module)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", choices=["ppo", "sac"], required=True)
    parser.add_argument("--env", required=True)
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--envs", type=int, default=8, help="PPO's vectorized envs (SAC: 1)")
    args = parser.parse_args()

    import torch
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)  # as apex's learner on 2 cores with its actors beside it
    env_id = make_env(args.env)
    returns: deque[float] = deque(maxlen=100)
    result = {"algo": args.algo, "env": args.env, "seed": args.seed, "seconds": None, "env_steps": None, "best": None}
    started = time.monotonic()

    class Watch(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:  # Monitor's record of an episode that ended
                    returns.append(info["episode"]["r"])
            if len(returns) == returns.maxlen:
                mean = float(np.mean(returns))
                result["best"] = mean if result["best"] is None else max(result["best"], mean)
                if mean >= args.target and result["seconds"] is None:
                    result["seconds"] = round(time.monotonic() - started, 1)
                    result["env_steps"] = self.num_timesteps
                    return False
            return time.monotonic() - started < args.seconds

    if args.algo == "ppo":
        vec = make_vec_env(env_id, n_envs=args.envs, seed=args.seed)
        model = PPO("MlpPolicy", vec, n_steps=256, seed=args.seed, device="cpu")
    else:
        vec = make_vec_env(env_id, n_envs=1, seed=args.seed)
        model = SAC("MlpPolicy", vec, seed=args.seed, device="cpu")
    watch = Watch()
    model.learn(total_timesteps=10**9, callback=watch)
    result["total_env_steps"] = watch.num_timesteps
    result["best"] = None if result["best"] is None else round(result["best"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
