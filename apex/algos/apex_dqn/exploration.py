"""Where Ape-X's actors explore: the epsilon ladder (Horgan et al. 2018, Sec. 4.1) spread over
the actors that join, and the choice of each step's actions on it, epsilon-greedy or with
``apex_dqn.eps_repeat_mu`` temporally extended (ez-greedy, Dabney, Ostrovski & Barreto 2021:
a random action is held for n ~ zeta(mu) steps, so that random play covers ground where
one-step dithering stays put, as in MinAtar Freeway).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from apex.config import ApexDqnConfig

MAX_REPEAT = 100
"""ez-greedy's longest hold: zeta(2) has no finite mean, and a hold longer than this only
takes an environment off its policy for most of an episode."""


def epsilon_ladder(i: int, n: int, base: float = 0.4, alpha: float = 7.0) -> float:
    """Exploration rate of the i-th of n exploring environments (the paper's ladder)."""
    if n <= 1:
        return base
    return ladder_epsilon(i / (n - 1), base, alpha)


def ladder_epsilon(u: float, base: float = 0.4, alpha: float = 7.0) -> float:
    """Exploration rate at position u in [0, 1] of the ladder: base at 0, base ** (1 + alpha) at 1."""
    epsilon: float = base ** (1 + alpha * u)  # (float ** float is typed Any: it may be complex)
    return epsilon


def actor_offset(actor_index: int) -> float:
    """Where in [0, 1) an actor's environments sit between rungs: the base-2 van der Corput
    sequence (0, 1/2, 1/4, 3/4, 1/8, ...), so that actors 0..M-1 together always spread
    evenly, whatever M is, without an actor's epsilons changing as others join."""
    offset, scale = 0.0, 0.5
    while actor_index:
        offset += scale * (actor_index & 1)
        actor_index >>= 1
        scale /= 2
    return offset


def actor_epsilons(actor_index: int, num_envs: int, config: ApexDqnConfig) -> tuple[list[float], list[bool]]:
    """Per-environment epsilons for one actor, and which of its environments evaluate.

    The ladder follows the actors actually in the run, however many join: the K exploring
    environments of actor i sit at positions u = (j + offset_i) / K, j = 0..K-1, on
    eps = eps_base ** (1 + eps_alpha * u), with offset_i = ``actor_offset(i)``. Every actor
    covers the whole range; actors with distinct indices (the learner hands out the lowest
    free one, so a newcomer takes the place of one that left) get distinct epsilons, and
    actors 0..M-1 fill the ladder evenly (exactly so for M a power of two; with M actors of
    K environments it is the paper's ladder over M*K rungs, its greediest rung at u < 1).
    The last ``eval_envs`` of each actor play with ``eval_epsilon``. Evaluation episodes
    (return_mean_100) are those of every environment whose epsilon is at most
    ``eval_epsilon``: the set-aside ones and the near-greedy end of the ladder, never the
    exploring ones that would drag the mean down.
    """
    eval_envs = min(config.eval_envs, num_envs)
    exploring = num_envs - eval_envs
    offset = actor_offset(actor_index)
    epsilons = [ladder_epsilon((j + offset) / exploring, config.eps_base, config.eps_alpha) for j in range(exploring)]
    epsilons += [config.eval_epsilon] * eval_envs
    return epsilons, [eps <= config.eval_epsilon for eps in epsilons]


def choose_actions(
    rng: np.random.Generator,
    greedy: np.ndarray,
    epsilons: np.ndarray,
    num_actions: int,
    repeat_mu: float | None = None,
    held: np.ndarray | None = None,
    left: np.ndarray | None = None,
    may_repeat: np.ndarray | None = None,
) -> np.ndarray:
    """One step's actions of a set of rows from their greedy actions: each row explores with
    its own epsilon. With ``repeat_mu``, a row that starts to explore (``may_repeat``, and not
    holding) holds its random action for n ~ zeta(repeat_mu) steps (at most MAX_REPEAT);
    ``held`` and ``left`` (the action each row holds and for how many more steps) are updated
    in place."""
    count = len(greedy)
    explore = rng.random(count) < epsilons
    random = rng.integers(0, num_actions, count)
    if repeat_mu is None:
        return np.where(explore, random, greedy)
    if held is None or left is None or may_repeat is None:
        raise ValueError("holding actions (repeat_mu) needs held, left and may_repeat")
    start = explore & (left == 0) & may_repeat
    held[start] = random[start]
    left[start] = np.minimum(rng.zipf(repeat_mu, int(start.sum())), MAX_REPEAT)
    holding = left > 0
    actions = np.where(holding, held, np.where(explore, random, greedy))
    left[holding] -= 1
    return actions


class Explorer:
    """``choose_actions`` for a fixed set of rows (one actor's environments), with their
    holds; the rows in ``plain`` (evaluation) never hold an action."""

    def __init__(
        self,
        epsilons: ArrayLike,
        num_actions: int,
        rng: np.random.Generator,
        repeat_mu: float | None = None,
        plain: ArrayLike | None = None,
    ) -> None:
        self.epsilons = np.asarray(epsilons, np.float64)
        self.num_actions, self.rng, self.repeat_mu = num_actions, rng, repeat_mu
        count = len(self.epsilons)
        self.may_repeat = ~np.asarray(plain if plain is not None else np.zeros(count, bool), bool)
        self.held = np.zeros(count, np.int64)
        self.left = np.zeros(count, np.int64)

    def actions(self, greedy: np.ndarray) -> np.ndarray:
        return choose_actions(
            self.rng, greedy, self.epsilons, self.num_actions, self.repeat_mu, self.held, self.left, self.may_repeat
        )

    def reset(self, row: int) -> None:
        """Row ``row``'s episode ended: whatever it held is dropped."""
        self.left[row] = 0
