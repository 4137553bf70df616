"""`apex eval`: play a checkpoint's policy greedily and report the returns.

Ape-X checkpoints act with epsilon (0 by default) on the online Q network; IMPALA
checkpoints take the most likely action of the policy. Atari frames are stacked as the
actors stack them; rewards are reported unclipped. Given a run directory, eval plays its
best checkpoint (the highest return_mean_100 the learner recorded) or its newest.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from apex import config as config_module
from apex.checkpoint import (
    ORDERS,
    Checkpoint,
    CorruptCheckpoint,
    first_loadable,
    read_state,
    verify,
)
from apex.config.trust import from_elsewhere
from apex.envs.make import EnvSpec, FrameStacker, make_env
from apex.envs.multi_agent import is_multi_agent
from apex.errors import ApexError
from apex.run.checkpoint_policy import greedy_actions, network_from_checkpoint
from apex.run.multi_agent_eval import play_multi_agent


def load_checkpoint(path: str | Path, which: str = "best") -> dict[str, Any]:
    """A learner checkpoint (a ckpt-*.pt file, or the best or newest valid one of a run
    directory: ``which``), loaded without running code, or ApexError saying in one line why
    it cannot be used."""
    return _load(Path(path), which)[0]


def _load(path: Path, which: str) -> tuple[dict[str, Any], Path, float | None]:
    """(state, the .pt file it came from, the score its manifest records)."""
    if which not in ORDERS:
        raise ApexError(f"--which must be one of {', '.join(ORDERS)}, got {which!r}")
    if path.is_dir():
        return first_loadable(path, _loaded, which=which)
    if not path.exists():
        raise ApexError(f"checkpoint {path} not found: pass a ckpt-*.pt file from LOGDIR/checkpoints/ or a LOGDIR")
    # A file named on the command line may be the user's own link; what it leads to, and the
    # manifest beside that, must be regular files (a FIFO there would block the read).
    real = path.resolve()
    score = None
    try:
        if os.path.lexists(real.with_suffix(".json")):
            # size and CRC-32: torch.load would not notice a flipped byte
            score = verify(real.with_suffix(".json")).score
        state = read_state(real)
    except CorruptCheckpoint as e:
        raise ApexError(f"checkpoint {path} is unreadable (truncated or corrupt?): {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise ApexError(f"{path} is not an apex learner checkpoint (no config inside)")
    return state, path, score


def _loaded(checkpoint: Checkpoint) -> tuple[dict[str, Any], Path, float | None]:
    """A verified checkpoint of a run, loaded; CorruptCheckpoint (then it is set aside and
    the next tried, as a resume would) if it does not load."""
    return checkpoint.load_state(), checkpoint.state_path, checkpoint.score


def policy_from_checkpoint(
    state: dict[str, Any],
    allow_imports: Collection[str] = (),
    source: str = "the checkpoint",
    policy: str | None = None,
) -> tuple[config_module.Config, EnvSpec, Callable[[torch.Tensor, Any], tuple[int | np.ndarray, Any]]]:
    """(config, spec, act) where act(obs [1, ...] uint8/float32, core state) -> (an action
    as the (adapted) environment takes it, the next core state; pass None at an episode's
    start); ApexError (one line) as ``network_from_checkpoint``."""
    config, spec, net = network_from_checkpoint(state, allow_imports, source, policy)

    def act(obs: torch.Tensor, core: Any = None) -> tuple[int | np.ndarray, Any]:
        actions, core = greedy_actions(config, net, obs, core)
        return spec.env_action(actions[0].numpy()), core

    return config, spec, act


def load_state(path: str | Path, which: str = "best") -> tuple[dict[str, Any], Path, float | None]:
    """(checkpoint state, the .pt file it came from, the return_mean_100 recorded with it) for
    a ckpt-*.pt file or a run directory's best or newest checkpoint."""
    return _load(Path(path), which)


def evaluate(
    checkpoint: str | Path,
    episodes: int,
    epsilon: float = 0.0,
    seed: int = 12345,
    video_dir: str | None = None,
    which: str = "best",
    allow_imports: Collection[str] = (),
    policy: str | None = None,
) -> dict[str, Any]:
    """Plays ``episodes`` episodes of ``checkpoint`` (a ckpt-*.pt file, or a run directory's
    best or newest checkpoint: ``which``), its config importing only what ``allow_imports``
    allows (apex.config.trust); returns the returns and their mean and std, the
    .pt file played ("checkpoint"), how it was chosen ("which": best, newest or file) and
    the return_mean_100 the learner recorded with it ("recorded_return_mean_100", or None)."""
    if episodes < 1:
        raise ApexError(f"--episodes must be >= 1, got {episodes}")
    if not 0 <= epsilon <= 1:
        raise ApexError(f"--epsilon must be in [0, 1], got {epsilon}")
    state, source, recorded = _load(Path(checkpoint), which)
    config = from_elsewhere(state["config"], allow_imports, f"checkpoint {source}")
    played = {
        "checkpoint": str(source),
        "which": which if Path(checkpoint).is_dir() else "file",
        "recorded_return_mean_100": recorded,
        "env": config.env.id,
        "algo": config.algo,
        "updates": state.get("updates"),
        "episodes": episodes,
        "epsilon": epsilon,
    }
    if is_multi_agent(config.env):
        if video_dir is not None:
            raise ApexError("--video records Gymnasium environments; this checkpoint is of a PettingZoo one")
        result = play_multi_agent(state, config, f"checkpoint {source}", episodes, epsilon, seed, policy, allow_imports)
        returns = result.pop("returns")
        return {**played, **result, **_return_figures(returns)}
    config, spec, act = policy_from_checkpoint(state, allow_imports, f"checkpoint {source}", policy)
    if video_dir is None:
        env = make_env(config.env, seed)
    else:  # the same environment, rendered and recorded
        env = _recorder(make_env(config.env, seed, render_mode="rgb_array"), video_dir)
    rng = np.random.default_rng(seed)
    stacker = FrameStacker(1, spec.stack, spec.frame_shape, spec.frame_dtype)
    returns, lengths = [], []
    try:
        for episode in range(episodes):
            frame, _ = env.reset(seed=seed + episode)
            stacker.reset(0, frame)
            total, steps, done, core = 0.0, 0, False, None
            while not done:
                with torch.no_grad():
                    action, core = act(torch.from_numpy(stacker.obs), core)
                if rng.random() < epsilon:
                    action = spec.env_action(spec.random_actions(rng, 1)[0])
                frame, reward, terminated, truncated, _ = env.step(action)
                stacker.push(0, frame)
                total += float(reward)
                steps += 1
                done = terminated or truncated
            returns.append(total)
            lengths.append(steps)
    except gym.error.DependencyNotInstalled as e:  # rendering for --video, e.g. pygame
        raise ApexError(f"--video: {e}") from None
    finally:
        env.close()
    return {**played, "length_mean": float(np.mean(lengths)), **_return_figures(returns)}


def _return_figures(returns: list[float]) -> dict[str, Any]:
    return {"return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)), "returns": returns}


def _recorder(env: gym.Env[Any, Any], video_dir: str) -> gym.Env[Any, Any]:
    try:
        import moviepy  # noqa: F401  (RecordVideo's writer)
    except ImportError:
        env.close()
        raise ApexError("--video needs moviepy: pip install moviepy") from None
    return gym.wrappers.RecordVideo(env, video_dir, episode_trigger=lambda _: True, disable_logger=True)
