"""The ``multi_agent`` section: which policy each agent of a PettingZoo environment acts with,
which of them learn, and self-play. A Gymnasium run ignores it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAPPING_FORMS = ("shared", "per_agent")
# A policy's name becomes a metrics key, a TensorBoard tag and a key in checkpoints and
# weights messages: a short plain word.
POLICY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,63}\Z")
MAX_POLICIES = 64
WEIGHT_SEPARATOR = "/"  # a weights message's arrays are named <policy>/<array>: no policy name holds one


def policy_name_problem(name: object) -> str | None:
    """What is wrong with a policy name, or None."""
    if isinstance(name, str) and POLICY_NAME.match(name):
        return None
    return f"a policy name is 1-64 letters, digits, '_' or '-' (not starting with '-'), got {name!r}"


@dataclass(frozen=True)
class SelfPlayConfig:
    enabled: bool = False
    """With a shared policy: in each episode one seat (drawn at random) is the learning
    policy's and the others play the newest policy or a frozen past snapshot of it from a
    pool, drawn per episode and never swapped inside one."""
    snapshot_every_updates: int = 2000
    """A snapshot of the learning policy joins the pool every this many of its updates."""
    pool_size: int = 8
    """Snapshots kept (the oldest leaves first)."""
    latest_prob: float = 0.5
    """Chance that an episode's opponents play the newest weights rather than a snapshot."""
    train_opponents: bool = False
    """Whether the opponents' seats train too (when they play the newest weights)."""

    def problems(self) -> list[str]:
        checks = [
            (self.snapshot_every_updates >= 1, "multi_agent.self_play.snapshot_every_updates must be >= 1"),
            (1 <= self.pool_size <= 1024, "multi_agent.self_play.pool_size must be in 1..1024"),
            (0.0 <= self.latest_prob <= 1.0, "multi_agent.self_play.latest_prob must be in [0, 1]"),
        ]
        return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class MultiAgentConfig:
    mapping: str | dict[str, str] = "shared"
    """Which policy each agent acts with: ``shared`` (one policy named ``shared``),
    ``per_agent`` (one policy an agent, named after its id), a mapping of agent-id glob
    patterns to policy names (``{"red_*": red, "blue_*": blue}``; the first pattern that
    matches wins), or ``module:function`` (agent id -> policy name)."""
    train: list[str] | None = None
    """The policies that learn (null: all); the others act with the weights they start with
    (``init``, else their random initialisation)."""
    init: str | None = None
    """A checkpoint (a file or a run directory: its newest) whose policies of the same names
    this run starts from."""
    agent_id_input: bool = False
    """A shared policy also sees the agent's index among the agents it acts for, one-hot, so
    that one network can still tell them apart."""
    self_play: SelfPlayConfig = field(default_factory=SelfPlayConfig)

    @property
    def mapping_function(self) -> str | None:
        """The ``module:function`` the mapping names, or None."""
        if isinstance(self.mapping, str) and self.mapping not in MAPPING_FORMS:
            return self.mapping
        return None

    def problems(self) -> list[str]:
        problems = []
        if isinstance(self.mapping, str):
            module, sep, function = self.mapping.partition(":")
            if self.mapping not in MAPPING_FORMS and not (sep and module and function.isidentifier()):
                problems.append(
                    "multi_agent.mapping must be shared, per_agent, a mapping of agent-id patterns to "
                    f"policy names, or module:function, got {self.mapping!r}"
                )
        else:
            if not self.mapping or len(self.mapping) > MAX_POLICIES:
                problems.append(f"multi_agent.mapping must map 1..{MAX_POLICIES} patterns to policy names")
            for pattern, name in self.mapping.items():
                if (problem := policy_name_problem(name)) is not None:
                    problems.append(f"multi_agent.mapping[{pattern!r}]: {problem}")
        for name in self.train or []:
            if (problem := policy_name_problem(name)) is not None:
                problems.append(f"multi_agent.train: {problem}")
        if self.self_play.enabled and self.mapping != "shared":
            problems.append("multi_agent.self_play needs multi_agent.mapping: shared (one policy that plays itself)")
        return problems + self.self_play.problems()
