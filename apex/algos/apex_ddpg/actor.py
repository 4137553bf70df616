"""The Ape-X DDPG actor core: Ape-X's actor (``apex.algos.apex_dqn.actor``: K environments,
n-step chunks with initial priorities, frames stored once) acting with mu(s) plus noise on
the ladder (``apex.algos.apex_ddpg.exploration``). Its priorities come from its own critic:

    target_t = G_t + gamma^n Q(s_{t+n}, mu(s_{t+n})),   priority_t = |target_t - Q(s_t, a_t)|

No torch here unless the observations are images (``apex.nets.numpy_deterministic``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from apex.algos.apex_ddpg.exploration import ExplorationNoise, explore
from apex.algos.apex_dqn.actor import ApexDqnActor, ApexDqnEpisodeActor
from apex.algos.nstep import NStepChunker
from apex.config import Config
from apex.nets.numpy_deterministic import DeterministicFunction, deterministic_network
from apex.wire.protocol import Message

if TYPE_CHECKING:
    from apex.core.episode import Episode
    from apex.envs.make import EnvSpec


def float32_bounds(spec: EnvSpec) -> tuple[np.ndarray, np.ndarray]:
    """The action bounds as float32 values within the bounds themselves (a float32 rounding of
    a bound may fall outside it, and the learner refuses actions outside)."""
    low64, high64 = np.asarray(spec.action_low, np.float64), np.asarray(spec.action_high, np.float64)
    low, high = low64.astype(np.float32), high64.astype(np.float32)
    low = np.where(low < low64, np.nextafter(low, np.float32(np.inf)), low)
    high = np.where(high > high64, np.nextafter(high, np.float32(-np.inf)), high)
    return low.astype(np.float32), high.astype(np.float32)


def ddpg_chunker(config: Config, stack: int) -> NStepChunker:
    """One environment's (or external episode's) chunker of continuous actions."""
    settings = config.apex_ddpg
    return NStepChunker(
        stack,
        settings.n_step,
        settings.gamma,
        settings.chunk_transitions,
        clip_rewards=config.env.is_atari and config.env.clip_rewards,
        reward_scale=config.env.reward_scale,
        action_dtype=np.float32,
    )


def q_taken_and_values(
    net: DeterministicFunction, obs: np.ndarray, actions: np.ndarray, mu: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(Q(s, a), Q(s, mu(s))) in one pass of the critic over both (measured on Pendulum's 16
    environments: 48 against 67 us for two passes)."""
    q = net.q(np.concatenate([obs, obs]), np.concatenate([actions, mu]))
    return q[: len(obs)], q[len(obs) :]


def setup_problem(setup: dict[str, Any]) -> str | None:
    """What is wrong with a welcome's noise ladder (``ApexDdpgLearner.actor_setup``), or None."""
    n, scales, evaluating = setup["num_envs"], setup.get("noise_scales"), setup.get("eval_envs")
    if not (
        isinstance(scales, list) and len(scales) == n and all(type(s) in (int, float) and 0 <= s <= 10 for s in scales)
    ):
        return f"setup.noise_scales must be a list of {n} numbers in [0, 10] (one an environment)"
    if not (isinstance(evaluating, list) and len(evaluating) == n and all(type(e) is bool for e in evaluating)):
        return f"setup.eval_envs must be a list of {n} booleans (one an environment)"
    return None


class ApexDdpgActor(ApexDqnActor):
    """K environments on the noise ladder; ``act()`` is one step of all of them."""

    def __init__(
        self, config: Config, setup: dict[str, Any], seed: int, tick: Callable[[], None] = lambda: None
    ) -> None:
        self.config = config
        self.scales = np.asarray(setup["noise_scales"], np.float32)
        self._start(config, list(setup["eval_envs"]), seed, tick)
        self.policy_net = deterministic_network(self.spec, config.model)
        self.low, self.high = float32_bounds(self.spec)
        settings = config.apex_ddpg
        half = (self.high - self.low) / 2
        self.noise = ExplorationNoise(settings.noise, settings.ou_theta, half, np.random.default_rng(seed))
        self.noise.resize(self.num_envs)

    def _chunker(self) -> NStepChunker:
        return ddpg_chunker(self.config, self.spec.stack)

    @property
    def chunk_transitions(self) -> int:
        return self.config.apex_ddpg.chunk_transitions

    def _choose(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mu(s) plus each environment's noise, clipped into the bounds; Q(s, a) of that
        action; the state's value Q(s, mu(s)))."""
        mu = self.policy_net.policy(obs)
        actions = explore(mu, self.noise.sample(self.scales), self.low, self.high)
        return actions, *q_taken_and_values(self.policy_net, obs, actions, mu)

    def _values(self, obs: np.ndarray) -> np.ndarray:
        return self.policy_net.q(obs, self.policy_net.policy(obs))

    def set_weights(self, msg: Message) -> None:
        self.policy_net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def _episode_ended(self, row: int) -> None:
        self.noise.reset(row)


class _ExternalEpisode:
    """An external episode's Ape-X DDPG state: its chunker and its rung of the ladder."""

    def __init__(self, chunker: NStepChunker, scale: float, is_eval: bool, row: int) -> None:
        self.chunker, self.scale, self.is_eval, self.row = chunker, scale, is_eval, row


class ApexDdpgEpisodeActor(ApexDqnEpisodeActor):
    """Ape-X DDPG for episodes stepped elsewhere (``apex.serve.episodes``): each episode plays
    mu(s) with the noise of its slot's rung (its own OU process, for noise: ou), and may take
    actions the client chose (``log_action``), learned from off-policy as Ape-X DQN's."""

    def __init__(self, config: Config, setup: dict[str, Any], spec: EnvSpec, seed: int) -> None:
        # (not ApexDqnEpisodeActor's: no epsilons, no Q network)
        self.config, self.spec = config, spec
        self.scales = np.asarray(setup["noise_scales"], np.float32)
        self.eval_mask = list(setup["eval_envs"])
        self.policy_net = deterministic_network(spec, config.model)
        self.rng = np.random.default_rng(seed)
        self.weights_version = -1
        self._pending = []
        self.low, self.high = float32_bounds(spec)
        settings = config.apex_ddpg
        self.noise = ExplorationNoise(settings.noise, settings.ou_theta, (self.high - self.low) / 2, self.rng)

    @property
    def chunk_transitions(self) -> int:
        return self.config.apex_ddpg.chunk_transitions

    def begin(self, episode: Episode) -> None:
        if episode.slot is None:
            raise ValueError(f"episode {episode.id} begins before it has a slot")
        rung = episode.slot % len(self.scales)
        if episode.slot >= len(self.noise.state):
            self.noise.resize(episode.slot + 1)
        self.noise.reset(episode.slot)
        chunker = ddpg_chunker(self.config, self.spec.stack)
        episode.state = _ExternalEpisode(chunker, float(self.scales[rung]), bool(self.eval_mask[rung]), episode.slot)

    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
        """Actions for ``obs`` [n, stack, ...] (or ``chosen`` ones: apex serve refuses any
        outside the bounds, and a float32 rounding past one is clipped),
        recorded with their Q-values; the step before each (``episode.reward``) ends here."""
        net = self.policy_net
        mu = net.policy(obs)
        if chosen is None:
            states: list[_ExternalEpisode] = [e.state for e in episodes]
            scales = np.fromiter((s.scale for s in states), np.float32, len(states))
            rows = np.fromiter((s.row for s in states), np.int64, len(states))
            actions = explore(mu, self.noise.sample(scales, rows), self.low, self.high)
        else:
            actions = np.clip(np.asarray(chosen, np.float32).reshape(mu.shape), self.low, self.high)
        taken, value = q_taken_and_values(net, obs, actions, mu)
        q_taken, values = taken.tolist(), value.tolist()
        for i, episode in enumerate(episodes):
            chunker = episode.state.chunker
            if episode.acted:
                chunker.record_step(episode.reward, obs[i, -1])
            else:
                chunker.start(obs[i, -1])
            chunk = chunker.record_action(actions[i], q_taken[i], values[i])
            if chunk is not None:
                self._pending.append((chunk, []))
        return actions

    def set_weights(self, msg: Message) -> None:
        self.policy_net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def _values(self, obs: np.ndarray) -> np.ndarray:
        return self.policy_net.q(obs, self.policy_net.policy(obs))
