"""The configuration tree: one frozen dataclass a section, with its defaults (the embedded
CartPole Ape-X run) and the range checks of ``Config.validate``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from apex.core import ALGOS
from apex.errors import ConfigError

ATARI_PREFIX = "ALE/"  # ids of the Arcade Learning Environment

# Sizes an actor allocates from a config it may have been sent (a learner's welcome): each is
# bounded, so that a forged config is one line, not an allocation of terabytes or a traceback.
MAX_ENVS_PER_ACTOR = 4096
MAX_FRAME_STACK = 64
MAX_HIDDEN_LAYERS, MAX_HIDDEN_UNITS = 16, 8192  # 256 MiB of float32 weights a layer at most
MAX_LSTM_SIZE = 4096
MAX_CHUNK_TRANSITIONS = 100_000
MAX_UNROLL_LENGTH = 10_000


def wrapper_problem(wrapper: Any) -> str | None:
    """What is wrong with one env.wrappers item, or None (its import is checked where the
    environment is made)."""
    if isinstance(wrapper, str):
        return None if wrapper.strip() else "an empty name"
    if isinstance(wrapper, dict):
        unknown = set(wrapper) - {"type", "kwargs"}
        if unknown:
            return (
                f"unknown keys {sorted(unknown)}: a wrapper is a dotted path or {{type: dotted.path, kwargs: {{...}}}}"
            )
        if not isinstance(wrapper.get("type"), str) or not wrapper["type"]:
            return "a mapping needs type: dotted.path.to.Wrapper"
        if not isinstance(wrapper.get("kwargs", {}), dict):
            return f"kwargs must be a mapping, got {wrapper['kwargs']!r}"
        return None
    return f"a dotted path or {{type: dotted.path, kwargs: {{...}}}}, got {wrapper!r}"


@dataclass(frozen=True)
class EnvConfig:
    id: str = "CartPole-v1"
    """Any Gymnasium id, or ``module:EnvId`` (the module is imported first, as gym.make
    does); ``ALE/...`` ids get the standard Atari preprocessing."""
    imports: list[str] = field(default_factory=list)
    """Modules imported before the environment is made, in the learner and in every actor
    (e.g. the one that registers your ids); each must be importable on every actor host."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for gym.make (plain YAML values)."""
    wrappers: list[Any] = field(default_factory=list)
    """Applied in order after gym.make: each a dotted path to a wrapper class or any callable
    taking an env (``gymnasium.wrappers.TimeAwareObservation``, ``mymod:wrap``), or a mapping
    ``{type: dotted.path, kwargs: {...}}``."""
    allow_imports: list[str] = field(default_factory=list)
    """Modules (and their submodules) that a config from elsewhere may make this process
    import: the one in a learner's welcome (apex actor, apex serve) or in a checkpoint (apex
    eval, a resume without --config). Read from the local config only (as --allow-import);
    the one inside a config from elsewhere is ignored. The modules a local config names
    itself (an actor's --config, as apex run gives its actors) are allowed without it."""
    max_episode_steps: int | None = None
    """Truncate episodes after this many steps (None: the environment's own limit)."""
    frame_stack: int = 4
    """Image observations (Atari and any other): frames stacked into one observation, each
    frame sent and stored once (vector observations are not stacked)."""
    frame_skip: int = 4
    """Atari: emulator frames per action (max-pooled over the last two)."""
    noop_max: int = 30
    """Atari: up to this many no-op actions after a reset."""
    terminal_on_life_loss: bool = False
    """Atari: end training episodes when a life is lost (off, as in recent practice)."""
    clip_rewards: bool = True
    """Atari: train on the sign of the reward; reported returns stay unclipped."""
    action_bounds: str = "clip"
    """Continuous (Box) actions, IMPALA: how the Gaussian policy's sample u reaches the
    environment's bounds, ``clip`` (clip(u, low, high)) or ``squash`` (low + (tanh(u) + 1)
    (high - low) / 2; finite bounds only). Either way batches carry u and log N(u): the
    ratios V-trace needs do not depend on the mapping."""
    reward_scale: float = 1.0
    """Training rewards are multiplied by this (after any clipping); reported returns stay
    as the environment gives them. Keeps values near 1 where rewards are large or many
    (Acrobot's -1 a step for 500 steps: values near -100, which a shared IMPALA torso fits
    at the policy's expense)."""

    @property
    def is_atari(self) -> bool:
        """An ALE id: made with the Atari preprocessing, rewards clipped if clip_rewards."""
        return self.id.startswith(ATARI_PREFIX)


@dataclass(frozen=True)
class ModelConfig:
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    """MLP hidden layer sizes for vector observations (images get a conv torso sized to the
    input: the Nature CNN from 64 pixels)."""
    dueling: bool = True
    """Dueling value/advantage heads (Wang et al. 2016)."""
    recurrent: str = "none"
    """IMPALA: ``lstm`` puts an LSTM core between the torso and the policy and value heads
    (memory for partially observed tasks); ``none``: feed-forward."""
    lstm_size: int = 128
    """Units of the LSTM core (model.recurrent: lstm)."""


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
    samples_per_insert: float = 4.0
    """Target ratio of sampled to inserted transitions (Reverb's SampleToInsertRatio)."""
    rate_slack: int = 20_000
    """How far, in samples, either side may run ahead of that ratio before it waits."""
    frame_capacity: int | None = None
    """Frames kept for stacked observations (None: capacity + an eighth + 4096)."""


@dataclass(frozen=True)
class LearnerConfig:
    batch_size: int = 256
    """Transitions per update."""
    lr: float = 2e-3
    """Adam learning rate."""
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
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    torch_threads: int = 1
    """CPU threads for the learner's torch operations."""
    prefetch_batches: int | None = None
    """Ape-X: batches the prefetch thread keeps staged ahead of training; once half are used it
    samples the missing ones together (one stratified draw, each batch spread over the whole
    replay) and writes back the priorities of the steps trained since, together. More: less of
    that thread's work per step, paid in GIL hand-overs to the training thread (on 2 cores,
    MLP at batch 512: 0.87-0.90 of the update-alone rate with 8, 0.92 with 16, 0.94 with 32,
    0.95-0.96 with 64), and batches drawn with priorities up to this many steps old. None: as
    many as 256 MiB of staged batches hold, 2 to 64 (64 for CartPole's batches of 512, 9 for
    Atari's, 29 MiB each). IMPALA stages one batch ahead (its unrolls' age is its policy lag)."""
    metrics_interval_s: float = 2.0
    """Seconds between lines of metrics.jsonl (and console status lines)."""
    checkpoint_interval_s: float = 600.0
    """Seconds between periodic checkpoints (one is always written at stop)."""
    checkpoint_interval_updates: int = 0
    """Updates between periodic checkpoints as well (0: by time only)."""
    best_checkpoint_interval_s: float = 120.0
    """Least seconds between the checkpoints written because return_mean_100 (over a full
    window of 100 evaluation episodes) reached a new best (0: only the periodic ones)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept in LOGDIR/checkpoints, and the best by return_mean_100
    beside them; older ones are deleted."""
    checkpoint_replay: bool = True
    """Ape-X: save the replay contents with their priorities in every checkpoint, so that a
    resumed run does not start from an empty replay (IMPALA keeps no replay)."""


@dataclass(frozen=True)
class ActorConfig:
    num_envs: int = 16
    """Environments each actor process steps together."""
    eps_base: float = 0.4
    """Ape-X ladder: eps = eps_base ** (1 + eps_alpha * u), u in [0, 1] spread over every
    exploring environment of the actors that join (however many; see docs/running.md, "Exploration")."""
    eps_alpha: float = 7.0
    """Ape-X ladder exponent."""
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
    weights_update_steps: int = 50
    """Vector steps between looks for newer weights (never blocks)."""


@dataclass(frozen=True)
class ImpalaConfig:
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
    optimizer: str = "rmsprop"
    """``rmsprop`` (as in the paper) or ``adam``; learning rate from learner.lr."""
    rmsprop_alpha: float = 0.99
    """RMSProp decay."""
    rmsprop_eps: float = 0.01
    """RMSProp epsilon (the paper's 0.01)."""


DEFAULT_PORT = 5550


def port_problem(port: int) -> str | None:
    """Why ``port`` cannot be a learner's base port (it uses port+1 and port+2 too), or None."""
    if not 1 <= port <= 65533:
        return f"port must be in 1..65533 (the learner also uses port+1 and port+2), got {port}"
    return None


@dataclass(frozen=True)
class TransportConfig:
    """The transport settings of both ends (the learner's, and those an actor is started with)."""

    port: int = DEFAULT_PORT
    """Learner control port; trajectories use port+1 and weights port+2."""
    trajectory_hwm: int = 4
    """Batches an actor may queue before sending blocks (ZeroMQ high-water mark)."""
    trajectory_buffer_bytes: int = 32 * 1024
    """Kernel socket buffer of the trajectory stream on each side; small, so queued batches
    stay fresh (the high-water mark counts messages, and the kernel's own megabytes would hold
    hundreds of small batches that then reach a throttled learner seconds stale)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which a peer counts as gone."""
    curve_dir: str | None = None
    """Directory from ``apex keygen``: encrypt and authenticate every socket."""
    give_up_after_s: float = 600.0
    """Seconds an actor keeps reconnecting to a silent learner before it exits with an
    error (0: forever). Long enough for a learner to be restarted and load its replay."""
    max_abs_reward: float = 1e6
    """Largest reward magnitude the learner accepts in a batch (per step; an Ape-X n-step
    return may reach n times it); a batch with a larger one is rejected and counted."""
    max_abs_obs: float | None = None
    """Largest magnitude of an observation value that the learner accepts in a batch and
    apex serve from a client (a batch or request with a larger one is refused and counted).
    None: each value's own bound where the observation space gives a finite one, 1e6 where it
    does not (finite alone is no defence: 1e30 poisons the updates it is sampled into)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest trajectory message the learner accepts (ZMQ_MAXMSGSIZE on its socket). An
    actor whose batches could be larger (too many environments for the frame size) is
    refused at its hello with a message naming this setting."""


@dataclass(frozen=True)
class ServeConfig:
    """`apex serve`'s own limits (its --config and --set serve.*; a learner's are unused)."""

    max_connections: int = 1024
    """HTTP connections open at once; one more is answered 503 and closed (counted)."""
    idle_timeout_s: float = 30.0
    """An HTTP connection that starts no request for this long, or sends a body more slowly
    than within it, is closed (counted)."""
    max_body_bytes_in_flight: int = 8 * 1024 * 1024
    """Request bytes (by Content-Length) that the HTTP connections may hold at once, all
    together; a request past it is answered 503 (counted). At least one body of the largest
    size the environment's observations need is always let in."""


@dataclass(frozen=True)
class StopConditions:
    """When `apex learner` / `apex run` stop (None: never by this one)."""

    return_mean: float | None = None
    seconds: float | None = None
    env_steps: int | None = None

    def validate(self) -> None:
        """ConfigError for a limit that is not positive (named as flag and as keyword)."""
        for name, value in (("seconds", self.seconds), ("env_steps", self.env_steps)):
            if value is not None and value <= 0:
                raise ConfigError(f"--stop-{name.replace('_', '-')} (stop_{name}) must be positive, got {value}")


@dataclass(frozen=True)
class Config:
    algo: str = "apex_dqn"
    """``apex_dqn`` or ``impala``."""
    seed: int = 0
    """Seed for the learner and (offset by actor and env index) the actors."""
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    impala: ImpalaConfig = field(default_factory=ImpalaConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def frame_capacity(self) -> int:
        if self.replay.frame_capacity is not None:
            return self.replay.frame_capacity
        return self.replay.capacity + self.replay.capacity // 8 + 4096

    def validate(self) -> None:
        """Raises one ConfigError listing every value out of range."""
        problems = []

        def check(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        check(self.algo in ALGOS, f"algo must be one of {ALGOS}, got {self.algo!r}")
        check(0 <= self.seed < 2**32, f"seed must be in 0..2**32-1, got {self.seed}")
        check(bool(self.env.id), "env.id must name a Gymnasium environment")
        check(
            all(isinstance(m, str) and m for m in self.env.imports),
            f"env.imports must be a list of module names, got {self.env.imports!r}",
        )
        for i, wrapper in enumerate(self.env.wrappers):
            problem = wrapper_problem(wrapper)
            check(problem is None, f"env.wrappers[{i}]: {problem}")
        for i, module in enumerate(self.env.allow_imports):
            check(
                all(part.isidentifier() for part in module.split(".")),
                f"env.allow_imports[{i}] must be a module name such as mypackage.envs, got {module!r}",
            )
        check(
            1 <= self.env.frame_stack <= MAX_FRAME_STACK,
            f"env.frame_stack must be in 1..{MAX_FRAME_STACK}, got {self.env.frame_stack}",
        )
        check(self.env.frame_skip >= 1, f"env.frame_skip must be >= 1, got {self.env.frame_skip}")
        check(
            math.isfinite(self.env.reward_scale) and self.env.reward_scale > 0,
            f"env.reward_scale must be a positive number, got {self.env.reward_scale}",
        )
        check(
            self.env.max_episode_steps is None or self.env.max_episode_steps >= 1,
            f"env.max_episode_steps must be >= 1 or null, got {self.env.max_episode_steps}",
        )
        check(
            self.env.action_bounds in ("clip", "squash"),
            f"env.action_bounds must be clip or squash, got {self.env.action_bounds!r}",
        )
        check(
            len(self.model.hidden) <= MAX_HIDDEN_LAYERS and all(1 <= h <= MAX_HIDDEN_UNITS for h in self.model.hidden),
            f"model.hidden must be at most {MAX_HIDDEN_LAYERS} sizes in 1..{MAX_HIDDEN_UNITS}, got {self.model.hidden}",
        )
        check(
            self.model.recurrent in ("none", "lstm"),
            f"model.recurrent must be none or lstm, got {self.model.recurrent!r}",
        )
        check(
            1 <= self.model.lstm_size <= MAX_LSTM_SIZE,
            f"model.lstm_size must be in 1..{MAX_LSTM_SIZE}, got {self.model.lstm_size}",
        )
        check(
            self.model.recurrent == "none" or self.algo == "impala",
            f"model.recurrent {self.model.recurrent} needs algo impala (Ape-X DQN is feed-forward): "
            "use --algo impala or model.recurrent: none",
        )
        r = self.replay
        check(r.capacity >= 1, f"replay.capacity must be a positive integer, got {r.capacity}")
        check(r.alpha >= 0, f"replay.alpha must be >= 0, got {r.alpha}")
        check(r.beta >= 0, f"replay.beta must be >= 0, got {r.beta}")
        check(r.eps > 0, f"replay.eps must be > 0, got {r.eps}")
        check(
            1 <= r.min_size <= r.capacity,
            f"replay.min_size must be in 1..replay.capacity ({r.capacity}), got {r.min_size}",
        )
        check(r.samples_per_insert > 0, f"replay.samples_per_insert must be > 0, got {r.samples_per_insert}")
        check(
            r.rate_slack >= self.learner.batch_size,
            f"replay.rate_slack must be >= learner.batch_size ({self.learner.batch_size}), got {r.rate_slack}",
        )
        check(
            r.frame_capacity is None or r.frame_capacity >= 1024,
            f"replay.frame_capacity must be >= 1024 or null, got {r.frame_capacity}",
        )
        lr = self.learner
        check(lr.batch_size >= 1, f"learner.batch_size must be >= 1, got {lr.batch_size}")
        check(lr.lr > 0, f"learner.lr must be > 0, got {lr.lr}")
        check(lr.adam_eps > 0, f"learner.adam_eps must be > 0, got {lr.adam_eps}")
        check(0 <= lr.gamma <= 1, f"learner.gamma must be in [0, 1], got {lr.gamma}")
        check(lr.n_step >= 1, f"learner.n_step must be >= 1, got {lr.n_step}")
        check(
            lr.target_update_interval >= 1,
            f"learner.target_update_interval must be >= 1, got {lr.target_update_interval}",
        )
        check(lr.grad_clip > 0, f"learner.grad_clip must be > 0, got {lr.grad_clip}")
        check(lr.publish_interval >= 1, f"learner.publish_interval must be >= 1, got {lr.publish_interval}")
        check(
            lr.device == "auto" or lr.device == "cpu" or lr.device.startswith("cuda"),
            f"learner.device must be auto, cpu or cuda[:N], got {lr.device!r}",
        )
        check(lr.torch_threads >= 1, f"learner.torch_threads must be >= 1, got {lr.torch_threads}")
        check(
            lr.prefetch_batches is None or 1 <= lr.prefetch_batches <= 64,
            f"learner.prefetch_batches must be in 1..64 or null (sized by memory), got {lr.prefetch_batches}",
        )
        check(
            0 < lr.metrics_interval_s <= 5, f"learner.metrics_interval_s must be in (0, 5], got {lr.metrics_interval_s}"
        )
        check(
            lr.checkpoint_interval_s > 0, f"learner.checkpoint_interval_s must be > 0, got {lr.checkpoint_interval_s}"
        )
        check(
            lr.checkpoint_interval_updates >= 0,
            f"learner.checkpoint_interval_updates must be >= 0 (0: by time only), got {lr.checkpoint_interval_updates}",
        )
        check(
            lr.best_checkpoint_interval_s >= 0,
            f"learner.best_checkpoint_interval_s must be >= 0 (0: off), got {lr.best_checkpoint_interval_s}",
        )
        check(lr.keep_checkpoints >= 1, f"learner.keep_checkpoints must be >= 1, got {lr.keep_checkpoints}")
        a = self.actor
        check(
            1 <= a.num_envs <= MAX_ENVS_PER_ACTOR,
            f"actor.num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {a.num_envs}",
        )
        check(0 < a.eps_base <= 1, f"actor.eps_base must be in (0, 1], got {a.eps_base}")
        check(a.eps_alpha >= 0, f"actor.eps_alpha must be >= 0, got {a.eps_alpha}")
        check(
            a.eps_repeat_mu is None or 1 < a.eps_repeat_mu < math.inf,
            f"actor.eps_repeat_mu must be > 1 (a zeta exponent; 2.0 is the paper's) or null, got {a.eps_repeat_mu}",
        )
        check(
            0 <= a.eval_envs <= a.num_envs,
            f"actor.eval_envs must be in 0..actor.num_envs ({a.num_envs}), got {a.eval_envs}"
            + (
                f": with {a.num_envs} environments per actor also set actor.eval_envs (e.g. --set actor.eval_envs=0)"
                if a.eval_envs > a.num_envs
                else ""
            ),
        )
        check(0 <= a.eval_epsilon <= 0.01, f"actor.eval_epsilon must be in [0, 0.01], got {a.eval_epsilon}")
        check(
            1 <= a.chunk_transitions <= MAX_CHUNK_TRANSITIONS,
            f"actor.chunk_transitions must be in 1..{MAX_CHUNK_TRANSITIONS}, got {a.chunk_transitions}",
        )
        check(a.weights_update_steps >= 1, f"actor.weights_update_steps must be >= 1, got {a.weights_update_steps}")
        im = self.impala
        check(
            1 <= im.unroll_length <= MAX_UNROLL_LENGTH,
            f"impala.unroll_length must be in 1..{MAX_UNROLL_LENGTH}, got {im.unroll_length}",
        )
        check(im.batch_unrolls >= 1, f"impala.batch_unrolls must be >= 1, got {im.batch_unrolls}")
        check(
            im.queue_size >= im.batch_unrolls,
            f"impala.queue_size must be >= impala.batch_unrolls ({im.batch_unrolls}), got {im.queue_size}",
        )
        check(
            im.queue_policy in ("block", "drop_oldest"),
            f"impala.queue_policy must be block or drop_oldest, got {im.queue_policy!r}",
        )
        check(
            im.rho_bar > 0 and im.c_bar > 0,
            f"impala.rho_bar and impala.c_bar must be > 0, got {im.rho_bar}, {im.c_bar}",
        )
        check(
            im.baseline_cost >= 0 and im.entropy_cost >= 0, "impala.baseline_cost and impala.entropy_cost must be >= 0"
        )
        check(im.optimizer in ("rmsprop", "adam"), f"impala.optimizer must be rmsprop or adam, got {im.optimizer!r}")
        t = self.transport
        check(port_problem(t.port) is None, f"transport.{port_problem(t.port)}")
        check(t.trajectory_hwm >= 1, f"transport.trajectory_hwm must be >= 1, got {t.trajectory_hwm}")
        check(
            t.trajectory_buffer_bytes >= 4096,
            f"transport.trajectory_buffer_bytes must be >= 4096, got {t.trajectory_buffer_bytes}",
        )
        check(t.heartbeat_interval_s > 0, f"transport.heartbeat_interval_s must be > 0, got {t.heartbeat_interval_s}")
        check(
            t.heartbeat_timeout_s > t.heartbeat_interval_s,
            f"transport.heartbeat_timeout_s must exceed heartbeat_interval_s ({t.heartbeat_interval_s}), "
            f"got {t.heartbeat_timeout_s}",
        )
        check(
            t.give_up_after_s == 0 or t.give_up_after_s > t.heartbeat_timeout_s,
            f"transport.give_up_after_s must be 0 (never) or exceed heartbeat_timeout_s ({t.heartbeat_timeout_s}), "
            f"got {t.give_up_after_s}",
        )
        check(
            t.max_abs_reward > 0 and t.max_abs_reward < float("inf"),
            f"transport.max_abs_reward must be a positive finite number, got {t.max_abs_reward}",
        )
        check(
            t.max_abs_obs is None or 0 < t.max_abs_obs < float("inf"),
            f"transport.max_abs_obs must be a positive finite number or null (the space's bounds), got {t.max_abs_obs}",
        )
        check(
            t.max_message_bytes >= 1 << 20,
            f"transport.max_message_bytes must be >= 1048576 (1 MiB), got {t.max_message_bytes}",
        )
        sv = self.serve
        check(sv.max_connections >= 1, f"serve.max_connections must be >= 1, got {sv.max_connections}")
        check(0 < sv.idle_timeout_s <= 3600, f"serve.idle_timeout_s must be in (0, 3600], got {sv.idle_timeout_s}")
        check(
            sv.max_body_bytes_in_flight >= 1 << 16,
            f"serve.max_body_bytes_in_flight must be >= 65536 (64 KiB), got {sv.max_body_bytes_in_flight}",
        )
        if problems:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A fingerprint of every setting (the ranks of a learner group must agree on it)."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()

    def save(self, path: Path) -> Path:
        """Writes the config as YAML that ``load`` reads back (for child processes); never
        through a link planted at ``path``."""
        from apex.system.files import write_atomic

        text = yaml.safe_dump(self.to_dict(), sort_keys=False).encode()
        write_atomic(Path(path), lambda f: f.write(text))
        return Path(path)
