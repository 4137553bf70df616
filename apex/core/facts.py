"""One row per algorithm: what the rest of apex needs to know of an algorithm without importing
it. The config's checks, the command line's choices, the action-space check, checkpoint
validation and ``apex.algos.REGISTRY`` all read this table, so that an algorithm is its
package (``apex/algos/<name>/``, whose ``__init__`` gives ``learner_side()`` and
``actor_side()``) plus one row here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AlgorithmFacts:
    name: str
    """What ``algo`` says: ``--algo NAME``, ``algo: NAME``."""
    title: str
    """How messages and documents name it."""
    sections: tuple[str, ...]
    """The config sections it reads; the first holds its lr, gamma, grad_clip,
    publish_interval and weights_update_steps (``Config.algo_config``)."""
    actions: tuple[str, ...]
    """The action spaces its network and batches handle (after ``apex.envs.spaces.action_plan``):
    ``Discrete``, ``MultiDiscrete``, ``Box``."""
    state_keys: tuple[str, ...]
    """The state dicts its learner's checkpoints hold (checked before any is loaded)."""
    model_cores: tuple[str, ...] = ("none",)
    """The ``model.recurrent`` values it accepts: ``none`` (feed-forward) and the recurrent
    cores its unrolls carry a state for."""
    replay: bool = False
    """It trains from a replay of stored transitions, so rewards are stored as they were
    scaled then (no running normalization: ``env.normalize_reward`` stays off)."""
    package: str = ""
    """The package that gives ``learner_side()`` and ``actor_side()`` (empty: ``apex.algos.<name>``)."""
    preset_suffix: str = ""
    """Its presets are ``configs/<task>_<suffix>.yaml`` (empty: its name), which ``apex bench
    learn`` runs."""

    @property
    def package_name(self) -> str:
        return self.package or f"apex.algos.{self.name}"

    def preset(self, task: str) -> str:
        """The name of its preset for ``task`` (``cartpole``: ``cartpole_apex``)."""
        return f"{task}_{self.preset_suffix or self.name}"


FACTS: dict[str, AlgorithmFacts] = {
    row.name: row
    for row in (
        AlgorithmFacts(
            "apex_dqn",
            "Ape-X DQN",
            ("apex_dqn",),
            ("Discrete",),
            ("online", "target", "optimizer"),
            replay=True,
            preset_suffix="apex",
        ),
        AlgorithmFacts(
            "impala",
            "IMPALA",
            ("impala",),
            ("Discrete", "MultiDiscrete", "Box"),
            ("net", "optimizer"),
            model_cores=("none", "lstm"),
        ),
        # APPO is IMPALA's architecture (its unrolls, queue, optimizer and V-trace in `impala`)
        # with PPO's surrogate (`appo`); its actors are IMPALA's.
        AlgorithmFacts(
            "appo",
            "APPO",
            ("impala", "appo"),
            ("Discrete", "MultiDiscrete", "Box"),
            ("net", "target", "optimizer"),
            model_cores=("none", "lstm"),
        ),
        AlgorithmFacts(
            "apex_ddpg",
            "Ape-X DDPG",
            ("apex_ddpg",),
            ("Box",),
            ("online", "target", "policy", "optimizer"),
            replay=True,
        ),
    )
}

ALGOS = tuple(FACTS)
"""The names ``algo`` takes."""
ALGO_SECTIONS = {name: row.sections for name, row in FACTS.items()}
ALGO_ACTIONS = {name: row.actions for name, row in FACTS.items()}
MODEL_CORES = tuple(dict.fromkeys(core for row in FACTS.values() for core in row.model_cores))
"""Every ``model.recurrent`` value some algorithm accepts."""
WITHOUT_REPLAY = tuple(name for name, row in FACTS.items() if not row.replay)


def accepting_core(core: str) -> tuple[str, ...]:
    """The algorithms that accept ``model.recurrent: core``."""
    return tuple(name for name, row in FACTS.items() if core in row.model_cores)
