"""Stable-Baselines3's PPO and SAC on a task of `apex bench learn`, timed as apex is: wall
seconds and env steps until the mean return of the last 100 training episodes reaches the
target. The reference users compare apex's continuous learners with (issue 47); SB3 is not a
dependency of apex: ``pip install stable-baselines3==2.9.2`` (torch through constraints.txt).

    python -m tests.support.sb3_peer --algo ppo --env tests.envs:apex-test/Reach-v0 --target 0

prints one JSON line: algo, env, seed, seconds and env_steps to the target (null if not
reached within --seconds), the best mean and the env steps in all. PPO: MlpPolicy, 8 envs
(DummyVecEnv), n_steps 256, its other defaults (as issue 47 measured it); SAC: its defaults.
With --zoo, rl-baselines3-zoo's tuned hyperparameters for the task instead (``ZOO``: the
figures of its benchmark that users compare against), VecNormalize where it normalizes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections import deque
from typing import Any

import numpy as np

# rl-baselines3-zoo's hyperparams/ppo.yml and sac.yml (its LunarLanderContinuous-v2 entries,
# for v3); "lin_X" is a rate falling linearly from X to 0; normalize: VecNormalize.
ZOO: dict[tuple[str, str], dict[str, Any]] = {
    ("ppo", "Pendulum-v1"): {
        "n_envs": 4,
        "n_steps": 1024,
        "gae_lambda": 0.95,
        "gamma": 0.9,
        "n_epochs": 10,
        "ent_coef": 0.0,
        "learning_rate": 1e-3,
        "clip_range": 0.2,
        "use_sde": True,
        "sde_sample_freq": 4,
    },
    ("ppo", "LunarLanderContinuous-v3"): {
        "n_envs": 16,
        "n_steps": 1024,
        "batch_size": 64,
        "gae_lambda": 0.98,
        "gamma": 0.999,
        "n_epochs": 4,
        "ent_coef": 0.01,
    },
    ("ppo", "BipedalWalker-v3"): {
        "normalize": True,
        "n_envs": 32,
        "n_steps": 2048,
        "batch_size": 64,
        "gae_lambda": 0.95,
        "gamma": 0.999,
        "n_epochs": 10,
        "ent_coef": 0.0,
        "learning_rate": 3e-4,
        "clip_range": 0.18,
    },
    ("sac", "Pendulum-v1"): {"learning_rate": 1e-3},
    ("sac", "LunarLanderContinuous-v3"): {
        "batch_size": 256,
        "learning_rate": "lin_7.3e-4",
        "buffer_size": 1_000_000,
        "ent_coef": "auto",
        "gamma": 0.99,
        "tau": 0.01,
        "train_freq": 1,
        "gradient_steps": 1,
        "learning_starts": 10000,
        "policy_kwargs": {"net_arch": [400, 300]},
    },
    ("sac", "BipedalWalker-v3"): {
        "learning_rate": 7.3e-4,
        "buffer_size": 300_000,
        "batch_size": 256,
        "ent_coef": "auto",
        "gamma": 0.98,
        "tau": 0.02,
        "train_freq": 64,
        "gradient_steps": 64,
        "learning_starts": 10000,
        "use_sde": True,
        "policy_kwargs": {"log_std_init": -3, "net_arch": [400, 300]},
    },
}


def linear(value: Any) -> Any:
    """rl-zoo's "lin_X": X times the remaining progress (1 -> 0)."""
    if isinstance(value, str) and value.startswith("lin_"):
        start = float(value[4:])
        return lambda progress: progress * start
    return value


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
    parser.add_argument("--zoo", action="store_true", help="rl-baselines3-zoo's tuned hyperparameters (ZOO)")
    args = parser.parse_args()

    import torch
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    torch.set_num_threads(1)  # as apex's learner on 2 cores with its actors beside it
    env_id = make_env(args.env)
    returns: deque[float] = deque(maxlen=100)
    result = {
        "algo": args.algo,
        "env": args.env,
        "zoo": args.zoo,
        "seed": args.seed,
        "seconds": None,
        "env_steps": None,
        "best": None,
    }
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

    if args.zoo:
        if (args.algo, env_id) not in ZOO:
            raise SystemExit(f"no rl-zoo hyperparameters here for {args.algo} on {env_id}: {sorted(ZOO)}")
        settings = {key: linear(value) for key, value in ZOO[(args.algo, env_id)].items()}
        normalize = bool(settings.pop("normalize", False))
        vec = make_vec_env(env_id, n_envs=int(settings.pop("n_envs", 1)), seed=args.seed)
        if normalize:  # Monitor sits inside, so the returns watched stay the environment's own
            vec = VecNormalize(vec)
        learner = PPO if args.algo == "ppo" else SAC
        model = learner("MlpPolicy", vec, seed=args.seed, device="cpu", **settings)
    elif args.algo == "ppo":
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
