"""Self-play (``multi_agent.self_play``): a shared policy plays against itself and against frozen
past snapshots of itself.

The learner keeps the pool (``SnapshotPool``): every ``snapshot_every_updates`` of the shared
policy's updates a copy of its weights joins it (the oldest leaves past ``pool_size``), and
every weights message carries the pool beside the newest weights, each snapshot's arrays named
``shared@<id>/<array>``. The pool is in every checkpoint and resumes with it.

Actors draw the opponents of each episode when it starts (``OpponentDraw``), never inside one:
one seat, drawn at random, is the learning one; the others play a uniformly random legal
player (the evaluation against a fixed yardstick: Ape-X's evaluation rungs, a RANDOM_SHARE of
IMPALA's episodes), the newest weights (``latest_prob``), or one snapshot from the pool. The
run's return (``return_mean_100``, what ``--stop-return`` and the best checkpoint go by) is
the learning seat's return in those evaluation episodes: a zero-sum game's team return says
nothing. Only the learning seat's experience
trains (and the newest weights' seats with ``train_opponents``). Each episode's outcome for the
learning seat (1 win, 0 draw, -1 loss: the sign of its return less its opponents' mean) goes
to the learner as a match (``info.matches``: [opponent, outcome], the opponent a snapshot's
id, LATEST or RANDOM), which keeps win/draw/loss rates against the pool and the random player
and an Elo rating of the newest policy against the pool's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from apex.config.multi_agent import SelfPlayConfig
from apex.core.episode import Episode
from apex.errors import CorruptCheckpoint
from apex.wire.protocol import Message

SNAPSHOT_MARK = "@"  # shared@3: snapshot 3 of the policy shared
LATEST, RANDOM = -1, -2  # a match's opponent that is no snapshot
RANDOM_SHARE = 0.1  # of the episodes, played against a uniformly random legal player
ELO_K = 16.0
ELO_START = 1000.0
WINDOW = 100  # matches the rates are over
MAX_MATCHES_PER_BATCH = 4096


def match_outcome(learner_return: float, opponent_returns: list[float]) -> int:
    """1, 0 or -1: the learning seat did better, as well or worse than its opponents on average."""
    margin = learner_return - (sum(opponent_returns) / len(opponent_returns) if opponent_returns else 0.0)
    return 0 if abs(margin) < 1e-9 else int(math.copysign(1, margin))


def check_matches(raw: Any, issued: int) -> list[tuple[int, int]]:
    """A batch's ``info.matches``, each [opponent, outcome] with an opponent that is LATEST,
    RANDOM or one of the ``issued`` snapshot ids so far (0..issued-1: an episode against one
    that has left the pool since may still be reported, by an actor that sends rarely) and
    an outcome of -1, 0 or 1; ValueError otherwise."""
    if not isinstance(raw, list) or len(raw) > MAX_MATCHES_PER_BATCH:
        raise ValueError(f"info.matches must be a list of at most {MAX_MATCHES_PER_BATCH} [opponent, outcome]")
    matches = []
    for item in raw:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(type(v) is int for v in item)
            and item[1] in (-1, 0, 1)
            and (item[0] in (LATEST, RANDOM) or 0 <= item[0] < issued)
        ):
            raise ValueError("each of info.matches must be [opponent, outcome]: a known opponent and -1, 0 or 1")
        matches.append((item[0], item[1]))
    return matches


class SnapshotPool:
    """The learner's pool of past snapshots of one policy, its match records and ratings."""

    def __init__(self, policy: str, config: SelfPlayConfig) -> None:
        self.policy, self.config = policy, config
        self.snapshots: dict[int, dict[str, np.ndarray]] = {}  # id -> weights, oldest first
        self.ratings: dict[int, float] = {}  # a snapshot's rating, as the newest policy's when taken
        self.rating = ELO_START  # the newest policy's
        self.next_id = 0
        self.last_snapshot_updates = 0
        self.results: dict[str, deque[int]] = {"pool": deque(maxlen=WINDOW), "random": deque(maxlen=WINDOW)}

    def maybe_snapshot(self, updates: int, weights: Callable[[], dict[str, np.ndarray]]) -> bool:
        """Takes a snapshot of ``weights()`` if ``snapshot_every_updates`` have passed since
        the last one (a callable: the learner asks every update, and copies only when due)."""
        if updates - self.last_snapshot_updates < self.config.snapshot_every_updates:
            return False
        self.last_snapshot_updates = updates
        sid = self.next_id
        self.next_id += 1
        self.snapshots[sid] = {name: array.copy() for name, array in weights().items()}
        self.ratings[sid] = self.rating
        while len(self.snapshots) > self.config.pool_size:
            oldest = next(iter(self.snapshots))
            del self.snapshots[oldest], self.ratings[oldest]
        return True

    def weights(self) -> dict[str, np.ndarray]:
        return {
            f"{self.policy}{SNAPSHOT_MARK}{sid}/{name}": array
            for sid, weights in self.snapshots.items()
            for name, array in weights.items()
        }

    def record(self, matches: list[tuple[int, int]]) -> None:
        """Counts matches and moves the newest policy's rating against the snapshots played."""
        for opponent, outcome in matches:
            if opponent == RANDOM:
                self.results["random"].append(outcome)
            elif opponent >= 0:
                self.results["pool"].append(outcome)
                if opponent in self.ratings:
                    expected = 1.0 / (1.0 + 10 ** ((self.ratings[opponent] - self.rating) / 400))
                    self.rating += ELO_K * ((outcome + 1) / 2 - expected)

    def metrics(self) -> dict[str, Any]:
        """Rates against the pool and the random player, the rating; the pool's only once it
        has snapshots (before, there is nothing to be rated against)."""
        out: dict[str, Any] = {}
        if self.snapshots:
            out["pool_size"] = len(self.snapshots)
            out["elo"] = round(self.rating, 1)
            out.update(_rates("pool", self.results["pool"]))
        out.update(_rates("random", self.results["random"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        import torch  # the learner's: checkpoints hold tensors

        return {
            "snapshots": [
                {"id": sid, "rating": self.ratings[sid], "weights": {k: torch.from_numpy(v) for k, v in w.items()}}
                for sid, w in self.snapshots.items()
            ],
            "rating": self.rating,
            "next_id": self.next_id,
            "last_snapshot_updates": self.last_snapshot_updates,
        }

    def check_state(self, state: Any, names: set[str]) -> None:
        """CorruptCheckpoint unless ``state`` is a pool of snapshots of a network with arrays ``names``."""
        import torch

        if not (
            isinstance(state, dict)
            and isinstance(state.get("snapshots"), list)
            and len(state["snapshots"]) <= self.config.pool_size
            and all(type(state.get(k)) is int and 0 <= state[k] < 2**53 for k in ("next_id", "last_snapshot_updates"))
            and _finite_number(state.get("rating"))
        ):
            raise CorruptCheckpoint("the self-play pool must hold snapshots, a rating and its counters")
        for snapshot in state["snapshots"]:
            weights = snapshot.get("weights") if isinstance(snapshot, dict) else None
            if not (
                isinstance(weights, dict)
                and set(weights) == names
                and all(isinstance(v, torch.Tensor) and bool(torch.isfinite(v).all()) for v in weights.values())
                and type(snapshot.get("id")) is int
                and _finite_number(snapshot.get("rating"))
            ):
                raise CorruptCheckpoint("a self-play snapshot does not hold this policy's finite weights")
        ids = [snapshot["id"] for snapshot in state["snapshots"]]
        # Ids are issued 0, 1, 2...: a forged one below 0 would read as LATEST or RANDOM in matches.
        if ids != sorted(set(ids)) or any(not 0 <= sid < state["next_id"] for sid in ids):
            raise CorruptCheckpoint("the self-play pool's snapshot ids must rise, each one below its next_id and >= 0")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshots = {s["id"]: {k: v.numpy() for k, v in s["weights"].items()} for s in state["snapshots"]}
        self.ratings = {s["id"]: float(s["rating"]) for s in state["snapshots"]}
        self.rating = float(state["rating"])
        self.next_id = state["next_id"]
        self.last_snapshot_updates = state["last_snapshot_updates"]


def _finite_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and abs(value) < 1e9


def _rates(against: str, outcomes: deque[int]) -> dict[str, Any]:
    if not outcomes:
        return {}
    n = len(outcomes)
    return {
        f"win_rate_vs_{against}": round(sum(o == 1 for o in outcomes) / n, 3),
        f"draw_rate_vs_{against}": round(sum(o == 0 for o in outcomes) / n, 3),
        f"loss_rate_vs_{against}": round(sum(o == -1 for o in outcomes) / n, 3),
    }


class RandomPlayer:
    """Uniformly random legal actions: the yardstick opponent. Makes no learning data."""

    weights_version = -1
    learns_logged_actions = False
    reuse_freed_slots = True

    def __init__(self, num_actions: int, seed: int) -> None:
        self.num_actions = num_actions
        self.rng = np.random.default_rng(seed)

    def set_weights(self, msg: Message) -> None:
        pass  # it has none

    def begin(self, episode: Episode) -> None:
        pass

    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
        return np.array(
            [
                self.rng.integers(self.num_actions)
                if episode.mask is None
                else self.rng.choice(np.flatnonzero(episode.mask))
                for episode in episodes
            ],
            np.int64,
        )

    def end(self, episodes: list[Episode], obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        pass

    def abandon(self, episode: Episode) -> None:
        pass

    def take(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], list[Any]]]:
        return []


class OpponentDraw:
    """Who plays each seat of an episode: the learning seat, and the opponents' player."""

    def __init__(self, config: SelfPlayConfig, seed: int) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)

    def draw(self, agents: list[str], pool: list[int], evaluating: bool | None = None) -> tuple[str, int]:
        """(the learning seat, the opponents' player: a snapshot id, LATEST or RANDOM).
        ``evaluating``: the environment is on an evaluation rung of the ladder (Ape-X), whose
        episodes play the random player, or not, whose do not; None (IMPALA, which always
        acts on its own policy): RANDOM_SHARE of them do."""
        seat = agents[int(self.rng.integers(len(agents)))]
        if evaluating if evaluating is not None else self.rng.random() < RANDOM_SHARE:
            return seat, RANDOM
        if not pool or self.rng.random() < self.config.latest_prob:
            return seat, LATEST
        return seat, pool[int(self.rng.integers(len(pool)))]
