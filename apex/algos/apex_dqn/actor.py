"""The Ape-X actor core (Horgan et al. 2018): K environments on the epsilon ladder (Sec. 4.1:
eps_i = eps ** (1 + alpha * i / (N - 1)), eps=0.4, alpha=7; here spread over the actors that
join: ``apex.algos.apex_dqn.exploration``), and ``NStepChunker``, which turns one environment's steps into
n-step transitions (Sec. 3, Alg. 1) with initial priorities from the actor's own Q-values:

    G_t = sum_{k<n} gamma^k r_{t+k},   target_t = G_t + gamma^n max_a Q(s_{t+n}, a)
    priority_t = |target_t - Q(s_t, a_t)|

bootstrapping on truncation (time limits) and not on termination. No torch here unless the
observations are images (``apex.nets.numpy_nets``): the learner side is ``apex.algos.apex_dqn.learner``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from apex.algos.apex_dqn.exploration import Explorer, choose_actions
from apex.algos.chunks import FrameTrack, frame_offsets
from apex.algos.masks import episode_masks, legal_actions, masked_values
from apex.config import Config
from apex.envs.make import FrameStacker, VectorEnv
from apex.nets.numpy_nets import q_network
from apex.wire.protocol import Message
from apex.wire.schema import episode_record

if TYPE_CHECKING:
    from apex.core import EpisodeRecord
    from apex.core.episode import Episode
    from apex.envs.make import EnvSpec

# An n-step chunk, or a batch of merged ones: frames and per-transition arrays by name.
Chunk = dict[str, np.ndarray]


class NStepChunker:
    """Builds one environment's n-step transitions and hands them out in chunks.

    Frames are stored once (``apex.algos.chunks.FrameTrack``): a chunk carries the frames its
    transitions need plus, per transition, where its observation stack and its bootstrap
    stack start.

    Call order per step: ``record_action`` (when acting on s_t, with Q(s_t, a_t) and
    max_a Q(s_t, a)), then ``record_step`` (reward r_t and the next frame), then, if the
    episode ended, ``end_episode``.
    """

    def __init__(
        self,
        stack: int,
        n_step: int,
        gamma: float,
        chunk_transitions: int,
        clip_rewards: bool,
        reward_scale: float = 1.0,
        mask_actions: int | None = None,
    ) -> None:
        """``mask_actions``: each step's legal actions (of that many) are recorded, and a
        chunk carries those of each transition's bootstrap observation (``next_mask``)."""
        self.stack, self.n, self.gamma = stack, n_step, gamma
        self.mask_actions = mask_actions
        self.chunk_transitions = chunk_transitions
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self._powers = gamma ** np.arange(n_step + 1)

    def start(self, frame: np.ndarray) -> None:
        """Begins an episode whose first frame is ``frame``."""
        self.track = FrameTrack(self.stack)  # from the stack of step c on
        self.track.begin(frame)
        self.actions: list[int] = []
        self.q_taken: list[float] = []
        self.values: list[float] = []  # max_a Q(s_t, a) for t = c, c+1, ...
        self.rewards: list[float] = []
        self.masks: list[np.ndarray] = []  # the legal actions at s_t (with mask_actions)
        self.c = 0  # step index of the chunk's first transition
        self.t = 0  # current step index
        self.episode_return = 0.0

    def record_action(self, action: int, q_taken: float, value: float, mask: np.ndarray | None = None) -> Chunk | None:
        """Acting on s_t (with its legal actions ``mask``, where they are recorded); returns
        a chunk when enough transitions have their bootstrap value."""
        self.actions.append(int(action))
        self.q_taken.append(float(q_taken))
        self.values.append(float(value))
        if self.mask_actions is not None:
            self.masks.append(np.ones(self.mask_actions, np.uint8) if mask is None else mask.astype(np.uint8))
        complete = self.t - self.n + 1 - self.c  # transitions t' with t' + n <= t
        if complete >= self.chunk_transitions:
            return self._emit(self.chunk_transitions, end=None, terminated=False, final_value=0.0)
        return None

    def record_step(self, reward: float, next_frame: np.ndarray) -> None:
        self.episode_return += reward
        self.rewards.append((float(np.sign(reward)) if self.clip_rewards else float(reward)) * self.reward_scale)
        self.track.push(next_frame)
        self.t += 1

    def end_episode(self, terminated: bool, final_value: float) -> Chunk | None:
        """The episode ended at step t (``final_value``: max_a Q of the final observation,
        used only on truncation). Returns a chunk of every remaining transition."""
        count = self.t - self.c
        return self._emit(count, end=self.t, terminated=terminated, final_value=final_value) if count else None

    def _emit(self, count: int, *, end: int | None, terminated: bool, final_value: float) -> Chunk:
        c, n = self.c, self.n
        steps = np.arange(c, c + count)
        horizon = steps + n if end is None else np.minimum(steps + n, end)  # bootstrap step
        rewards = np.asarray(self.rewards, np.float64)
        values = np.asarray(self.values + ([final_value] if end is not None else []), np.float64)
        returns = np.zeros(count)
        for k in range(n):  # G_t = sum_k gamma^k r_{t+k}, stopping at the horizon
            alive = steps + k < horizon
            returns[alive] += self._powers[k] * rewards[(steps + k - c)[alive]]
        discount = self._powers[horizon - steps]
        if terminated:
            discount = np.where(horizon == end, 0.0, discount)
        priority = np.abs(returns + discount * values[horizon - c] - np.asarray(self.q_taken[:count]))
        frames, starts = self.track.take(int(horizon.max()) - c)
        chunk = {
            "frames": np.stack(frames),
            "obs_frame": starts[steps - c],
            "next_obs_frame": starts[horizon - c],
            "action": np.asarray(self.actions[:count], np.int64),
            "reward": returns.astype(np.float32),
            "discount": discount.astype(np.float32),
            "priority": priority.astype(np.float32),
        }
        if self.mask_actions is not None:  # the final observation's is unknown: all legal (discount 0 or its value)
            final = [np.ones(self.mask_actions, np.uint8)] if end is not None else []
            chunk["next_mask"] = np.stack(self.masks + final)[horizon - c]
            del self.masks[:count]
        self.track.drop(count)
        del self.actions[:count], self.q_taken[:count], self.values[:count], self.rewards[:count]
        self.c += count
        return chunk


def make_chunker(config: Config, stack: int, mask_actions: int | None = None) -> NStepChunker:
    """One environment's (or external episode's) chunker, as the run's config says."""
    return NStepChunker(
        stack,
        config.apex_dqn.n_step,
        config.apex_dqn.gamma,
        config.apex_dqn.chunk_transitions,
        clip_rewards=config.env.is_atari and config.env.clip_rewards,
        reward_scale=config.env.reward_scale,
        mask_actions=mask_actions,
    )


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Concatenates chunks into one batch, offsetting frame indices."""
    if len(chunks) == 1:
        return chunks[0]
    offsets = frame_offsets([c["frames"] for c in chunks])
    indices = ("obs_frame", "next_obs_frame")
    merged = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0] if name not in indices}
    for name in indices:
        merged[name] = np.concatenate([c[name] + off for c, off in zip(chunks, offsets)]).astype(np.int32, copy=False)
    return merged


def setup_problem(setup: dict[str, Any]) -> str | None:
    """What is wrong with a welcome's ladder (``LearnerCore.actor_setup``), or None."""
    n, epsilons, evaluating = setup["num_envs"], setup.get("epsilons"), setup.get("eval_envs")
    if not (
        isinstance(epsilons, list)
        and len(epsilons) == n
        and all(type(e) in (int, float) and 0 <= e <= 1 for e in epsilons)
    ):
        return f"setup.epsilons must be a list of {n} numbers in [0, 1] (one an environment)"
    if not (isinstance(evaluating, list) and len(evaluating) == n and all(type(e) is bool for e in evaluating)):
        return f"setup.eval_envs must be a list of {n} booleans (one an environment)"
    return None


class ApexDqnActor:
    """K environments on the Ape-X ladder; ``act()`` is one step of all of them."""

    def __init__(
        self, config: Config, setup: dict[str, Any], seed: int, tick: Callable[[], None] = lambda: None
    ) -> None:
        """``tick`` keeps the connection alive while the environments are made."""
        self.config = config
        self.epsilons = np.asarray(setup["epsilons"])
        self.eval_mask = list(setup["eval_envs"])
        self.envs = VectorEnv(config.env, len(self.epsilons), seed, tick)
        self.spec = self.envs.spec
        self.net = q_network(self.spec, config.model)
        self.stacker = FrameStacker(self.num_envs, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.chunkers = [make_chunker(config, self.spec.stack) for _ in range(self.num_envs)]
        self.explorer = Explorer(
            self.epsilons,
            self.spec.num_actions,
            np.random.default_rng(seed),
            config.apex_dqn.eps_repeat_mu,
            plain=self.eval_mask,
        )
        self.steps = 0  # vector steps taken
        self.weights_version = -1
        self._pending: list[Chunk] = []
        for i, frame in enumerate(self.envs.reset()):
            self.stacker.reset(i, frame)
            self.chunkers[i].start(frame)

    @property
    def num_envs(self) -> int:
        return len(self.epsilons)

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def _q_values(self, obs: np.ndarray) -> np.ndarray:
        return self.net(obs)

    def act(self) -> tuple[Chunk | None, list[EpisodeRecord]]:
        """One step of every environment: (a batch to send, or None; finished episodes as
        [return, length, is_eval])."""
        q = self._q_values(self.stacker.obs)
        actions = self.explorer.actions(q.argmax(axis=1))
        q_taken = q[np.arange(self.num_envs), actions]
        values = q.max(axis=1)
        for i, chunker in enumerate(self.chunkers):
            chunk = chunker.record_action(actions[i], q_taken[i], values[i])
            if chunk is not None:
                self._pending.append(chunk)
        frames, rewards, terminated, truncated, final = self.envs.step(actions)
        self.steps += 1
        truncated_only = [i for i in final if truncated[i] and not terminated[i]]
        final_values: dict[int, np.floating[Any]] = {}
        if truncated_only:  # bootstrap values of the final observations
            obs = np.stack([self.stacker.peek(i, final[i]) for i in truncated_only])
            final_values = dict(zip(truncated_only, self._q_values(obs).max(axis=1)))
        episodes: list[EpisodeRecord] = []
        for i, chunker in enumerate(self.chunkers):
            chunker.record_step(rewards[i], final.get(i, frames[i]))
            if i in final:
                chunk = chunker.end_episode(bool(terminated[i]), float(final_values.get(i, 0.0)))
                if chunk is not None:
                    self._pending.append(chunk)
                episodes.append([chunker.episode_return, chunker.t, self.eval_mask[i]])
                chunker.start(frames[i])
                self.stacker.reset(i, frames[i])
                self.explorer.reset(i)
            else:
                self.stacker.push(i, frames[i])
        if sum(len(c["action"]) for c in self._pending) < self.config.apex_dqn.chunk_transitions:
            return None, episodes
        batch, self._pending = merge_chunks(self._pending), []
        return batch, episodes

    def batch_info(self, episodes: list[EpisodeRecord]) -> dict[str, Any]:
        return {"episodes": episodes}

    def close(self) -> None:
        self.envs.close()


class _ExternalEpisode:
    """An external episode's Ape-X state: its n-step chunker and its rung of the ladder."""

    def __init__(self, chunker: NStepChunker, epsilon: float, is_eval: bool) -> None:
        self.chunker, self.epsilon, self.is_eval = chunker, epsilon, is_eval
        self.held, self.left = 0, 0  # ez-greedy's hold (apex_dqn.eps_repeat_mu)


class ApexDqnEpisodeActor:
    """Ape-X for episodes stepped elsewhere (``apex.serve.episodes``): each episode plays on a rung
    of the ladder the learner gave (its slot's), builds its own n-step chunks, and may take
    actions the client chose (``log_action``): Q-learning learns from them off-policy.
    Episodes with such actions do not count as evaluation episodes."""

    learns_logged_actions = True
    reuse_freed_slots = False  # slots in turn: every rung of the ladder plays

    def __init__(self, config: Config, setup: dict[str, Any], spec: EnvSpec, seed: int) -> None:
        self.config = config
        self.spec = spec
        self.epsilons = np.asarray(setup["epsilons"])
        self.eval_mask = list(setup["eval_envs"])
        self.net = q_network(spec, config.model)
        self.rng = np.random.default_rng(seed)
        self.weights_version = -1
        self._pending: list[tuple[Chunk | None, list[EpisodeRecord]]] = []  # chunks with the episodes they end

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def begin(self, episode: Episode) -> None:
        if episode.slot is None:
            raise ValueError(f"episode {episode.id} begins before it has a slot")
        rung = episode.slot % len(self.epsilons)
        chunker = make_chunker(self.config, self.spec.stack, self.spec.num_actions if self.spec.action_masked else None)
        episode.state = _ExternalEpisode(chunker, float(self.epsilons[rung]), bool(self.eval_mask[rung]))

    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
        """Actions for ``obs`` [n, stack, ...] (or ``chosen`` ones), recorded with their Q-values;
        the step before each (``episode.reward``) ends here."""
        q = self.net(obs)
        count = len(episodes)
        mask = episode_masks(episodes, self.spec.num_actions)
        legal_q = masked_values(q, mask)
        if chosen is None:
            actions = legal_actions(self.rng, self._explore(episodes, legal_q.argmax(axis=1)), mask)
        else:
            actions = chosen
        q_taken = q[np.arange(count), actions].tolist()
        values = legal_q.max(axis=1).tolist()
        for i, (episode, action) in enumerate(zip(episodes, actions.tolist())):
            chunker = episode.state.chunker
            if episode.acted:
                chunker.record_step(episode.reward, obs[i, -1])
            else:
                chunker.start(obs[i, -1])
            chunk = chunker.record_action(action, q_taken[i], values[i], None if mask is None else mask[i])
            if chunk is not None:
                self._pending.append((chunk, []))
        return actions

    def _explore(self, episodes: list[Episode], greedy: np.ndarray) -> np.ndarray:
        states: list[_ExternalEpisode] = [e.state for e in episodes]
        epsilons = np.fromiter((s.epsilon for s in states), np.float64, len(states))
        repeat_mu = self.config.apex_dqn.eps_repeat_mu
        if repeat_mu is None:
            return choose_actions(self.rng, greedy, epsilons, self.spec.num_actions)
        held = np.fromiter((s.held for s in states), np.int64, len(states))
        left = np.fromiter((s.left for s in states), np.int64, len(states))
        may_repeat = np.fromiter((not s.is_eval for s in states), bool, len(states))
        actions = choose_actions(self.rng, greedy, epsilons, self.spec.num_actions, repeat_mu, held, left, may_repeat)
        for state, h, n in zip(states, held.tolist(), left.tolist()):
            state.held, state.left = h, n
        return actions

    def end(self, episodes: list[Episode], obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        cut = [i for i in range(len(episodes)) if truncated[i] and not terminated[i]]
        final_values = dict(zip(cut, self.net(obs[cut]).max(axis=1))) if cut else {}
        for i, episode in enumerate(episodes):
            chunker = episode.state.chunker
            chunker.record_step(episode.reward, obs[i, -1])
            chunk = chunker.end_episode(bool(terminated[i]), float(final_values.get(i, 0.0)))
            record = episode_record(episode, episode.state.is_eval and not episode.logged)
            self._pending.append((chunk, [record]))

    def abandon(self, episode: Episode) -> None:
        """An idle episode closed: its transitions up to the last observation, bootstrapped
        from the Q-values recorded there (a time limit); the action out there is dropped."""
        if episode.acted:
            chunk = episode.state.chunker.end_episode(False, 0.0)
            if chunk is not None:
                self._pending.append((chunk, []))

    def take(self, flush: bool = False) -> list[tuple[Chunk, list[EpisodeRecord]]]:
        """Batches of at least chunk_transitions (all that is pending with ``flush``), each
        with the records of the episodes whose last transitions it holds."""
        batches: list[tuple[Chunk, list[EpisodeRecord]]] = []
        chunks: list[Chunk] = []
        records: list[EpisodeRecord] = []
        count = 0
        for chunk, ended in self._pending:
            if chunk is not None:
                chunks.append(chunk)
                count += len(chunk["action"])
            records += ended
            if count >= self.config.apex_dqn.chunk_transitions:
                batches.append((merge_chunks(chunks), records))
                chunks, records, count = [], [], 0
        if flush and chunks:
            batches.append((merge_chunks(chunks), records))
            chunks, records = [], []
        # what is left waits for more; the records of episodes that ended go with the last chunk
        self._pending = [(chunk, []) for chunk in chunks[:-1]] + [(chunks[-1] if chunks else None, records)]
        return batches
