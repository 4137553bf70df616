"""The Ape-X actor core (Horgan et al. 2018): K environments on the epsilon ladder (Sec. 4.1:
eps_i = eps ** (1 + alpha * i / (N - 1)), eps=0.4, alpha=7; here spread over the actors that
join: ``apex.algos.apex_dqn.exploration``), sending n-step transitions (``apex.algos.nstep``)
with initial priorities from the actor's own Q-values:

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
from apex.algos.masks import episode_masks, legal_actions, masked_values
from apex.algos.nstep import Chunk, NStepChunker, merge_chunks
from apex.config import Config
from apex.envs.make import FrameStacker, VectorEnv
from apex.nets.numpy_nets import q_network
from apex.wire.protocol import Message
from apex.wire.schema import episode_record

if TYPE_CHECKING:
    from apex.core import EpisodeRecord
    from apex.core.episode import Episode
    from apex.envs.make import EnvSpec


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
        self._start(config, list(setup["eval_envs"]), seed, tick)
        self.net = q_network(self.spec, config.model)
        self.explorer = Explorer(
            self.epsilons,
            self.spec.num_actions,
            np.random.default_rng(seed),
            config.apex_dqn.eps_repeat_mu,
            plain=self.eval_mask,
        )

    def _start(self, config: Config, eval_mask: list[bool], seed: int, tick: Callable[[], None]) -> None:
        """The environments (one per entry of ``eval_mask``: which evaluate), their frame
        stacks and n-step chunkers, each at its first frame."""
        self.eval_mask = eval_mask
        self.envs = VectorEnv(config.env, len(eval_mask), seed, tick)
        self.spec = self.envs.spec
        self.stacker = FrameStacker(self.num_envs, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.chunkers = [self._chunker() for _ in range(self.num_envs)]
        self.steps = 0  # vector steps taken
        self.weights_version = -1
        self._pending: list[Chunk] = []
        for i, frame in enumerate(self.envs.reset()):
            self.stacker.reset(i, frame)
            self.chunkers[i].start(frame)

    def _chunker(self) -> NStepChunker:
        return make_chunker(self.config, self.spec.stack)

    @property
    def chunk_transitions(self) -> int:
        return self.config.apex_dqn.chunk_transitions

    @property
    def num_envs(self) -> int:
        return len(self.eval_mask)

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def _q_values(self, obs: np.ndarray) -> np.ndarray:
        return self.net(obs)

    def _choose(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(each environment's action on the ladder, Q of that action, the state's value
        max_a Q) for observations [K, ...]."""
        q = self._q_values(obs)
        actions = self.explorer.actions(q.argmax(axis=1))
        return actions, q[np.arange(self.num_envs), actions], q.max(axis=1)

    def _values(self, obs: np.ndarray) -> np.ndarray:
        """The bootstrap values of final observations [n, ...] (a truncated episode's)."""
        values: np.ndarray = self._q_values(obs).max(axis=1)
        return values

    def _episode_ended(self, row: int) -> None:
        self.explorer.reset(row)

    def act(self) -> tuple[Chunk | None, list[EpisodeRecord]]:
        """One step of every environment: (a batch to send, or None; finished episodes as
        [return, length, is_eval])."""
        actions, q_taken, values = self._choose(self.stacker.obs)
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
            final_values = dict(zip(truncated_only, self._values(obs)))
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
                self._episode_ended(i)
            else:
                self.stacker.push(i, frames[i])
        if sum(len(c["action"]) for c in self._pending) < self.chunk_transitions:
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

    def _values(self, obs: np.ndarray) -> np.ndarray:
        """The bootstrap values of final observations [n, ...] (a truncated episode's)."""
        values: np.ndarray = self.net(obs).max(axis=1)
        return values

    @property
    def chunk_transitions(self) -> int:
        return self.config.apex_dqn.chunk_transitions

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
        final_values = dict(zip(cut, self._values(obs[cut]))) if cut else {}
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
            if count >= self.chunk_transitions:
                batches.append((merge_chunks(chunks), records))
                chunks, records, count = [], [], 0
        if flush and chunks:
            batches.append((merge_chunks(chunks), records))
            chunks, records = [], []
        # what is left waits for more; the records of episodes that ended go with the last chunk
        self._pending = [(chunk, []) for chunk in chunks[:-1]] + [(chunks[-1] if chunks else None, records)]
        return batches
