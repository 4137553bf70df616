"""Multi-agent external episodes: a client steps a multi-agent simulator and each request
carries a map per episode from agent id to its value (observations, rewards, done flags,
action masks, actions), as PettingZoo's parallel API does. Each agent acts with its policy
(``multi_agent.mapping``), on its own ``Episode`` in that policy's episode core, and each
trained policy's data goes to the learner as its own stream, as ``MultiAgentActor`` sends it.

An agent joins at its first observation and finishes when a request marks it terminated or
truncated (its observation there is its final one); the team's episode goes on until ``end``,
which ends the agents still playing. A request is checked whole, for every episode and agent
in it, before any of them moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from apex.config import Config
from apex.config.multi_agent import WEIGHT_SEPARATOR
from apex.core.episode import Episode, stack_frames
from apex.envs.policy_map import MultiAgentSpec
from apex.errors import ProtocolError
from apex.serve.episodes import ExternalEpisodes
from apex.serve.request_checks import Actions, RequestError, describe_spaces
from apex.serve.team_checks import ALL_AGENTS, TeamChecks
from apex.wire.protocol import Message

if TYPE_CHECKING:
    from apex.core import EpisodeActorCore, EpisodeRecord

__all__ = ["ExternalTeams", "PolicyCores"]


class PolicyCores:
    """Each policy's episode core, as the server sees one actor: weights for all of them in one
    message (``<policy>/<array>``), one version."""

    def __init__(self, cores: dict[str, EpisodeActorCore]) -> None:
        self.cores = cores
        self.weights_version = -1
        first = next(iter(cores.values()))
        self.learns_logged_actions = all(core.learns_logged_actions for core in cores.values())
        self.reuse_freed_slots = first.reuse_freed_slots

    def set_weights(self, msg: Message) -> None:
        parts: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.cores}
        for key, array in msg.arrays.items():
            name, sep, rest = key.partition(WEIGHT_SEPARATOR)
            if not sep or name not in parts:
                raise ProtocolError(f"weights for an unknown policy: array {key!r}")
            parts[name][rest] = array
        for name, arrays in parts.items():
            self.cores[name].set_weights(Message(msg.type, msg.fields, arrays))
        self.weights_version = msg.fields["version"]


@dataclass
class _Team:
    """A team's episode: its agents playing now, the returns of those that finished, its steps."""

    agents: dict[str, Episode] = field(default_factory=dict)
    returns: dict[str, float] = field(default_factory=dict)
    length: int = 0


class ExternalTeams(ExternalEpisodes):
    """The open multi-agent episodes of one `apex serve` (their ids, slots, owners and expiry
    as ``ExternalEpisodes`` keeps them) and each policy's data. Not thread-safe."""

    def __init__(
        self,
        config: Config,
        spec: MultiAgentSpec,
        cores: dict[str, EpisodeActorCore],
        *,
        max_episodes: int,
        episode_timeout_s: float,
        max_per_client: int | None = None,
        eval_slots: list[bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        first = next(iter(spec.policies.values()))
        super().__init__(
            config,
            first.spec,
            first.low,
            first.high,
            PolicyCores(cores),  # type: ignore[arg-type]  # the server's weights, not an episode core
            max_episodes=max_episodes,
            episode_timeout_s=episode_timeout_s,
            max_per_client=max_per_client,
            clock=clock,
        )
        self.team_spec = spec
        self.cores = cores
        self.team_checks = TeamChecks(spec, config.transport.max_abs_obs, self.max_abs_reward)
        self.spaces = {
            "agents": {
                agent: {"policy": spec.policy_of[agent], **describe_spaces(view.spec, view.low, view.high)}
                for agent, view in spec.views.items()
            }
        }
        self.step_limit = self.team_checks.step_limit
        self.frame_elements = sum(int(np.prod(view.spec.frame_shape)) for view in spec.views.values())
        self.eval_slots = eval_slots
        self.team_records: list[EpisodeRecord] = []  # ride with the next batch sent

    def describe(self) -> str:
        policy_of = self.team_spec.policy_of
        return "agents " + ", ".join(f"{agent} (policy {policy_of[agent]})" for agent in self.team_spec.agents)

    # -- requests

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
        """Each episode's acting agents' actions (a map an episode); ``rewards`` go to the
        agents' steps under way first, and agents marked ``terminated`` or ``truncated``
        finish at their observation here."""
        if ended is not None:
            raise RequestError(
                400, "fields", "end inside an action request is for single-agent runs: end a team's episode with end"
            )
        return self._step(ids, observations, rewards, terminated, truncated, action_masks, None)

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
        if not self.actor.learns_logged_actions:
            raise RequestError(
                409,
                "log_action",
                f"algo {self.config.algo} learns on-policy from its own actions here; ask for actions (action)",
            )
        self._step(ids, observations, rewards, terminated, truncated, action_masks, actions)

    def add_rewards(self, ids: list[str], rewards: Any) -> None:
        teams = self._episodes(ids)
        given = self.team_checks.maps(rewards, len(teams), "rewards")
        values = [self.team_checks.rewards(team, _state(team).agents, r) for team, r in zip(teams, given)]
        for team, reward in zip(teams, values):
            self._give(team, reward)

    def end(self, ids: list[str], observations: Any, terminated: Any, truncated: Any, rewards: Any = None) -> None:
        """Ends these teams' episodes: each agent still playing at its final observation if
        given (terminated or truncated: true, false, or a map by agent), as if a time limit had
        cut it at its last one otherwise."""
        teams = self._episodes(ids)
        count = len(teams)
        checks = self.team_checks
        finals = checks.maps(observations, count, "observations")
        terms = checks.flag_maps(terminated, count, "terminated")
        truncs = checks.flag_maps(truncated, count, "truncated")
        given = checks.optional_maps(rewards, count, "rewards")
        checked = []
        for team, final, term, trunc, reward in zip(teams, finals, terms, truncs, given):
            playing, finished = _state(team).agents, _state(team).returns
            for agent in final:
                if agent not in playing and agent not in finished:
                    raise RequestError(409, "order", f"episode {team.id}: agent {agent!r} never played in it")
            # an agent that finished already (marked done in an action request) is not finished twice
            frames = {agent: checks.frame(agent, obs) for agent, obs in final.items() if agent in playing}
            flags = {agent: (_flag(term, agent), _flag(trunc, agent)) for agent in final}
            checked.append((team, frames, flags, checks.rewards(team, playing, reward)))
        for team, frames, flags, reward in checked:
            self._give(team, reward)
            state = _state(team)
            for agent in list(state.agents):
                if agent in frames:
                    self._finish(team, agent, frames[agent], *flags[agent])
                else:
                    self._leave(team, agent)
            self._team_over(team)
            self._close(team)
        self.finished += count

    def expire(self) -> int:
        cutoff = self.clock() - self.episode_timeout_s
        idle = [team for team in self.episodes.values() if team.last_seen < cutoff]
        for team in idle:
            for agent in list(_state(team).agents):
                self._leave(team, agent)
            self._team_over(team)
            self._close(team)
        self.expired += len(idle)
        return len(idle)

    def take_batches(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]]:
        """Each trained policy's batches ready for the learner with their info (its name, its
        agents' records, and the teams' records since the last batch)."""
        made = []
        for name, core in self.cores.items():
            batches = core.take(flush)
            if name in self.team_spec.trained:  # an acting-only policy's data is not sent
                made += [(arrays, {"policy": name, "episodes": records, "teams": []}) for arrays, records in batches]
        if made:
            made[0][1]["teams"], self.team_records = self.team_records, []
        return made

    def start(self, count: int = 1, client: str = "") -> list[str]:
        ids = super().start(count, client)
        for team_id in ids:
            self.episodes[team_id].state = _Team()
        return ids

    # -- checks

    def _step(
        self,
        ids: list[str],
        observations: Any,
        rewards: Any,
        terminated: Any,
        truncated: Any,
        action_masks: Any,
        actions: Any,
    ) -> list[dict[str, Any]]:
        teams = self._episodes(ids)
        count, checks = len(teams), self.team_checks
        turns = [
            checks.turn(team, _state(team).agents, _state(team).returns, obs, reward, term, trunc, masks, chosen)
            for team, obs, reward, term, trunc, masks, chosen in zip(
                teams,
                checks.maps(observations, count, "observations"),
                checks.optional_maps(rewards, count, "rewards"),
                checks.optional_maps(terminated, count, "terminated"),
                checks.optional_maps(truncated, count, "truncated"),
                checks.optional_maps(action_masks, count, "action_masks"),
                checks.optional_maps(actions, count, "actions"),
                strict=True,
            )
        ]
        logged = actions is not None
        for turn in turns:
            self._give(turn.team, turn.rewards)
            for agent, (term, trunc) in turn.ending.items():
                self._finish(turn.team, agent, turn.frames[agent], term, trunc)
        replies: list[dict[str, Any]] = [{} for _ in turns]
        by_policy: dict[str, list[tuple[int, str, Episode]]] = {}
        for i, turn in enumerate(turns):
            self._seat_team(turn.team)
            for agent in turn.acting:
                episode = self._agent_episode(turn.team, agent)
                episode.mask = turn.masks.get(agent)
                by_policy.setdefault(self.team_spec.policy_of[agent], []).append((i, agent, episode))
        for policy, acting in by_policy.items():
            episodes = [episode for _, _, episode in acting]
            frames = np.stack([self._policy_frame(agent, turns[i].frames[agent]) for i, agent, _ in acting])
            chosen = np.stack([turns[i].chosen[agent] for i, agent, _ in acting]) if logged else None
            out = self.cores[policy].act(episodes, self._stacked(policy, episodes, frames), chosen)
            for (i, agent, episode), action in zip(acting, out):
                replies[i][agent] = action
                episode.logged = episode.logged or logged
                if episode.acted:
                    episode.length += 1
                    episode.episode_return += episode.reward
                    self.steps += 1
                episode.acted, episode.reward = True, 0.0
        now = self.clock()
        for turn in turns:
            _state(turn.team).length += bool(turn.acting)
            turn.team.last_seen = now
        return replies

    # -- state

    def _give(self, team: Episode, rewards: dict[str, float]) -> None:
        playing = _state(team).agents
        for agent, reward in rewards.items():
            if agent in playing:
                playing[agent].reward += reward
        team.last_seen = self.clock()

    def _seat_team(self, team: Episode) -> None:
        if team.slot is None:
            team.slot = self._free_slots.popleft()

    def _agent_episode(self, team: Episode, agent: str) -> Episode:
        """``agent``'s episode in ``team``'s, begun at its first action on its own slot of its
        policy's core (the team's slot times the policy's agents, plus its place among them)."""
        state = _state(team)
        episode = state.agents.get(agent)
        if episode is None:
            policy = self.team_spec.policies[self.team_spec.policy_of[agent]]
            if team.slot is None:
                raise ValueError(f"episode {team.id} has no slot")
            slot = team.slot * len(policy.agents) + policy.agents.index(agent)
            episode = state.agents[agent] = Episode(f"{team.id}/{agent}", slot, self.clock())
            self.cores[policy.name].begin(episode)
        return episode

    def _finish(self, team: Episode, agent: str, frame: np.ndarray, terminated: bool, truncated: bool) -> None:
        state = _state(team)
        episode = state.agents.pop(agent)
        policy = self.team_spec.policy_of[agent]
        stacked = self._stacked(policy, [episode], self._policy_frame(agent, frame)[None])
        self.cores[policy].end([episode], stacked, np.array([terminated]), np.array([truncated]))
        self.steps += 1
        state.returns[agent] = episode.episode_return + episode.reward

    def _leave(self, team: Episode, agent: str) -> None:
        """An agent gone without a final observation: kept up to its last one."""
        state = _state(team)
        episode = state.agents.pop(agent)
        self.cores[self.team_spec.policy_of[agent]].abandon(episode)
        state.returns[agent] = episode.episode_return + episode.reward

    def _team_over(self, team: Episode) -> None:
        """The team's record: the mean of its agents' returns, its steps, and whether its slot
        is an evaluation one (the Ape-X ladder's)."""
        state = _state(team)
        if state.returns and state.length:
            evaluation = True
            if self.eval_slots and team.slot is not None:
                evaluation = self.eval_slots[team.slot % len(self.eval_slots)]
            self.team_records.append([float(np.mean(list(state.returns.values()))), state.length, evaluation])

    def _policy_frame(self, agent: str, frame: np.ndarray) -> np.ndarray:
        return self.team_spec.policies[self.team_spec.policy_of[agent]].frame(agent, frame)

    def _stacked(self, policy: str, episodes: list[Episode], frames: np.ndarray) -> np.ndarray:
        spec = self.team_spec.policies[policy].spec
        return stack_frames(episodes, frames, spec.stack, spec.frame_shape, spec.frame_dtype)


def _flag(flags: dict[str, bool], agent: str) -> bool:
    return bool(flags.get(agent, flags.get(ALL_AGENTS, False)))


def _state(team: Episode) -> _Team:
    state: _Team = team.state
    return state
