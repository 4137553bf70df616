"""Where Ape-X DDPG's actors explore: a ladder of noise scales spread over the actors that join,
as Ape-X's epsilons (``apex.algos.apex_dqn.exploration``: the same van der Corput offsets), and
the noise itself, Gaussian (TD3) or Ornstein-Uhlenbeck (DDPG), in units of each action's half
range and clipped into the bounds."""

from __future__ import annotations

import numpy as np

from apex.algos.apex_dqn.exploration import actor_offset, ladder_epsilon
from apex.config import ApexDdpgConfig


def actor_noise_scales(actor_index: int, num_envs: int, config: ApexDdpgConfig) -> tuple[list[float], list[bool]]:
    """Per-environment noise scales for one actor, and which of its environments evaluate.

    The K exploring environments of actor i sit at u = (j + offset_i) / K on
    sigma = noise_base ** (1 + noise_alpha * u) (``apex.algos.apex_dqn.exploration.actor_epsilons``
    says why this spreads evenly over any number of actors); the last ``eval_envs`` play
    the policy without noise, and only their episodes count in return_mean_100.
    """
    eval_envs = min(config.eval_envs, num_envs)
    exploring = num_envs - eval_envs
    offset = actor_offset(actor_index)
    scales = [ladder_epsilon((j + offset) / exploring, config.noise_base, config.noise_alpha) for j in range(exploring)]
    return scales + [0.0] * eval_envs, [False] * exploring + [True] * eval_envs


class ExplorationNoise:
    """Noise for a fixed set of rows (one actor's environments, or external episodes), each
    with its own scale: ``gaussian``, sigma_i N(0, 1) each step, or ``ou``, x <- x - theta x +
    sigma_i N(0, 1) carried from step to step and restarted at 0 with each episode. Scales
    are fractions of each action's half range."""

    def __init__(self, kind: str, theta: float, half: np.ndarray, rng: np.random.Generator) -> None:
        self.kind, self.theta, self.half, self.rng = kind, theta, half.astype(np.float32), rng
        self.state = np.zeros((0, len(half)), np.float32)

    def resize(self, rows: int) -> None:
        """Keeps the OU state of rows that stay; new rows start at 0."""
        state = np.zeros((rows, len(self.half)), np.float32)
        kept = min(rows, len(self.state))
        state[:kept] = self.state[:kept]
        self.state = state

    def sample(self, scales: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """This step's noise [len(scales), D] for ``rows`` (all rows by default)."""
        white = self.rng.standard_normal((len(scales), len(self.half))).astype(np.float32)
        white *= np.asarray(scales, np.float32)[:, None]
        if self.kind == "ou":
            index = slice(None) if rows is None else rows
            self.state[index] = self.state[index] * (1 - self.theta) + white
            white = self.state[index].copy()
        return white * self.half

    def reset(self, row: int) -> None:
        """Row ``row``'s episode ended: its OU process starts again at 0."""
        self.state[row] = 0.0


def explore(action: np.ndarray, noise: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """mu(s) plus noise, clipped into the bounds (float32)."""
    out: np.ndarray = np.clip(action + noise, low, high).astype(np.float32)
    return out
