"""The actor: ``Actor`` steps K environments with one batched forward pass (the core), and
``run_actor`` is the process around it (handshake, weights, batches, heartbeats, stop)."""

from __future__ import annotations

import logging
import signal
import time

import numpy as np
import torch

from apex import config as config_module
from apex.algos import apex_dqn
from apex.config import Config
from apex.envs import VectorEnv
from apex.models import QNetwork, load_numpy_weights
from apex.protocol import Message
from apex.transport import LearnerClient, TransportOptions

log = logging.getLogger(__name__)


class FrameStacker:
    """The last ``stack`` frames of each environment, as network input."""

    def __init__(self, num_envs: int, stack: int, frame_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.obs = np.zeros((num_envs, stack, *frame_shape), dtype)

    def reset(self, i: int, frame: np.ndarray) -> None:
        self.obs[i] = frame  # broadcast: the first frame repeated, as the chunker stores it

    def push(self, i: int, frame: np.ndarray) -> None:
        self.obs[i, :-1] = self.obs[i, 1:]
        self.obs[i, -1] = frame

    def peek(self, i: int, frame: np.ndarray) -> np.ndarray:
        """Env i's observation if ``frame`` came next (for a final frame)."""
        return np.concatenate([self.obs[i, 1:], frame[None]])


class Actor:
    """K environments, their exploration rates, and an epsilon-greedy Q network."""

    def __init__(self, config: Config, epsilons: list[float], eval_mask: list[bool], seed: int) -> None:
        torch.set_num_threads(1)
        self.config = config
        self.epsilons = np.asarray(epsilons)
        self.eval_mask = list(eval_mask)
        self.envs = VectorEnv(config.env, len(epsilons), seed)
        self.spec = self.envs.spec
        self.net = QNetwork(self.spec, config.model).eval()
        self.stacker = FrameStacker(len(epsilons), self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.chunkers = [
            apex_dqn.NStepChunker(
                self.spec.stack, config.learner.n_step, config.learner.gamma, config.actor.chunk_transitions,
                clip_rewards=config.is_atari and config.env.clip_rewards,
            )
            for _ in epsilons
        ]
        self.rng = np.random.default_rng(seed)
        self.steps = 0  # vector steps taken
        self.weights_version = -1
        self._lengths = [0] * len(epsilons)  # steps into each env's current episode
        frames = self.envs.reset()
        for i, frame in enumerate(frames):
            self.stacker.reset(i, frame)
            self.chunkers[i].start(frame)

    @property
    def num_envs(self) -> int:
        return len(self.epsilons)

    def set_weights(self, msg: Message) -> None:
        load_numpy_weights(self.net, msg.arrays)
        self.weights_version = msg.fields["version"]

    def _q_values(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.net(torch.from_numpy(obs)).numpy()

    def act(self) -> tuple[list[dict], list[list]]:
        """One step of every environment: (finished chunks, finished episodes as
        [return, length, is_eval])."""
        q = self._q_values(self.stacker.obs)
        greedy = q.argmax(axis=1)
        explore = self.rng.random(self.num_envs) < self.epsilons
        actions = np.where(explore, self.rng.integers(0, self.spec.num_actions, self.num_envs), greedy)
        q_taken = q[np.arange(self.num_envs), actions]
        values = q.max(axis=1)
        chunks = []
        for i, chunker in enumerate(self.chunkers):
            chunk = chunker.record_action(actions[i], q_taken[i], values[i])
            if chunk is not None:
                chunks.append(chunk)
        frames, rewards, terminated, truncated, final = self.envs.step(actions)
        self.steps += 1
        truncated_only = [i for i in final if truncated[i] and not terminated[i]]
        final_values = {}
        if truncated_only:  # bootstrap values of the final observations
            obs = np.stack([self.stacker.peek(i, final[i]) for i in truncated_only])
            final_values = dict(zip(truncated_only, self._q_values(obs).max(axis=1)))
        episodes = []
        for i, chunker in enumerate(self.chunkers):
            chunker.record_step(rewards[i], final.get(i, frames[i]))
            self._lengths[i] += 1
            if i in final:
                chunk = chunker.end_episode(bool(terminated[i]), float(final_values.get(i, 0.0)))
                if chunk is not None:
                    chunks.append(chunk)
                episodes.append([chunker.episode_return, self._lengths[i], self.eval_mask[i]])
                self._lengths[i] = 0
                chunker.start(frames[i])
                self.stacker.reset(i, frames[i])
            else:
                self.stacker.push(i, frames[i])
        return chunks, episodes

    def close(self) -> None:
        self.envs.close()


def run_actor(
    host: str,
    port: int,
    *,
    actor_index: int | None = None,
    num_envs: int | None = None,
    options: TransportOptions = TransportOptions(),
) -> int:
    """The actor process: connect, act, send, until the learner says stop. Returns 0."""
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    client = LearnerClient(host, port, actor_index=actor_index, num_envs=num_envs or 0, options=options)
    actor = None
    try:
        welcome = client.handshake()
        spec = welcome.fields["spec"]
        config = config_module.from_dict(spec["config"])
        actor = Actor(config, spec["epsilons"], spec["eval_envs"], spec["seed"])
        log.info("actor %d: %d envs of %s, epsilons %.4f..%.4f", client.actor_index, actor.num_envs,
                 config.env.id, min(spec["epsilons"]), max(spec["epsilons"]))
        pending_chunks: list[dict] = []
        pending_episodes: list[list] = []
        pending_steps = 0
        last_tick = 0.0
        sent = False
        while client.stop_reason is None and stopping["signal"] is None:
            now = time.monotonic()
            if now - last_tick > 0.02:
                client.tick()
                last_tick = now
            # Newest weights every few steps, and after every send: a send may have waited
            # for the learner while it trained on.
            if sent or actor.steps % config.actor.weights_update_steps == 0:
                if (weights := client.take_weights()) is not None:
                    actor.set_weights(weights)
                sent = False
            chunks, episodes = actor.act()
            pending_chunks += chunks
            pending_episodes += episodes
            pending_steps += actor.num_envs
            if sum(len(c["action"]) for c in pending_chunks) >= config.actor.chunk_transitions:
                info = {"episodes": pending_episodes, "env_steps": pending_steps}
                if not client.send_batch(apex_dqn.merge_chunks(pending_chunks), weights_version=actor.weights_version, info=info):
                    break  # a stop arrived while waiting to send
                pending_chunks, pending_episodes, pending_steps = [], [], 0
                sent = True
        log.info("actor %s stopping: %s", client.actor_index, client.stop_reason or f"signal {stopping['signal']}")
        return 0
    finally:
        if actor is not None:
            actor.close()
        client.close()
