"""The Python API: train from a script or a notebook, load a config, act with a trained policy.

``train`` runs the same processes as ``apex run`` (a learner and N actors, each a fresh
Python process), so an environment must be importable there: registered by a module named
in ``env.imports`` or by the ``module`` of ``env.id: module:Id``. One registered only in the
calling process (a notebook cell) is refused before anything starts, saying so.

What each function needs (the launcher, checkpoints, torch for a policy) is imported inside
it: ``import apex`` stays light, and a script that only loads a config never imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from apex import config as config_module
from apex.algos.masks import legal_actions
from apex.config import Config, StopConditions
from apex.errors import ApexError
from apex.system.files import RefusedFile, open_regular, read_regular

if TYPE_CHECKING:
    pass

MAX_SUMMARY_BYTES = 1 << 20
MAX_METRICS_BYTES = 1 << 40  # a run's whole metrics.jsonl: a regular file, read a piece at a time
TAIL_READ_BYTES = 16 << 20

# Run in a fresh interpreter (as the learner and the actors are) to see that it can make
# the environment: the config comes on stdin.
_PROBE = """
import json, sys
from apex import config
from apex.envs.policy_map import check_env
from apex.errors import ApexError
try:
    cfg = config.from_dict(json.load(sys.stdin))
    check_env(cfg)
except ApexError as e:
    sys.exit(str(e))
"""


@dataclass(frozen=True)
class RunResult:
    """What ``train`` returns: summary.json's content, the run directory, and the checkpoint
    with the best return_mean_100 (the newest where none was scored; None if none was written)."""

    summary: dict[str, Any]
    logdir: Path
    best_checkpoint: Path | None


def load_config(path_or_name: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """A config from a YAML file or a shipped preset's name (None: the embedded default),
    with ``overrides`` applied like --set: ``{"apex_dqn.lr": 1e-3, "env.id": "Acrobot-v1"}``."""
    return config_module.load(path_or_name, _set_flags(overrides))


def _set_flags(overrides: Mapping[str, Any] | None) -> list[str]:
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise ApexError(
            f"overrides must be a mapping of dotted keys to values, e.g. {{'apex_dqn.lr': 1e-3}}, "
            f"got {type(overrides).__name__}"
        )
    # JSON is YAML: each value is read back as the value it is.
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def _resolve(config: str | Path | Config | None, overrides: Mapping[str, Any] | None) -> Config:
    if isinstance(config, Config):
        return config_module.load_dict(config.to_dict(), _set_flags(overrides))
    return load_config(config, overrides)


def train(
    config: str | Path | Config | None = None,
    *,
    actors: int = 2,
    stop_return: float | None = None,
    stop_seconds: float | None = None,
    stop_env_steps: int | None = None,
    logdir: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    on_metrics: Callable[[dict[str, Any]], None] | None = None,
    port: int | None = None,
) -> RunResult:
    """Trains as ``apex run`` does (a learner and ``actors`` actor processes on this machine)
    until a stop condition, and returns the run's summary, directory and best checkpoint.

    ``config`` is a YAML file, a shipped preset's name or a Config (None: the embedded
    default); ``overrides`` a mapping like --set; ``on_metrics`` is called with each new row
    of metrics.jsonl while the run goes on (in this thread; an exception from it stops the
    run). Works from any thread (signals are left alone off the main thread). Raises
    ApexError, before anything starts, for a bad config, an environment the processes cannot
    make, or taken ports; and if the learner fails (KeyboardInterrupt if it was interrupted).
    """
    from apex.checkpoint import best_and_newest
    from apex.envs.policy_map import check_env
    from apex.run import launch

    if actors < 1:
        raise ApexError(f"actors must be >= 1, got {actors}")
    stop = StopConditions(stop_return, stop_seconds, stop_env_steps)
    if stop == StopConditions():
        raise ApexError("apex.train needs a stop condition: stop_return, stop_seconds or stop_env_steps")
    stop.validate()
    cfg = _resolve(config, overrides)
    check_env(cfg)  # here first: the error names the problem without a process started
    _check_in_fresh_process(cfg)
    run_dir = Path(logdir) if logdir is not None else launch.default_logdir(cfg)
    tail = _MetricsTail(run_dir / "metrics.jsonl", on_metrics) if on_metrics is not None else None
    code = launch.run(cfg, actors, run_dir, stop, port if port is not None else cfg.transport.port, on_tick=tail)
    if tail is not None:
        tail()  # the rows written at the end
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise ApexError(f"the learner exited with code {code}; its log is above, its files in {run_dir}")
    try:
        summary = json.loads(read_regular(run_dir / "summary.json", MAX_SUMMARY_BYTES))
    except (OSError, ValueError, RefusedFile) as e:
        raise ApexError(f"the run ended but {run_dir / 'summary.json'} could not be read: {e}") from None
    checkpoints = best_and_newest(run_dir)
    return RunResult(summary, run_dir, checkpoints.best or checkpoints.newest)


def _check_in_fresh_process(config: Config) -> None:
    """The learner and the actors are fresh processes: what they cannot import, they cannot
    make, whatever this process has registered."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        input=json.dumps(config.to_dict()),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"it exited with code {probe.returncode}"])[-1]
        raise ApexError(
            f"a fresh Python process cannot make env {config.env.id!r} ({reason}); the learner and the actors "
            "are fresh processes: register the environment in a module and name it in env.imports "
            "(or use env.id: module:Id), rather than only in this script or notebook"
        )


class _MetricsTail:
    """Calls ``on_metrics`` with each whole line appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path, on_metrics: Callable[[dict[str, Any]], None]) -> None:
        self.path = path
        self.on_metrics = on_metrics
        self._offset = path.stat().st_size if path.exists() else 0  # a resumed run's old rows are not new

    def __call__(self) -> None:
        try:
            with open_regular(self.path, MAX_METRICS_BYTES) as f:
                f.seek(self._offset)
                data = f.read(TAIL_READ_BYTES)  # a call's worth; the rest on the next call
        except FileNotFoundError:
            return
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        for line in whole.splitlines():
            if line.strip():
                self.on_metrics(json.loads(line))


class Policy:
    """A trained policy: ``act(obs)`` for one observation or a batch of them, greedy unless
    ``epsilon`` says otherwise. An observation is the environment's own (a ``gym.make`` of
    its id: a Dict, Tuple or Discrete one, a single image frame; a multi-agent agent's, its
    ``action_mask`` included) or what ``make_env()`` adapts it to (``stack`` frames stacked
    on a new first axis where ``stack`` > 1, Atari and images). Image frames given one at a
    time are stacked here, between calls; an action mask restricts the action.

    A recurrent policy (``recurrent``: model.recurrent lstm) carries its core's state from
    one ``act`` to the next, a row per observation of the batch: call ``reset()`` when
    episodes start (a batch of another size starts afresh too), as for the frame stack.

    A multi-agent checkpoint holds a policy for each name of its mapping: ``policy`` is the
    one this acts with (``name``), for any of its agents (``agents``); one that sees the
    agent's index (multi_agent.agent_id_input) needs ``act(obs, agent=...)``."""

    def __init__(
        self, state: dict[str, Any], source: Path, allow_imports: Collection[str] = (), policy: str | None = None
    ) -> None:
        from apex.envs.multi_agent import is_multi_agent
        from apex.run.checkpoint_policy import network_from_checkpoint

        self.config, self.spec, self._net = network_from_checkpoint(
            state, allow_imports, f"checkpoint {source}", policy
        )
        self.source = source
        self.env_config = self.config.env
        self.stack = self.spec.stack
        self.recurrent = self.config.model.recurrent != "none"
        self.multi_agent = is_multi_agent(self.config.env)
        self.name: str | None = None
        self.agents: tuple[str, ...] = ()
        self._reader = self._observation_reader(policy)
        self._rng = np.random.default_rng()
        self._core: Any = None  # the recurrent core's state after the last act (the algorithm's)

    def _observation_reader(self, policy: str | None) -> Any:
        from apex.envs.make import observation_plan_of
        from apex.run.observations import ObservationReader

        if not self.multi_agent:
            return ObservationReader(self.spec, observation_plan_of(self.env_config), expected="an observation")
        from apex.envs.policy_map import multi_agent_spec

        spec = multi_agent_spec(self.config)
        own = spec.policies[policy] if policy is not None else next(iter(spec.policies.values()))
        self.name, self.agents = own.name, own.agents

        def agent_frame(obs: Any, agent: str | None) -> tuple[np.ndarray, np.ndarray | None]:
            if agent is None and own.agent_id_input:
                raise ValueError(f"policy {own.name} sees the agent's index: act(obs, agent=one of {own.agents})")
            agent = agent or own.agents[0]
            if agent not in own.agents:
                raise ValueError(f"agent {agent!r} does not act with policy {own.name} ({', '.join(own.agents)} do)")
            view = spec.views[agent]
            return own.frame(agent, view.frame(obs)), view.mask(obs, None)

        return ObservationReader(self.spec, None, agent_frame, expected=f"an observation of agent {own.agents[0]}")

    def reset(self) -> None:
        """Episodes start: a recurrent policy forgets what it has seen, the frame stack empties."""
        self._core = None
        self._reader.reset()

    def make_env(self, seed: int | None = None, render_mode: str | None = None) -> Any:
        """The environment as apex made it for training (its kwargs and wrappers, and for a
        Gymnasium one the adapter that turns Discrete, Dict, Tuple and image observations
        into frames); a multi-agent one is the PettingZoo environment itself."""
        if self.multi_agent:
            from apex.envs.multi_agent import make_pettingzoo

            return make_pettingzoo(self.env_config)[0]
        from apex.envs.make import make_env

        return make_env(self.env_config, seed, render_mode)

    @property
    def observation_shape(self) -> tuple[int, ...]:
        return self._reader.observation_shape  # type: ignore[no-any-return]

    def act(self, obs: Any, epsilon: float = 0.0, agent: str | None = None) -> int | np.ndarray:
        """The action for one observation (an int; a MultiDiscrete action: an array of its
        components), or for a batch (an array, one row per observation); a legal one where
        the observation holds an action mask. ``agent``: whose observation it is (multi-agent)."""
        import torch

        from apex.run.checkpoint_policy import greedy_actions

        if not 0 <= epsilon <= 1:
            raise ApexError(f"epsilon must be in [0, 1], got {epsilon}")
        batch, mask, single = self._reader.read(obs, agent)
        if self._core is not None and len(self._core[0]) != len(batch):
            self._core = None
        legal = None if mask is None else torch.from_numpy(mask)
        with torch.no_grad():
            greedy, self._core = greedy_actions(
                self.config, self._net, torch.from_numpy(np.ascontiguousarray(batch)), self._core, legal
            )
        actions = greedy.numpy()
        if epsilon > 0:
            explore = self._rng.random(len(actions)) < epsilon
            actions[explore] = self.spec.random_actions(self._rng, int(explore.sum()))
            actions = legal_actions(self._rng, actions, mask)
        return self.spec.env_action(actions[0]) if single else actions


def load_policy(
    path: str | Path, which: str = "best", *, policy: str | None = None, allow_imports: Iterable[str] = ()
) -> Policy:
    """The policy of a checkpoint: a ckpt-*.pt file, or a run directory's best (by
    return_mean_100; the newest where none was scored) or newest checkpoint; of a
    multi-agent one, the policy named ``policy`` (where it has one only, that one). Its
    config may import only the modules of ``allow_imports`` (and APEX_ALLOW_IMPORTS): a
    checkpoint may come from elsewhere, and importing a module runs its code
    (apex.config.trust)."""
    from apex.config.trust import allowed_imports
    from apex.run.evaluation import load_state

    allowed = allowed_imports(_names(allow_imports))
    state, source, _ = load_state(path, which)
    return Policy(state, source, allowed, policy)


def evaluate(
    path: str | Path,
    episodes: int = 10,
    *,
    which: str = "best",
    epsilon: float = 0.0,
    seed: int = 12345,
    policy: str | None = None,
    allow_imports: Iterable[str] = (),
) -> dict[str, Any]:
    """Plays ``episodes`` episodes of a checkpoint (as ``apex eval``); returns what it prints:
    returns, their mean and std, the checkpoint played, env, algorithm, updates.
    ``allow_imports`` as for ``load_policy``."""
    from apex.config.trust import allowed_imports
    from apex.run.evaluation import evaluate as play

    allowed = allowed_imports(_names(allow_imports))
    return play(path, episodes, epsilon, seed, which=which, allow_imports=allowed, policy=policy)


def _names(modules: Iterable[str]) -> list[str]:
    """allow_imports as a list of names: a lone string is one name, not its characters."""
    return [modules] if isinstance(modules, str) else list(modules)
