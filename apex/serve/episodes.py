"""External episodes: environments that apex does not step (a game, a robot, a simulator in
another language) report observations and rewards, and ask for actions, one request at a
time. ``ExternalEpisodes`` checks every request against the run's spaces before it changes
anything (``apex.serve.request_checks``), keeps the open episodes (each on a slot: a rung of
the Ape-X ladder, a row of IMPALA unrolls), expires idle ones, and leaves the learning data
to the algorithm's ``EpisodeActor`` (``apex.algos.<algo>_actor``). No sockets here:
``apex.serve.server`` puts it behind HTTP and ZeroMQ and sends what it makes to the learner.

A request for many episodes is checked whole first: an unknown id or a wrong observation
anywhere in it refuses all of it, and no episode moves.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from apex.config import Config
from apex.core.episode import Episode, stack_frames
from apex.envs.make import EnvSpec
from apex.serve.request_checks import Actions, RequestError, SpaceChecks, describe_spaces
from apex.wire.schema import UNKNOWN_STEP_LIMIT

if TYPE_CHECKING:
    from apex.core import EpisodeActorCore, EpisodeRecord

# RequestError and describe_spaces are defined beside the checks that raise and use them;
# named here too, where the server, its frontends and its tests have always found them.
__all__ = ["MAX_EPISODE_ID_CHARS", "Episode", "ExternalEpisodes", "RequestError", "describe_spaces"]

MAX_EPISODE_ID_CHARS = 64


class ExternalEpisodes:
    """The open episodes of one `apex serve` and the data they make. Not thread-safe: its
    owner serialises calls (``apex.serve.server`` holds a lock)."""

    def __init__(
        self,
        config: Config,
        spec: EnvSpec,
        low: np.ndarray,
        high: np.ndarray,
        actor: EpisodeActorCore,
        *,
        max_episodes: int,
        episode_timeout_s: float,
        max_per_client: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.spec = spec
        self.actor = actor  # the algorithm's EpisodeActor
        self.max_episodes = max_episodes
        self.episode_timeout_s = episode_timeout_s
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self.max_per_client = max_per_client or max_episodes
        self._open_by_client: Counter[str] = Counter()
        # Ape-X: slots handed out in turn, so that over time every rung of the ladder (its
        # evaluation rungs too) plays, however few episodes are open at once. IMPALA: the
        # slot freed last first, so that unrolls fill with fresh steps (``reuse_freed_slots``).
        self._free_slots = deque(range(max_episodes))
        self.max_abs_reward = config.transport.max_abs_reward
        self.checks = SpaceChecks(spec, low, high, config.transport.max_abs_obs, self.max_abs_reward)
        self.spaces = describe_spaces(spec, low, high)
        self.frame_elements = int(np.prod(spec.frame_shape))  # an episode's observation: what a request's size allows
        # The learner refuses a batch that reports an episode longer than this (the env's time
        # limit): an episode is stopped at it, not allowed to spoil the batch it would end in.
        self.step_limit = spec.max_episode_steps or UNKNOWN_STEP_LIMIT
        self.started = 0
        self.finished = 0
        self.expired = 0
        self.steps = 0

    def describe(self) -> str:
        """What the log says of the episodes served: the observation and the actions."""
        observation, action = self.spaces["observation"], self.spaces["action"]
        return (
            f"observation {observation['dtype']} {observation['shape']}, {action.get('n', action.get('nvec'))} actions"
        )

    # -- requests

    def start(self, count: int = 1, client: str = "") -> list[str]:
        """Opens ``count`` episodes for ``client`` (its address); returns their ids
        (unguessable: one client cannot act in another's episodes by counting)."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise RequestError(400, "fields", f"count must be a positive integer, got {count!r}")
        if len(self.episodes) + count > self.max_episodes or self._open_by_client[client] + count > self.max_per_client:
            self.expire()
        if len(self.episodes) + count > self.max_episodes:
            raise RequestError(
                429,
                "too_many_episodes",
                f"{len(self.episodes)} episodes are open and at most {self.max_episodes} may be "
                "(apex serve --max-episodes): end some, or let idle ones expire",
            )
        if self._open_by_client[client] + count > self.max_per_client:
            raise RequestError(
                429,
                "client_episodes",
                f"this client holds {self._open_by_client[client]} open episodes and may hold at most "
                f"{self.max_per_client} (serve.max_episodes_per_client): end some, or let idle ones expire",
            )
        now = self.clock()
        ids = []
        for _ in range(count):
            episode = Episode(secrets.token_hex(12), None, now, owner=client)
            self.episodes[episode.id] = episode
            ids.append(episode.id)
        self._open_by_client[client] += count
        self.started += count
        return ids

    def act(
        self,
        ids: list[str],
        observations: Any,
        rewards: Any = None,
        ended: Any = None,
        terminated: Any = None,
        truncated: Any = None,
        action_masks: Any = None,
    ) -> Actions:
        """The policy's actions for these episodes' current observations; ``rewards``, when
        given, are added to each episode's step under way first (one request a step).
        ``ended``: episodes that ended since the last request, as ``end`` takes them (a map of
        its arguments: episode_ids, observations, terminated, truncated, rewards), ended
        first, so that a vectorised simulator needs one round trip a step. The whole request
        is checked before either part changes anything."""
        _single_agent(terminated=terminated, truncated=truncated, action_masks=action_masks)
        closing = self._checked_end(**self._end_fields(ended)) if ended is not None else None
        episodes = self._episodes(ids)
        if closing is not None and not {id(e) for e in episodes}.isdisjoint(id(e) for e in closing[0]):
            raise RequestError(400, "fields", "an episode id is both in end and asking for an action")
        self._within_limit(episodes)
        frames = self.frames(observations, len(episodes))
        values = None if rewards is None else self._checked_rewards(episodes, rewards)
        if closing is not None:
            self._end_checked(*closing)
        if values is not None:
            self._apply_rewards(episodes, values)
        self._seat(episodes)
        actions = self.actor.act(episodes, self._next(episodes, frames), None)
        self._after_step(episodes)
        return actions

    def log_action(
        self,
        ids: list[str],
        observations: Any,
        actions: Any,
        rewards: Any = None,
        terminated: Any = None,
        truncated: Any = None,
        action_masks: Any = None,
    ) -> None:
        """The client chose these actions (its own policy, a human): recorded as if the
        policy had taken them, where the algorithm can learn from them off-policy."""
        _single_agent(terminated=terminated, truncated=truncated, action_masks=action_masks)
        episodes = self._episodes(ids)
        if not self.actor.learns_logged_actions:
            raise RequestError(
                409,
                "log_action",
                f"algo {self.config.algo} learns on-policy, and a client's choice among discrete actions has "
                "no probability under its policy; ask for actions (action), or run the learner with algo "
                "apex_dqn, which learns from any action",
            )
        self._within_limit(episodes)
        frames = self.frames(observations, len(episodes))
        chosen = self.actions(actions, len(episodes))
        if rewards is not None:
            self._add_rewards(episodes, rewards)
        self._seat(episodes)
        self.actor.act(episodes, self._next(episodes, frames), chosen)
        for episode in episodes:
            episode.logged = True
        self._after_step(episodes)

    def add_rewards(self, ids: list[str], rewards: Any) -> None:
        """Adds each reward to its episode's step under way (several calls a step add up)."""
        self._add_rewards(self._episodes(ids), rewards)

    def _add_rewards(self, episodes: list[Episode], rewards: Any) -> None:
        self._apply_rewards(episodes, self._checked_rewards(episodes, rewards))

    def _checked_rewards(self, episodes: list[Episode], rewards: Any) -> np.ndarray:
        values = self.checks.rewards(rewards, len(episodes))
        for episode, reward in zip(episodes, values):
            if not episode.acted and reward != 0:
                raise RequestError(
                    409,
                    "order",
                    f"episode {episode.id}: a reward before its first action; ask for (or log) an action first",
                )
            total = episode.reward + reward
            if abs(total) > self.max_abs_reward:
                raise RequestError(
                    400,
                    "reward",
                    f"episode {episode.id}: this step's reward {total:g} exceeds "
                    f"transport.max_abs_reward ({self.max_abs_reward:g})",
                )
        return values

    def _apply_rewards(self, episodes: list[Episode], values: np.ndarray) -> None:
        now = self.clock()
        for episode, reward in zip(episodes, values):
            episode.reward += reward
            episode.last_seen = now

    def end(self, ids: list[str], observations: Any, terminated: Any, truncated: Any, rewards: Any = None) -> None:
        """Ends these episodes at their final observations: ``terminated`` (no future to
        bootstrap) or ``truncated`` (a time limit: the future is the policy's own estimate)."""
        self._end_checked(*self._checked_end(ids, observations, terminated, truncated, rewards))

    def _checked_end(
        self, ids: Any, observations: Any, terminated: Any, truncated: Any, rewards: Any = None
    ) -> tuple[list[Episode], np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        episodes = self._episodes(ids)
        frames = self.frames(observations, len(episodes))
        term = self.checks.flags(terminated, len(episodes), "terminated")
        trunc = self.checks.flags(truncated, len(episodes), "truncated")
        values = None if rewards is None else self._checked_rewards(episodes, rewards)
        return episodes, frames, term, trunc, values

    def _end_checked(
        self,
        episodes: list[Episode],
        frames: np.ndarray,
        term: np.ndarray,
        trunc: np.ndarray,
        rewards: np.ndarray | None,
    ) -> None:
        if rewards is not None:
            self._apply_rewards(episodes, rewards)
        acted = [i for i, e in enumerate(episodes) if e.acted]
        if acted:
            chosen = [episodes[i] for i in acted]
            self.actor.end(chosen, self._next(chosen, frames[acted]), term[acted], trunc[acted])
            self.steps += len(acted)
        for episode in episodes:
            self._close(episode)
        self.finished += len(episodes)

    @staticmethod
    def _end_fields(ended: Any) -> dict[str, Any]:
        """An act request's ``end`` map as ``end``'s arguments."""
        known = {"episode_ids", "observations", "terminated", "truncated", "rewards"}
        if not isinstance(ended, dict) or not {"episode_ids", "observations"} <= ended.keys() or ended.keys() - known:
            raise RequestError(
                400,
                "fields",
                "end must be a map of episode_ids and observations, with terminated, "
                "truncated and rewards if given, as the end request takes them",
            )
        return {
            "ids": ended["episode_ids"],
            "observations": ended["observations"],
            "terminated": ended.get("terminated", False),
            "truncated": ended.get("truncated", False),
            "rewards": ended.get("rewards"),
        }

    def expire(self) -> int:
        """Closes the episodes idle for longer than the timeout; what they played up to their
        last observation is kept (as if a time limit had cut them there)."""
        cutoff = self.clock() - self.episode_timeout_s
        idle = [e for e in self.episodes.values() if e.last_seen < cutoff]
        for episode in idle:
            self.actor.abandon(episode)
            self._close(episode)
        self.expired += len(idle)
        return len(idle)

    def take(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]]:
        """Batches ready for the learner, each with the records of the episodes it ends;
        ``flush``: what is held back for a fuller batch too."""
        return self.actor.take(flush)

    def take_batches(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """``take``'s batches, each with the info the learner gets with it."""
        return [(arrays, {"episodes": records}) for arrays, records in self.take(flush)]

    # -- checks (before any state changes)

    def _within_limit(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            if episode.acted and episode.length + 1 >= self.step_limit:
                raise RequestError(
                    409,
                    "step_limit",
                    f"episode {episode.id} has played {episode.length + 1} steps, "
                    f"the run's time limit (env.max_episode_steps): end it with truncated true",
                )

    def _episodes(self, ids: Any) -> list[Episode]:
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list | tuple) or not ids:
            raise RequestError(400, "fields", "episode_ids must be a non-empty list of episode ids")
        if len(ids) > self.max_episodes:
            raise RequestError(400, "fields", f"{len(ids)} episode ids in one request; at most {self.max_episodes}")
        episodes = []
        for episode_id in ids:
            episode = self.episodes.get(episode_id) if isinstance(episode_id, str) else None
            if episode is None:
                shown = repr(episode_id)[:MAX_EPISODE_ID_CHARS]
                raise RequestError(
                    404,
                    "unknown_episode",
                    f"no open episode {shown}: it ended, expired after "
                    f"{self.episode_timeout_s:g} s idle, or was never started (POST /v1/episodes)",
                )
            episodes.append(episode)
        if len({id(e) for e in episodes}) != len(episodes):
            raise RequestError(400, "fields", "an episode id appears twice in one request")
        return episodes

    def frames(self, observations: Any, count: int) -> np.ndarray:
        """``count`` observations as frames [count, *frame_shape], checked against the space."""
        return self.checks.frames(observations, count)

    def actions(self, actions: Any, count: int) -> np.ndarray:
        """``count`` actions as integers [count, *action_shape], checked against the space."""
        return self.checks.actions(actions, count)

    # -- state

    def _next(self, episodes: list[Episode], frames: np.ndarray) -> np.ndarray:
        """Each episode's observation once ``frames`` arrive: its last ``stack`` frames."""
        return stack_frames(episodes, frames, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)

    def _after_step(self, episodes: list[Episode]) -> None:
        now = self.clock()
        for episode in episodes:
            if episode.acted:
                episode.length += 1
                episode.episode_return += episode.reward
                self.steps += 1
            episode.acted = True
            episode.reward = 0.0
            episode.last_seen = now

    def _seat(self, episodes: list[Episode]) -> None:
        """Gives episodes about to act for the first time a slot. Not at their start: an
        episode started ahead of need would hold an IMPALA row half full of old steps."""
        for episode in episodes:
            if episode.slot is None:
                episode.slot = self._free_slots.popleft()
                self.actor.begin(episode)

    def _close(self, episode: Episode) -> None:
        del self.episodes[episode.id]
        self._open_by_client[episode.owner] -= 1
        if not self._open_by_client[episode.owner]:
            del self._open_by_client[episode.owner]
        if episode.slot is None:
            return
        if self.actor.reuse_freed_slots:  # next in line: its row is fresh, not left half full
            self._free_slots.appendleft(episode.slot)
        else:
            self._free_slots.append(episode.slot)


def _single_agent(**per_agent: Any) -> None:
    """Refuses a multi-agent run's fields (agents' done flags and masks) in a single-agent one."""
    given = [name for name, value in per_agent.items() if value is not None]
    if given:
        raise RequestError(
            400,
            "fields",
            f"{', '.join(given)} in an action request are for multi-agent runs (maps by agent); "
            "end a single-agent episode with end",
        )
