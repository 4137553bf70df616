"""The learner's ingest thread: batches from the trajectory stream, checked against the
algorithm's schema and their session's limits, inserted into the learner core, and counted
(``RunCounters``, which the main loop reads for metrics, stop conditions and checkpoints).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from apex.config import Config
from apex.errors import ProtocolError
from apex.learner.metrics import EpisodeStats
from apex.system.logs import RateLimitedLog
from apex.transport import Session, TrajectoryReceiver
from apex.wire.protocol import Message
from apex.wire.schema import check_episodes

if TYPE_CHECKING:
    from apex.core import LearnerCore

log = logging.getLogger(__name__)

INGEST_GROUP = 8  # batches already waiting that are inserted together
INGEST_WAIT_S = 0.05  # longest the thread waits (for room, for a batch) before looking at its stop flag


class RunCounters:
    """What ingest counts of the run, under ``lock``: env steps (in all and by the sending
    actor's address), episode returns, and the policy lags of the batches since the last
    ``take_lags``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = EpisodeStats()
        self.env_steps = 0
        self.env_steps_by_host: dict[str, int] = {}
        self.lags: list[int] = []

    def take_lags(self) -> list[int]:
        """The lags gathered since the last call (call with ``lock`` held)."""
        lags, self.lags = self.lags, []
        return lags

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint (call with ``lock`` held)."""
        return {
            "env_steps": self.env_steps,
            "env_steps_by_host": dict(self.env_steps_by_host),
            "episode_stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env_steps = state["env_steps"]
        self.env_steps_by_host = dict(state.get("env_steps_by_host", {}))
        self.stats.load_state_dict(state["episode_stats"])


class Ingest:
    """The thread that feeds the learner core. (One thread: a second one that decoded while
    this one inserted measured slower, the two fighting over the GIL.)"""

    def __init__(
        self,
        receiver: TrajectoryReceiver,
        core: LearnerCore,
        config: Config,
        step_limit: int,
        counters: RunCounters,
        published_version: Callable[[], int],
    ) -> None:
        """``core``: the algorithm's learner core; ``step_limit``: the longest episode a
        batch's records may claim; ``published_version``: the version of the weights last
        published (for the policy lag of each batch)."""
        self.receiver, self.core, self.config = receiver, core, config
        self.step_limit = step_limit
        self.counters = counters
        self.published_version = published_version
        self.internal_errors = 0  # our own bugs met while ingesting: logged with a traceback
        self._bug_log = RateLimitedLog(log, interval_s=10.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._ingest_some()
            except Exception:  # our own bug, not the sender's: loud, counted apart, and ingest goes on
                self.internal_errors += 1
                self._bug_log.exception("ingest failed (a bug in apex, please report it); continuing")

    def _ingest_some(self) -> None:
        receiver, counters = self.receiver, self.counters
        while not self._stop.is_set():
            if not self.core.wait_to_insert(timeout=INGEST_WAIT_S):
                continue
            msg = receiver.recv(timeout_ms=int(INGEST_WAIT_S * 1000))
            if msg is None:
                continue
            # Whatever else is already waiting goes in with it: one insert for several
            # small batches pays the bookkeeping once.
            group = [msg]
            while len(group) < INGEST_GROUP and (more := receiver.recv(timeout_ms=0)) is not None:
                group.append(more)
            accepted = []
            for m in group:
                try:
                    accepted.append((m, *self._validate(m)))
                except ProtocolError as e:
                    receiver.reject(e)
            errors = self.core.insert_many([arrays for _, arrays, *_ in accepted])
            version = self.published_version()
            with counters.lock:
                for (m, _, env_steps, episodes, used), error in zip(accepted, errors):
                    session: Session = m.session
                    if error is not None:
                        session.step_budget -= env_steps - used  # what _validate granted it
                        receiver.reject(error)
                        continue
                    session.env_steps += env_steps
                    session.episodes += len(episodes)
                    counters.env_steps += env_steps
                    host = m.peer or "unknown"
                    counters.env_steps_by_host[host] = counters.env_steps_by_host.get(host, 0) + env_steps
                    for episode_return, _length, is_eval in episodes:
                        counters.stats.add(episode_return, is_eval)
                    if 0 <= m.fields["weights_version"] <= version:  # an older learner's versions say nothing
                        counters.lags.append(version - m.fields["weights_version"])

    def _validate(self, msg: Message) -> tuple[dict[str, Any], int, list[tuple[float, int, bool]], int]:
        """A batch checked against the algorithm's schema and its session's limits: (arrays
        as stored, env steps it stands for, its episode records, their steps). Raises
        ProtocolError."""
        session: Session = msg.session
        if not session.limits:
            session.limits = self.core.batch_limits(session.num_envs)
            # Episodes under way when the session began were partly played before it.
            session.step_budget = session.num_envs * self.step_limit
        arrays, sizes = self.core.schema.validate(msg.arrays, session.limits, msg.layout)
        env_steps = self.core.env_steps(sizes)
        episodes, used = check_episodes(
            msg.fields["info"],
            max_episodes=env_steps,
            step_limit=self.step_limit,
            max_abs_reward=self.config.transport.max_abs_reward,
            step_budget=session.step_budget + env_steps,
        )
        session.step_budget += env_steps - used
        return arrays, env_steps, episodes, used
