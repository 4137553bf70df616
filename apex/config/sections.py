"""The configuration tree: one frozen dataclass a section, with its defaults (the embedded
CartPole Ape-X run) and its range checks (``problems``, all collected by ``Config.validate``);
the algorithms' own sections are in ``apex.config.algorithms``."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from apex.config.algorithms import AlgoConfig, ApexDqnConfig, AppoConfig, ImpalaConfig
from apex.config.apex_ddpg import ApexDdpgConfig
from apex.config.multi_agent import MultiAgentConfig
from apex.config.network import ServeConfig, TransportConfig
from apex.core import ALGO_SECTIONS, ALGOS, FACTS
from apex.core.facts import MODEL_CORES, WITHOUT_REPLAY, accepting_core
from apex.errors import ConfigError
from apex.system.files import write_atomic

ATARI_PREFIX = "ALE/"  # ids of the Arcade Learning Environment

# Sizes an actor allocates from a config it may have been sent (a learner's welcome): each is
# bounded, so that a forged config is one line, not an allocation of terabytes or a traceback.
MAX_ENVS_PER_ACTOR = 4096
MAX_FRAME_STACK = 64
MAX_HIDDEN_LAYERS, MAX_HIDDEN_UNITS = 16, 8192  # 256 MiB of float32 weights a layer at most
MAX_LSTM_SIZE = 4096


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
    does); ``ALE/...`` ids get the standard Atari preprocessing. A PettingZoo environment is
    ``module:attr``: a PettingZoo module (``pettingzoo.classic:tictactoe_v3``) or a callable
    returning a ParallelEnv or AECEnv (see the multi_agent section)."""
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
    normalize_reward: bool | str = "auto"
    """IMPALA and APPO: divide training rewards (after reward_scale) by a running standard
    deviation of the discounted return, each actor its own (as VecNormalize), clipped to
    +-10; reported returns stay as the environment gives them. ``auto``: on for continuous
    (Box) actions, off for discrete ones (their presets were tuned without it). Ape-X keeps
    it off: its replay would mix rewards scaled at different times (use reward_scale)."""

    @property
    def is_atari(self) -> bool:
        """An ALE id: made with the Atari preprocessing, rewards clipped if clip_rewards."""
        return self.id.startswith(ATARI_PREFIX)

    def problems(self) -> list[str]:
        checks = [
            (bool(self.id), "env.id must name a Gymnasium environment"),
            (
                all(isinstance(m, str) and m for m in self.imports),
                f"env.imports must be a list of module names, got {self.imports!r}",
            ),
            *(
                (wrapper_problem(wrapper) is None, f"env.wrappers[{i}]: {wrapper_problem(wrapper)}")
                for i, wrapper in enumerate(self.wrappers)
            ),
            *(
                (
                    all(part.isidentifier() for part in module.split(".")),
                    f"env.allow_imports[{i}] must be a module name such as mypackage.envs, got {module!r}",
                )
                for i, module in enumerate(self.allow_imports)
            ),
            (
                1 <= self.frame_stack <= MAX_FRAME_STACK,
                f"env.frame_stack must be in 1..{MAX_FRAME_STACK}, got {self.frame_stack}",
            ),
            (self.frame_skip >= 1, f"env.frame_skip must be >= 1, got {self.frame_skip}"),
            (
                math.isfinite(self.reward_scale) and self.reward_scale > 0,
                f"env.reward_scale must be a positive number, got {self.reward_scale}",
            ),
            (
                self.max_episode_steps is None or self.max_episode_steps >= 1,
                f"env.max_episode_steps must be >= 1 or null, got {self.max_episode_steps}",
            ),
            (
                self.normalize_reward in (True, False, "auto"),
                f"env.normalize_reward must be true, false or auto, got {self.normalize_reward!r}",
            ),
            (
                self.action_bounds in ("clip", "squash"),
                f"env.action_bounds must be clip or squash, got {self.action_bounds!r}",
            ),
        ]
        return [message for ok, message in checks if not ok]


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

    def problems(self, algo: str) -> list[str]:
        checks = (
            (
                len(self.hidden) <= MAX_HIDDEN_LAYERS and all(1 <= h <= MAX_HIDDEN_UNITS for h in self.hidden),
                f"model.hidden must be at most {MAX_HIDDEN_LAYERS} sizes in 1..{MAX_HIDDEN_UNITS}, got {self.hidden}",
            ),
            (
                self.recurrent in MODEL_CORES,
                f"model.recurrent must be one of {', '.join(MODEL_CORES)}, got {self.recurrent!r}",
            ),
            (
                1 <= self.lstm_size <= MAX_LSTM_SIZE,
                f"model.lstm_size must be in 1..{MAX_LSTM_SIZE}, got {self.lstm_size}",
            ),
        )
        problems = [message for ok, message in checks if not ok]
        accepting = accepting_core(self.recurrent)
        if algo in FACTS and self.recurrent in MODEL_CORES and algo not in accepting:
            others = [FACTS[name].title for name in FACTS if name not in accepting]
            problems.append(
                f"model.recurrent {self.recurrent} needs algo {' or '.join(accepting)} ({' and '.join(others)} "
                f"take no {self.recurrent} core): use --algo {accepting[0]} or model.recurrent: none"
            )
        return problems


@dataclass(frozen=True)
class LearnerConfig:
    """The learner process, whatever the algorithm (its hyperparameters are in the
    algorithm's own section)."""

    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    torch_threads: int = 1
    """CPU threads for the learner's torch operations."""
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

    def problems(self) -> list[str]:
        checks = (
            (
                self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                f"learner.device must be auto, cpu or cuda[:N], got {self.device!r}",
            ),
            (self.torch_threads >= 1, f"learner.torch_threads must be >= 1, got {self.torch_threads}"),
            (
                0 < self.metrics_interval_s <= 5,
                f"learner.metrics_interval_s must be in (0, 5], got {self.metrics_interval_s}",
            ),
            (
                self.checkpoint_interval_s > 0,
                f"learner.checkpoint_interval_s must be > 0, got {self.checkpoint_interval_s}",
            ),
            (
                self.checkpoint_interval_updates >= 0,
                "learner.checkpoint_interval_updates must be >= 0 (0: by time only), "
                f"got {self.checkpoint_interval_updates}",
            ),
            (
                self.best_checkpoint_interval_s >= 0,
                f"learner.best_checkpoint_interval_s must be >= 0 (0: off), got {self.best_checkpoint_interval_s}",
            ),
            (self.keep_checkpoints >= 1, f"learner.keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
        )
        return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class ActorConfig:
    """The actor processes, whatever the algorithm."""

    num_envs: int = 16
    """Environments each actor process steps together."""

    def problems(self) -> list[str]:
        if 1 <= self.num_envs <= MAX_ENVS_PER_ACTOR:
            return []
        return [f"actor.num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {self.num_envs}"]


TRACKERS = ("wandb", "mlflow")


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run's figures go beside LOGDIR/metrics.jsonl and TensorBoard."""

    track: list[str] = field(default_factory=list)
    """Experiment trackers (``--track``, repeatable): ``wandb`` (offline unless logged in),
    ``mlflow`` (to MLFLOW_TRACKING_URI); each an optional extra of that name."""
    project: str = "apex"
    """The W&B project and the MLflow experiment the run is logged to."""

    def problems(self) -> list[str]:
        names = self.track
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return [f"logging.track must be a list of tracker names ({', '.join(TRACKERS)}), got {names!r}"]
        unknown = [n for n in names if n not in TRACKERS]
        problems = [f"logging.track: unknown tracker {n!r}; choose among {', '.join(TRACKERS)}" for n in unknown]
        if len(set(names)) != len(names):
            problems.append(f"logging.track names a tracker twice: {names}")
        # A tracker may make a directory or a path of it: a plain name, never a path.
        if not (isinstance(self.project, str) and re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}", self.project)):
            problems.append(
                "logging.project must be a plain name of 1 to 128 letters, digits, '_', '-' or '.' "
                f"(not starting with '.'), got {str(self.project)[:200]!r}"
            )
        return problems


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
    """``apex_dqn``, ``impala``, ``appo`` or ``apex_ddpg``: its hyperparameters are in the
    section of that name (APPO's: ``impala`` and ``appo``)."""
    seed: int = 0
    """Seed for the learner and (offset by actor and env index) the actors."""
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    apex_dqn: ApexDqnConfig = field(default_factory=ApexDqnConfig)
    impala: ImpalaConfig = field(default_factory=ImpalaConfig)
    appo: AppoConfig = field(default_factory=AppoConfig)
    apex_ddpg: ApexDdpgConfig = field(default_factory=ApexDdpgConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    multi_agent: MultiAgentConfig = field(default_factory=MultiAgentConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def algo_config(self) -> AlgoConfig | ApexDdpgConfig:
        """The section of the run's algorithm (its lr, gamma, grad_clip, publish_interval,
        weights_update_steps, and its own settings)."""
        section: AlgoConfig | ApexDdpgConfig = getattr(self, ALGO_SECTIONS.get(self.algo, ("apex_dqn",))[0])
        return section

    def validate(self) -> None:
        """Raises one ConfigError listing every value out of range."""
        problems = [
            *([] if self.algo in ALGOS else [f"algo must be one of {ALGOS}, got {self.algo!r}"]),
            *([] if 0 <= self.seed < 2**32 else [f"seed must be in 0..2**32-1, got {self.seed}"]),
            *self.env.problems(),
            *self.model.problems(self.algo),
            *self.learner.problems(),
            *self.actor.problems(),
            *self.apex_dqn.problems(self.actor.num_envs),
            *self.impala.problems(),
            *self.appo.problems(self.impala.batch_unrolls),
            *self.apex_ddpg.problems(self.actor.num_envs if self.algo == "apex_ddpg" else None),
            *(
                [
                    "env.action_bounds squash would bound apex_ddpg's actions twice (its policy is a tanh into the "
                    "bounds already): use env.action_bounds: clip"
                ]
                if self.algo == "apex_ddpg" and self.env.action_bounds == "squash"
                else []
            ),
            *(
                [
                    f"env.normalize_reward true needs algo {' or '.join(WITHOUT_REPLAY)} "
                    f"({self.algo} keeps rewards in its replay): use env.reward_scale to bring its rewards near 1"
                ]
                if self.algo in FACTS and FACTS[self.algo].replay and self.env.normalize_reward is True
                else []
            ),
            *self.transport.problems(),
            *self.serve.problems(),
            *self.multi_agent.problems(),
            *self.logging.problems(),
        ]
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
        text = yaml.safe_dump(self.to_dict(), sort_keys=False).encode()
        write_atomic(Path(path), lambda f: f.write(text))
        return Path(path)
