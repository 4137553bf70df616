"""The seam between the process shells and the algorithms: what the learner process calls on
a learner core, what the actor process and `apex serve` call on an actor core, the policy that
`apex eval` and ``apex.load_policy`` act with, and the two sides an algorithm registers
(``apex.algos.REGISTRY``). The shells take these as their annotations, so the type checker
proves that every algorithm fits them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # annotations only: the seam imports nothing of apex at run time
    import numpy as np
    import torch

    from apex.config import Config, ModelConfig
    from apex.core.episode import Episode
    from apex.envs.make import EnvSpec
    from apex.errors import ProtocolError
    from apex.replay import StackedReplay
    from apex.training.distributed import GradientAllReduce
    from apex.training.pipeline import Pending, Staged
    from apex.wire.protocol import Message
    from apex.wire.schema import BatchSchema


# A finished episode as actors report it to the learner: [return, length, is_eval].
EpisodeRecord = list[Any]


class TrainingCore(Protocol):
    """What the learner process, the pipeline and checkpoints call: no sockets, no files, no
    threads of its own. One algorithm's ``LearnerCore``, or several of them (one a policy of a
    multi-agent run: ``apex.multiagent.learner``)."""

    @property
    def updates(self) -> int: ...  # applied so far

    all_reduce: GradientAllReduce | None  # set by a data-parallel group: see optim.guarded_step
    samples_per_update: int

    @property
    def checkpoint_replay(self) -> StackedReplay | None: ...  # what checkpoints hold beside state_dict()

    # the algorithm's part of an actor's setup
    def actor_setup(self, actor_index: int, num_envs: int) -> dict[str, Any]: ...
    def wait_to_insert(self, timeout: float) -> bool: ...

    # The update in three stages (apex.training.pipeline): prefetch thread, then main thread, then
    # main thread a step later; step() runs all three in a row.
    prefetch_batches: int  # batches the prefetch thread keeps staged ahead

    def prepare(self, timeout: float, most: int = 1) -> list[Staged]: ...  # batches sampled and staged on the device
    def train(self, staged: Staged) -> Pending: ...  # the update enqueued; no host synchronisation
    def train_without_batch(self) -> Pending: ...  # a learner group's step on a rank without a batch
    def finish(self, pending: list[Pending]) -> list[dict[str, float]]: ...  # their metrics; {} for a skipped one
    def step(self) -> dict[str, float]: ...
    def weights(self) -> dict[str, np.ndarray]: ...
    def metrics(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def check_state(
        self, state: dict[str, Any]
    ) -> None: ...  # CorruptCheckpoint/ValueError if it cannot be loaded; changes nothing
    @property
    def memory_nbytes(self) -> int: ...


class LearnerCore(TrainingCore, Protocol):
    """One algorithm's learner for one policy: it also checks and stores what actors send."""

    schema: BatchSchema  # the one check of what actors send

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None: ...
    def batch_limits(self, num_envs: int) -> dict[str, int]: ...
    def env_steps(self, sizes: dict[str, int]) -> int: ...  # what a validated batch stands for
    # Validated batches: arrays by name, frames possibly still lz4 (``Compressed``).
    def insert_many(self, batches: list[dict[str, Any]]) -> list[ProtocolError | None]: ...  # each one's error


class ActorCore(Protocol):
    """What the actor process calls: K environments and one batched forward pass."""

    steps: int
    weights_version: int

    def __init__(self, config: Config, setup: dict[str, Any], seed: int, tick: Callable[[], None] = ...) -> None: ...
    @property
    def num_envs(self) -> int: ...
    def set_weights(self, msg: Message) -> None: ...  # ProtocolError: refused, the old ones act on
    # (a batch to send or None, finished episodes as [return, length, is_eval])
    def act(self) -> tuple[dict[str, np.ndarray] | None, list[EpisodeRecord]]: ...
    # The info of the batch act() just gave, with the episode records gathered since the last send.
    def batch_info(self, episodes: list[EpisodeRecord]) -> dict[str, Any]: ...
    def close(self) -> None: ...


class EpisodeActorCore(Protocol):
    """What `apex serve` calls (through ``apex.serve.episodes``): episodes that clients step."""

    weights_version: int
    learns_logged_actions: bool
    reuse_freed_slots: bool

    def __init__(self, config: Config, setup: dict[str, Any], spec: EnvSpec, seed: int) -> None: ...
    def set_weights(self, msg: Message) -> None: ...
    def begin(self, episode: Episode) -> None: ...
    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray: ...
    def end(self, episodes: list[Episode], obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None: ...
    def abandon(self, episode: Episode) -> None: ...
    # batches, each with the records of the episodes whose last transitions it holds
    def take(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]]: ...


NetworkT = TypeVar("NetworkT", bound="torch.nn.Module")


@dataclass(frozen=True)
class Policy(Generic[NetworkT]):
    """The network an algorithm's greedy policy acts with, and where checkpoints keep it."""

    checkpoint_key: str  # e.g. "online": the state dict in a checkpoint
    description: str  # e.g. "the online Q network", for errors
    network: Callable[[EnvSpec, ModelConfig], NetworkT]
    # (net, obs [B, ...], core state or None, legal actions [B, A] bool or None)
    #   -> (actions [B(, components)], the next core state or None)
    greedy: Callable[[NetworkT, torch.Tensor, Any, torch.Tensor | None], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class LearnerSide:
    core: type[LearnerCore]
    policy: Policy[Any]  # each algorithm's network type: its greedy takes what its network makes


@dataclass(frozen=True)
class ActorSide:
    core: type[ActorCore]
    episode_core: type[EpisodeActorCore]
    # What is wrong with the algorithm's part of a welcome's setup (its common part checked
    # first: a dict with num_envs in range), or None: a welcome may be forged.
    setup_problem: Callable[[dict[str, Any]], str | None]
