"""The learner's ingest thread: batches from the trajectory stream, checked against the
algorithm's schema and their session's limits, inserted into the learner core, and counted
(``RunCounters``, which the main loop reads for metrics, stop conditions and checkpoints).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apex.config import Config
from apex.errors import ProtocolError, RejectedMessage
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


MAX_HOSTS = 1024  # hosts counted apart in env_steps_by_host; the steps of any more go under OTHER_HOSTS
OTHER_HOSTS = "other hosts"


class RunCounters:
    """What ingest counts of the run, under ``lock``: env steps (in all and by the sending
    actor's address), episode returns, and the policy lags of the batches since the last
    ``take_lags``."""

    def __init__(self, policies: tuple[str, ...] = ()) -> None:
        """``policies``: a multi-agent run's policies, whose agents' returns are kept apart
        (``stats`` then holds the team returns)."""
        self.lock = threading.Lock()
        self.stats = EpisodeStats()
        self.matches: list[tuple[int, int]] = []  # self-play's, since the learner last took them
        self.policy_stats = {name: EpisodeStats() for name in policies}
        self.env_steps = 0
        self.env_steps_by_host: dict[str, int] = {}
        self.lags: list[int] = []

    def take_lags(self) -> list[int]:
        """The lags gathered since the last call (call with ``lock`` held)."""
        lags, self.lags = self.lags, []
        return lags

    def add_rank_report(self, report: dict[str, Any]) -> None:
        """What another rank of a learner group counted since its last report
        (``apex.learner.follower.RankCounts``; call with ``lock`` held)."""
        self.env_steps += report["env_steps"]
        for host, steps in report["by_host"].items():
            self.add_host_steps(host, steps)
        for episode_return, is_eval in report["episodes"]:
            self.stats.add(episode_return, is_eval)
        for name, episodes in report["policy_episodes"].items():
            for episode_return, is_eval in episodes:
                self.policy_stats[name].add(episode_return, is_eval)
        self.matches.extend((opponent, outcome) for opponent, outcome in report["matches"])
        self.lags.extend(report["lags"])

    def add_host_steps(self, host: str, steps: int) -> None:
        """``steps`` to ``host``'s count; past MAX_HOSTS hosts, to OTHER_HOSTS' (a peer with
        many addresses, an IPv6 network's, cannot grow the map, every metrics row, and every
        checkpoint without end). Call with ``lock`` held."""
        if host not in self.env_steps_by_host and len(self.env_steps_by_host) >= MAX_HOSTS:
            host = OTHER_HOSTS
        self.env_steps_by_host[host] = self.env_steps_by_host.get(host, 0) + steps

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint (call with ``lock`` held)."""
        state = {
            "env_steps": self.env_steps,
            "env_steps_by_host": dict(self.env_steps_by_host),
            "episode_stats": self.stats.state_dict(),
        }
        if self.policy_stats:
            state["policy_episode_stats"] = {name: stats.state_dict() for name, stats in self.policy_stats.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env_steps = state["env_steps"]
        self.env_steps_by_host = dict(state.get("env_steps_by_host", {}))
        self.stats.load_state_dict(state["episode_stats"])
        for name, stats in state.get("policy_episode_stats", {}).items():
            if name in self.policy_stats:
                self.policy_stats[name].load_state_dict(stats)


@dataclass(frozen=True)
class IngestTarget:
    """Where a policy's batches go: its learner core, and its agents in each environment (a
    session's batch limits are for an actor's environments times these seats)."""

    core: LearnerCore
    seats: int = 1


@dataclass(slots=True)
class _Accepted:
    msg: Message
    policy: str | None
    arrays: dict[str, Any]
    env_steps: int
    episodes: list[tuple[float, int, bool]]
    used: int  # of the session's step budget
    teams: list[tuple[float, int, bool]] = field(default_factory=list)
    matches: list[tuple[int, int]] = field(default_factory=list)


class Ingest:
    """The thread that feeds the learner cores. (One thread: a second one that decoded while
    this one inserted measured slower, the two fighting over the GIL.)"""

    def __init__(
        self,
        receiver: TrajectoryReceiver,
        targets: dict[str | None, IngestTarget],
        config: Config,
        step_limit: int,
        counters: RunCounters,
        published_version: Callable[[], int],
        wait_to_insert: Callable[[float], bool],
        check_matches: Callable[[Any], list[tuple[int, int]]] | None = None,
    ) -> None:
        """``targets``: the learner core of each policy that trains, by the name batches give
        in ``info.policy`` (a single-agent run: one, under None, and batches name none);
        ``step_limit``: the longest episode a batch's records may claim;
        ``published_version``: the version of the weights last published (for the policy
        lag of each batch)."""
        self.receiver, self.targets, self.config = receiver, targets, config
        self.multi_agent = None not in targets
        # TrainingCore.wait_to_insert: a batch is taken once some core has room for it
        self.wait_to_insert = wait_to_insert
        self.step_limit = step_limit
        self.counters = counters
        self.published_version = published_version
        self.check_matches = check_matches  # self-play's (MultiPolicyLearner.check_matches)
        self._episodes = functools.partial(
            check_episodes, step_limit=step_limit, max_abs_reward=config.transport.max_abs_reward
        )
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
        receiver = self.receiver
        while not self._stop.is_set():
            if not self.wait_to_insert(INGEST_WAIT_S):
                continue
            msg = receiver.recv(timeout_ms=int(INGEST_WAIT_S * 1000))
            if msg is None:
                continue
            # Whatever else is already waiting goes in with it: one insert for several
            # small batches pays the bookkeeping once.
            group = [msg]
            while len(group) < INGEST_GROUP and (more := receiver.recv(timeout_ms=0)) is not None:
                group.append(more)
            accepted: list[_Accepted] = []
            for m in group:
                try:
                    accepted.append(self._validate(m))
                except ProtocolError as e:
                    receiver.reject(e)
            errors: dict[int, ProtocolError | None] = {}
            for policy, target in self.targets.items():
                mine = [a for a in accepted if a.policy == policy]
                if mine:
                    errors.update(zip(map(id, mine), target.core.insert_many([a.arrays for a in mine])))
            self._count(accepted, errors)

    def _count(self, accepted: list[_Accepted], errors: dict[int, ProtocolError | None]) -> None:
        """Counts what was stored (its env steps, episodes and policy lag); refuses the rest."""
        version = self.published_version()
        counters = self.counters
        with counters.lock:
            for a in accepted:
                session: Session = a.msg.session
                if (error := errors[id(a)]) is not None:
                    session.step_budget -= a.env_steps - a.used  # what _validate granted it
                    self.receiver.reject(error)
                    continue
                session.env_steps += a.env_steps
                counters.env_steps += a.env_steps
                host = a.msg.peer or "unknown"
                counters.add_host_steps(host, a.env_steps)
                if a.policy is None:
                    session.episodes += len(a.episodes)
                    for episode_return, _length, is_eval in a.episodes:
                        counters.stats.add(episode_return, is_eval)
                else:  # the agents' own returns by policy; the teams' are the run's
                    session.episodes += len(a.teams)
                    for episode_return, _length, is_eval in a.episodes:
                        counters.policy_stats[a.policy].add(episode_return, is_eval)
                    for episode_return, _length, is_eval in a.teams:
                        counters.stats.add(episode_return, is_eval)
                    counters.matches.extend(a.matches)
                if 0 <= a.msg.fields["weights_version"] <= version:  # an older learner's versions say nothing
                    counters.lags.append(version - a.msg.fields["weights_version"])

    def _validate(self, msg: Message) -> _Accepted:
        """A batch checked against its policy's schema and its session's limits. Raises
        ProtocolError."""
        session: Session = msg.session
        info = msg.fields["info"]
        policy, target = self._target(info) if self.multi_agent else (None, self.targets[None])
        limits = session.limits.get(policy)
        if limits is None:
            limits = session.limits[policy] = target.core.batch_limits(session.num_envs * target.seats)
            if not session.step_budget_set:
                # Episodes under way when the session began were partly played before it.
                seats = sum(t.seats for t in self.targets.values())
                session.step_budget, session.step_budget_set = session.num_envs * self.step_limit * seats, True
        arrays, sizes = target.core.schema.validate(msg.arrays, limits, msg.layout)
        env_steps = target.core.env_steps(sizes)
        budget = session.step_budget + env_steps
        if policy is None:  # a single-agent batch's info is its episode records alone
            episodes, used = self._episodes(info, max_episodes=env_steps, step_budget=budget)
            session.step_budget += env_steps - used
            return _Accepted(msg, None, arrays, env_steps, episodes, used)
        episodes, used = self._episodes(
            {"episodes": info.get("episodes", [])}, max_episodes=env_steps, step_budget=budget
        )
        # A team's episode is as long as the steps of its agents (an AEC env's: one a move).
        teams, _ = self._episodes({"episodes": info.get("teams", [])}, max_episodes=env_steps, step_budget=budget)
        matches = self._matches(info["matches"], len(teams)) if "matches" in info else []
        session.step_budget += env_steps - used
        return _Accepted(msg, policy, arrays, env_steps, episodes, used, teams, matches)

    def _matches(self, raw: Any, teams: int) -> list[tuple[int, int]]:
        """A batch's self-play matches: at most one an episode it reports. RejectedMessage."""
        if self.check_matches is None:
            raise RejectedMessage("info", "info.matches from a run without self-play")
        try:
            matches = self.check_matches(raw)
        except ValueError as e:
            raise RejectedMessage("matches", str(e)) from None
        if len(matches) > teams:
            raise RejectedMessage("matches", f"{len(matches)} matches with {teams} episodes")
        return matches

    def _target(self, info: Any) -> tuple[str, IngestTarget]:
        """(the policy a multi-agent batch's info names, where it goes). RejectedMessage for
        an info of the wrong shape or a policy this learner does not train."""
        if not isinstance(info, dict) or not info.keys() <= {"policy", "episodes", "teams", "matches"}:
            shape = '{"policy": name, "episodes": [...], "teams": [...], "matches": [...]}'
            raise RejectedMessage("info", f"batch info must be {shape}")
        policy = info.get("policy")
        target = self.targets.get(policy) if isinstance(policy, str) else None
        if target is None or not isinstance(policy, str):
            shown = repr(policy)[:80]
            raise RejectedMessage(
                "unknown_policy",
                f"a batch for policy {shown}, and this learner trains {', '.join(map(str, self.targets))}",
            )
        return policy, target
