"""Ape-X DDPG's settings (the ``apex_ddpg`` section): Ape-X's distributed prioritized replay
(Horgan et al. 2018, its DPG variant) for continuous actions, with TD3's three fixes
(Fujimoto et al. 2018) each a key and on by default."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from apex.config.algorithms import ReplayConfig, replay_section_problems

NOISE_KINDS = ("gaussian", "ou")


def _ddpg_replay() -> ReplayConfig:
    return ReplayConfig(capacity=1_000_000, min_size=2_000, rate_slack=20_000)


@dataclass(frozen=True)
class ApexDdpgConfig:
    """Ape-X DDPG: a deterministic policy mu(s) in the action bounds and twin critics Q(s, a),
    trained on n-step returns from a prioritized replay that actors fill, each environment
    exploring with its own noise scale on a ladder."""

    batch_size: int = 256
    """Transitions per update."""
    lr: float = 1e-3
    """Adam learning rate of the critics."""
    replay_ratio: float = 32.0
    """Transitions trained per transition inserted, held by the learner (as apex_dqn.replay_ratio).
    TD3 takes one update of 256 per environment step (256); here the actors would outrun the
    learner, and the ratio is what holds them back. 32: Pendulum-v1 to -200 in 47 s on 2 cores
    (64: -304 after 150 s, each transition trained on twice as often but half as many reaching
    the replay, and seconds staler)."""
    actor_lr: float | None = None
    """Adam learning rate of the policy (null: lr)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    gamma: float = 0.99
    """Discount factor."""
    n_step: int = 3
    """Steps in the n-step return (Ape-X DPG: 5; bootstrapped with the target networks)."""
    tau: float = 0.005
    """Polyak averaging of the target networks: target <- tau * online + (1 - tau) * target,
    after every policy update (TD3's)."""
    twin_critics: bool = True
    """TD3's clipped double Q-learning: two critics, the target the smaller of their two
    target values (false: one critic, DDPG's target)."""
    target_noise: float = 0.2
    """TD3's target policy smoothing: Gaussian noise of this standard deviation (a fraction
    of each action's half range) on the target policy's action (0: none, DDPG's target)."""
    target_noise_clip: float = 0.5
    """That noise is clipped to +- this (a fraction of the half range)."""
    policy_delay: int = 2
    """TD3's delayed policy updates: the policy and the target networks are updated every this
    many critic updates (1: every update, DDPG's)."""
    grad_clip: float = 40.0
    """Maximum gradient norm (critics and policy together)."""
    publish_interval: int = 10
    """Updates between weight broadcasts to the actors."""
    weights_update_steps: int = 50
    """Vector steps of an actor between looks for newer weights (never blocks)."""
    prefetch_batches: int | None = None
    """Batches the prefetch thread keeps staged ahead (as apex_dqn.prefetch_batches; None:
    sized by memory)."""
    checkpoint_replay: bool = True
    """Save the replay with its priorities in every checkpoint."""
    noise: str = "gaussian"
    """Exploration noise added to mu(s) by the actors: ``gaussian`` (independent each step,
    TD3's) or ``ou`` (an Ornstein-Uhlenbeck process per environment, DDPG's); clipped into
    the bounds."""
    noise_base: float = 0.5
    """The noise ladder: environment j of the exploring ones plays with standard deviation
    sigma = noise_base ** (1 + noise_alpha * u) (a fraction of the half range), u in [0, 1]
    spread over every exploring environment of the actors that join, as Ape-X's epsilons."""
    noise_alpha: float = 3.0
    """The noise ladder's exponent (0: every environment at noise_base)."""
    ou_theta: float = 0.15
    """noise: ou: the process's pull back to 0 a step (x <- x - theta x + sigma N(0, 1))."""
    eval_envs: int = 4
    """Environments per actor set aside to play the policy without noise for return_mean_100
    (4 of 16: the throttled actors step slowly, and 100 evaluation episodes of Pendulum's 200
    steps took 150 s with 2)."""
    chunk_transitions: int = 16
    """Transitions an environment collects before they are sent (less at episode ends): small,
    so that the batches queued while the learner holds the actors back stay fresh (64: the
    inserted transitions were 8 s old on Pendulum, 16: 4 s)."""
    replay: ReplayConfig = field(default_factory=_ddpg_replay)

    @property
    def frame_capacity(self) -> int:
        """Frames the replay keeps for stacked observations."""
        if self.replay.frame_capacity is not None:
            return self.replay.frame_capacity
        return self.replay.capacity + self.replay.capacity // 8 + 4096

    @property
    def policy_lr(self) -> float:
        return self.lr if self.actor_lr is None else self.actor_lr

    def problems(self, num_envs: int | None) -> list[str]:
        """Every value out of range (``num_envs``: the actor section's, where the run is
        Ape-X DDPG's; None: eval_envs is not held to it)."""
        s = "apex_ddpg"
        checks = (
            (self.actor_lr is None or self.actor_lr > 0, f"{s}.actor_lr must be > 0 or null, got {self.actor_lr}"),
            (0 < self.tau <= 1, f"{s}.tau must be in (0, 1], got {self.tau}"),
            (0 <= self.target_noise <= 10, f"{s}.target_noise must be in [0, 10], got {self.target_noise}"),
            (self.target_noise_clip > 0, f"{s}.target_noise_clip must be > 0, got {self.target_noise_clip}"),
            (1 <= self.policy_delay <= 1000, f"{s}.policy_delay must be in 1..1000, got {self.policy_delay}"),
            (self.noise in NOISE_KINDS, f"{s}.noise must be gaussian or ou, got {self.noise!r}"),
            (0 < self.noise_base <= 10, f"{s}.noise_base must be in (0, 10], got {self.noise_base}"),
            (0 <= self.noise_alpha < math.inf, f"{s}.noise_alpha must be >= 0, got {self.noise_alpha}"),
            (0 < self.ou_theta <= 1, f"{s}.ou_theta must be in (0, 1], got {self.ou_theta}"),
        )
        return replay_section_problems(self, s, num_envs) + [message for ok, message in checks if not ok]
