"""Each algorithm's own settings, one section each (``apex_dqn``, ``impala``): its
hyperparameters with defaults that stand on their own, so that ``--algo X --env Y`` alone
gets X's sensible values. The run's other sections (``learner``, ``actor``, ...) hold what
every algorithm shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_CHUNK_TRANSITIONS = 100_000
MAX_UNROLL_LENGTH = 10_000
MAX_REPLAY_RATIO = 1_000.0


@dataclass(frozen=True)
class ReplayConfig:
    capacity: int = 100_000
    """Transitions kept; the oldest are evicted first."""
    alpha: float = 0.6
    """Priority exponent: 0 samples uniformly."""
    beta: float = 0.4
    """Importance-sampling exponent (fixed, as in Ape-X)."""
    eps: float = 1e-6
    """Added to every priority so that no transition becomes unsampleable."""
    min_size: int = 2_000
    """Transitions stored before training starts."""
    rate_slack: int = 20_000
    """How far, in samples, either side may run ahead of the section's replay_ratio before it
    waits."""
    frame_capacity: int | None = None
    """Frames kept for stacked observations (None: capacity + an eighth + 4096)."""

    def problems(self, batch_size: int, section: str = "apex_dqn") -> list[str]:
        r = f"{section}.replay"
        return [
            message
            for ok, message in (
                (self.capacity >= 1, f"{r}.capacity must be a positive integer, got {self.capacity}"),
                (self.alpha >= 0, f"{r}.alpha must be >= 0, got {self.alpha}"),
                (self.beta >= 0, f"{r}.beta must be >= 0, got {self.beta}"),
                (self.eps > 0, f"{r}.eps must be > 0, got {self.eps}"),
                (
                    1 <= self.min_size <= self.capacity,
                    f"{r}.min_size must be in 1..{r}.capacity ({self.capacity}), got {self.min_size}",
                ),
                (
                    self.rate_slack >= batch_size,
                    f"{r}.rate_slack must be >= {section}.batch_size ({batch_size}), got {self.rate_slack}",
                ),
                (
                    self.frame_capacity is None or self.frame_capacity >= 1024,
                    f"{r}.frame_capacity must be >= 1024 or null, got {self.frame_capacity}",
                ),
            )
            if not ok
        ]


def replay_section_problems(s: Any, section: str, num_envs: int | None) -> list[str]:
    """What every Ape-X section (``apex_dqn``, ``apex_ddpg``) holds alike, out of range: its
    batch, lr, adam_eps, gamma, n_step, grad_clip, publishing, prefetch, eval_envs (within
    ``num_envs``, the actor section's; None: not held to it), chunk_transitions and replay."""
    envs = s.eval_envs if num_envs is None else num_envs
    eval_hint = (
        f": with {num_envs} environments per actor also set {section}.eval_envs (e.g. --set {section}.eval_envs=0)"
        if s.eval_envs > envs
        else ""
    )
    checks = (
        (s.batch_size >= 1, f"{section}.batch_size must be >= 1, got {s.batch_size}"),
        (s.lr > 0, f"{section}.lr must be > 0, got {s.lr}"),
        (
            0 < s.replay_ratio <= MAX_REPLAY_RATIO,
            f"{section}.replay_ratio must be in (0, {MAX_REPLAY_RATIO}], got {s.replay_ratio}",
        ),
        (s.adam_eps > 0, f"{section}.adam_eps must be > 0, got {s.adam_eps}"),
        (0 <= s.gamma <= 1, f"{section}.gamma must be in [0, 1], got {s.gamma}"),
        (s.n_step >= 1, f"{section}.n_step must be >= 1, got {s.n_step}"),
        (s.grad_clip > 0, f"{section}.grad_clip must be > 0, got {s.grad_clip}"),
        (s.publish_interval >= 1, f"{section}.publish_interval must be >= 1, got {s.publish_interval}"),
        (s.weights_update_steps >= 1, f"{section}.weights_update_steps must be >= 1, got {s.weights_update_steps}"),
        (
            s.prefetch_batches is None or 1 <= s.prefetch_batches <= 64,
            f"{section}.prefetch_batches must be in 1..64 or null (sized by memory), got {s.prefetch_batches}",
        ),
        (
            0 <= s.eval_envs <= envs,
            f"{section}.eval_envs must be in 0..actor.num_envs ({num_envs}), got {s.eval_envs}{eval_hint}",
        ),
        (
            1 <= s.chunk_transitions <= MAX_CHUNK_TRANSITIONS,
            f"{section}.chunk_transitions must be in 1..{MAX_CHUNK_TRANSITIONS}, got {s.chunk_transitions}",
        ),
    )
    replay: ReplayConfig = s.replay
    return [message for ok, message in checks if not ok] + replay.problems(s.batch_size, section)


@dataclass(frozen=True)
class ApexDqnConfig:
    """Ape-X DQN (Horgan et al. 2018): double dueling DQN on n-step returns from a prioritized
    replay, filled by actors exploring on a ladder of epsilons."""

    batch_size: int = 256
    """Transitions per update."""
    lr: float = 2e-3
    """Adam learning rate."""
    replay_ratio: float = 4.0
    """Transitions trained per transition inserted (each env step inserts one): the learner
    holds it, within replay.rate_slack samples, whether the actors are faster (their chunks
    wait: ZeroMQ's queues throttle them) or slower (the learner waits for data) than it; the
    ratio achieved is the metric replay_ratio (Reverb's SampleToInsertRatio)."""
    adam_eps: float = 1.5e-4
    """Adam epsilon."""
    gamma: float = 0.99
    """Discount factor."""
    n_step: int = 20
    """Steps in the n-step return (the Ape-X paper: 3; 20 here for CartPole, whose only signal is
    the episode's end; the presets for other tasks set their own)."""
    target_update_interval: int = 200
    """Updates between copies of the online network into the target network."""
    grad_clip: float = 10.0
    """Maximum gradient norm."""
    publish_interval: int = 10
    """Updates between weight broadcasts to the actors."""
    weights_update_steps: int = 50
    """Vector steps of an actor between looks for newer weights (never blocks)."""
    prefetch_batches: int | None = None
    """Batches the prefetch thread keeps staged ahead of training; once half are used it
    samples the missing ones together (one stratified draw, each batch spread over the whole
    replay) and writes back the priorities of the steps trained since, together. More: less of
    that thread's work per step, paid in GIL hand-overs to the training thread (on 2 cores,
    MLP at batch 512: 0.87-0.90 of the update-alone rate with 8, 0.92 with 16, 0.94 with 32,
    0.95-0.96 with 64), and batches drawn with priorities up to this many steps old. None: as
    many as 256 MiB of staged batches hold, 2 to 64 (64 for CartPole's batches of 512, 9 for
    Atari's, 29 MiB each)."""
    checkpoint_replay: bool = True
    """Save the replay contents with their priorities in every checkpoint, so that a resumed
    run does not start from an empty replay."""
    eps_base: float = 0.4
    """Exploration ladder: eps = eps_base ** (1 + eps_alpha * u), u in [0, 1] spread over every
    exploring environment of the actors that join (however many; see docs/running.md,
    "Exploration")."""
    eps_alpha: float = 7.0
    """Exploration ladder exponent."""
    eps_repeat_mu: float | None = None
    """Temporally extended exploration (ez-greedy, Dabney et al. 2021): where an exploring
    environment takes a random action, it repeats it for n ~ zeta(mu) steps (at most 100),
    so that random play travels instead of dithering (hard exploration such as MinAtar
    Freeway). null: plain epsilon-greedy (n = 1); 2.0 is the paper's choice. Evaluation
    environments always play plain epsilon-greedy."""
    eval_envs: int = 2
    """Environments per actor set aside to play near-greedily for return_mean_100."""
    eval_epsilon: float = 0.01
    """Epsilon of the evaluation environments (at most 0.01)."""
    chunk_transitions: int = 64
    """Transitions an environment collects before they are sent (less at episode ends)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)

    @property
    def frame_capacity(self) -> int:
        """Frames the replay keeps for stacked observations."""
        if self.replay.frame_capacity is not None:
            return self.replay.frame_capacity
        return self.replay.capacity + self.replay.capacity // 8 + 4096

    def problems(self, num_envs: int) -> list[str]:
        """Every value out of range (``num_envs``: the actor section's, which eval_envs
        is a part of)."""
        s = "apex_dqn"
        checks = (
            (
                self.target_update_interval >= 1,
                f"{s}.target_update_interval must be >= 1, got {self.target_update_interval}",
            ),
            (0 < self.eps_base <= 1, f"{s}.eps_base must be in (0, 1], got {self.eps_base}"),
            (self.eps_alpha >= 0, f"{s}.eps_alpha must be >= 0, got {self.eps_alpha}"),
            (
                self.eps_repeat_mu is None or 1 < self.eps_repeat_mu < math.inf,
                f"{s}.eps_repeat_mu must be > 1 (a zeta exponent; 2.0 is the paper's) or null, "
                f"got {self.eps_repeat_mu}",
            ),
            (0 <= self.eval_epsilon <= 0.01, f"{s}.eval_epsilon must be in [0, 0.01], got {self.eval_epsilon}"),
        )
        return replay_section_problems(self, s, num_envs) + [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class ImpalaConfig:
    """IMPALA (Espeholt et al. 2018): an actor-critic trained on the actors' unrolls as they
    come, V-trace correcting for the policy lag. The defaults are those of the small-task
    presets (a CartPole, a memory task, Acrobot), not the paper's Atari values."""

    lr: float = 1e-3
    """Learning rate."""
    adam_eps: float = 1.5e-4
    """Adam epsilon (optimizer: adam)."""
    gamma: float = 0.99
    """Discount factor."""
    grad_clip: float = 40.0
    """Maximum gradient norm (the paper's 40)."""
    publish_interval: int = 1
    """Updates between weight broadcasts to the actors (every update: the fresher the
    behaviour policy, the less V-trace has to correct)."""
    weights_update_steps: int = 10
    """Vector steps of an actor between looks for newer weights (never blocks)."""
    unroll_length: int = 20
    """Steps per unroll (T); consecutive unrolls share their bootstrap step."""
    batch_unrolls: int = 32
    """Unrolls per update (B)."""
    queue_size: int = 128
    """Unrolls the learner holds waiting to be trained on."""
    queue_policy: str = "block"
    """When the queue is full: ``block`` (actors wait) or ``drop_oldest`` (counted)."""
    rho_bar: float = 1.0
    """V-trace truncation of the importance weights in the value targets and advantages."""
    c_bar: float = 1.0
    """V-trace truncation of the traces."""
    baseline_cost: float = 0.5
    """Weight of the baseline loss (vs - V)^2 / 2."""
    entropy_cost: float = 0.01
    """Weight of the entropy bonus."""
    normalize_advantages: bool | str = "auto"
    """Scale each batch's (APPO: minibatch's) policy-gradient advantages to mean 0 and
    standard deviation 1, as PPO's reference implementations and Sample Factory do.
    ``auto``: on for continuous (Box) actions, off for discrete ones. A continuous policy
    needs it: where the actors' policy lags the learner's, the Gaussian's log-std gradient
    A (z^2 - 1) has z^2 above 1 on average, and the advantages' mean (a baseline still
    behind) then walks the log-std to its clamp (apex-test/Reach-v0: no learning in 60 s
    without it). On CartPole (3 seeds, 2 actors) APPO took 22-54 s to 475 without it and
    40-60 s with it, and cartpole_appo 10-11 s against 38-55 s (its near-zero late
    advantages scaled up to noise)."""
    optimizer: str = "adam"
    """``adam`` (what the small-task presets use) or ``rmsprop`` (as in the paper, and the
    Pong preset)."""
    rmsprop_alpha: float = 0.99
    """RMSProp decay."""
    rmsprop_eps: float = 0.01
    """RMSProp epsilon (the paper's 0.01)."""

    def problems(self) -> list[str]:
        """Every value out of range."""
        s = "impala"
        checks = (
            (self.lr > 0, f"{s}.lr must be > 0, got {self.lr}"),
            (self.adam_eps > 0, f"{s}.adam_eps must be > 0, got {self.adam_eps}"),
            (0 <= self.gamma <= 1, f"{s}.gamma must be in [0, 1], got {self.gamma}"),
            (self.grad_clip > 0, f"{s}.grad_clip must be > 0, got {self.grad_clip}"),
            (self.publish_interval >= 1, f"{s}.publish_interval must be >= 1, got {self.publish_interval}"),
            (
                self.weights_update_steps >= 1,
                f"{s}.weights_update_steps must be >= 1, got {self.weights_update_steps}",
            ),
            (
                1 <= self.unroll_length <= MAX_UNROLL_LENGTH,
                f"{s}.unroll_length must be in 1..{MAX_UNROLL_LENGTH}, got {self.unroll_length}",
            ),
            (self.batch_unrolls >= 1, f"{s}.batch_unrolls must be >= 1, got {self.batch_unrolls}"),
            (
                self.queue_size >= self.batch_unrolls,
                f"{s}.queue_size must be >= {s}.batch_unrolls ({self.batch_unrolls}), got {self.queue_size}",
            ),
            (
                self.normalize_advantages in (True, False, "auto"),
                f"{s}.normalize_advantages must be true, false or auto, got {self.normalize_advantages!r}",
            ),
            (
                self.queue_policy in ("block", "drop_oldest"),
                f"{s}.queue_policy must be block or drop_oldest, got {self.queue_policy!r}",
            ),
            (
                self.rho_bar > 0 and self.c_bar > 0,
                f"{s}.rho_bar and {s}.c_bar must be > 0, got {self.rho_bar}, {self.c_bar}",
            ),
            (
                self.baseline_cost >= 0 and self.entropy_cost >= 0,
                f"{s}.baseline_cost and {s}.entropy_cost must be >= 0",
            ),
            (
                self.optimizer in ("rmsprop", "adam"),
                f"{s}.optimizer must be adam or rmsprop, got {self.optimizer!r}",
            ),
        )
        return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class AppoConfig:
    """APPO (asynchronous PPO; Luo et al. 2020, "IMPACT"): IMPALA's actors, unrolls and learner
    (everything of the ``impala`` section: unrolls, batch, queue, optimizer, gamma, V-trace's
    truncation, costs, publishing) with PPO's clipped surrogate against a target ("old")
    policy network, several passes over each batch and unrolls reused from a circular buffer."""

    clip: float = 0.2
    """The surrogate's clip: the ratio pi / pi_old is held within [1 - clip, 1 + clip]."""
    target_update_every: int = 2
    """Updates (optimizer steps) between copies of the network into the target network, the
    pi_old of the ratio and of V-trace (2: once a batch with the default epochs and
    minibatches, as PPO)."""
    kl_coeff: float = 0.0
    """Weight of the KL(pi_old || pi) penalty (0: none; the clip alone holds the step)."""
    kl_target: float | None = 0.01
    """With a KL penalty: the KL its weight adapts to (doubled above twice this, halved below
    half of it, as PPO's adaptive penalty); null: the weight stays kl_coeff."""
    advantages: str = "vtrace"
    """``vtrace``: V-trace advantages against pi_old, corrected for the actors' lag (IMPACT);
    ``gae``: generalized advantage estimation on the network's values, uncorrected (Sample
    Factory's with_vtrace: false)."""
    gae_lambda: float = 0.95
    """GAE's lambda (advantages: gae)."""
    value_clip: float | None = None
    """PPO's value clipping: the new value is held within this of the target network's, and
    the larger of the two errors is taken (null: no clipping). In units of the return."""
    epochs: int = 1
    """Passes over each batch (more: more updates a batch, and a policy lag as many times
    longer in updates; on CartPole with 2 actors, 2 passes let the policy collapse)."""
    minibatches: int = 2
    """Minibatches (of unrolls) each pass splits a batch into: an update each."""
    replay_ratio: int = 2
    """Batches each unroll may be part of: above 1, a batch is topped up from the circular
    buffer of unrolls already trained on (uniformly) when too few new ones wait, and an unroll
    leaves the buffer after this many (impala.queue_size bounds the buffer). 2 (issue 47, 3
    seeds, 2 actors): apex-test/Reach-v0 to 0 in a median 52k env steps against 67k at 1;
    CartPole's defaults to 475 in 10-19 s either way. The presets say theirs."""

    def problems(self, batch_unrolls: int) -> list[str]:
        """Every value out of range."""
        s = "appo"
        checks = (
            (0 < self.clip < 1, f"{s}.clip must be in (0, 1), got {self.clip}"),
            (self.target_update_every >= 1, f"{s}.target_update_every must be >= 1, got {self.target_update_every}"),
            (self.kl_coeff >= 0, f"{s}.kl_coeff must be >= 0, got {self.kl_coeff}"),
            (
                self.kl_target is None or self.kl_target > 0,
                f"{s}.kl_target must be > 0 or null (a fixed kl_coeff), got {self.kl_target}",
            ),
            (self.advantages in ("vtrace", "gae"), f"{s}.advantages must be vtrace or gae, got {self.advantages!r}"),
            (0 <= self.gae_lambda <= 1, f"{s}.gae_lambda must be in [0, 1], got {self.gae_lambda}"),
            (
                self.value_clip is None or self.value_clip > 0,
                f"{s}.value_clip must be > 0 or null (no clipping), got {self.value_clip}",
            ),
            (1 <= self.epochs <= 100, f"{s}.epochs must be in 1..100, got {self.epochs}"),
            (
                1 <= self.minibatches <= batch_unrolls,
                f"{s}.minibatches must be in 1..impala.batch_unrolls ({batch_unrolls}), got {self.minibatches}",
            ),
            (1 <= self.replay_ratio <= 100, f"{s}.replay_ratio must be in 1..100, got {self.replay_ratio}"),
        )
        return [message for ok, message in checks if not ok]


# Every algorithm's section has lr, gamma, grad_clip, publish_interval and weights_update_steps
# (APPO's are in `impala`).
AlgoConfig = ApexDqnConfig | ImpalaConfig
