"""`apex eval` of a multi-agent checkpoint: every agent acts greedily (within its action mask)
with its own policy's network from the checkpoint; the returns reported are the team's (the
mean of an episode's agents' returns), or with ``--policy NAME`` those of NAME's agents, and
each policy's beside them."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from apex.config import Config
from apex.envs.policy_map import multi_agent_spec
from apex.errors import ApexError


def play_multi_agent(
    state: dict[str, Any],
    config: Config,
    source: str,
    episodes: int,
    epsilon: float,
    seed: int,
    policy: str | None,
    allow_imports: Collection[str],
) -> dict[str, Any]:
    """Plays ``episodes`` episodes; returns the returns (the team's or ``policy``'s agents'),
    each policy's mean return (``policies``) and the mean length in steps."""
    from apex.run.checkpoint_policy import network_from_checkpoint

    spec = multi_agent_spec(config)
    if policy is not None and policy not in spec.policies:
        raise ApexError(f"{source} has the policies {', '.join(spec.policies)}, not {policy!r}: name one with --policy")
    nets = {name: network_from_checkpoint(state, allow_imports, source, name)[2] for name in spec.policies}
    rng = np.random.default_rng(seed)
    env = spec.make(config)
    returns, lengths, by_policy = [], [], {name: [] for name in spec.policies}  # type: ignore[var-annotated]
    try:
        for episode in range(episodes):
            totals, steps = _episode(env, spec, nets, config, rng, epsilon, seed + episode)
            for name, p in spec.policies.items():
                by_policy[name].append(float(np.mean([totals[a] for a in p.agents if a in totals] or [0.0])))
            team = float(np.mean(list(totals.values()))) if totals else 0.0
            returns.append(by_policy[policy][-1] if policy is not None else team)
            lengths.append(steps)
    finally:
        env.close()
    return {
        "policy": policy,
        "returns": returns,
        "length_mean": float(np.mean(lengths)),
        "policies": {name: float(np.mean(values)) for name, values in by_policy.items()},
    }


def _episode(
    env: Any,
    spec: Any,
    nets: dict[str, torch.nn.Module],
    config: Config,
    rng: np.random.Generator,
    epsilon: float,
    seed: int,
) -> tuple[dict[str, float], int]:
    """One episode: (each agent's return, the environment's steps)."""
    from apex.run.checkpoint_policy import greedy_actions

    totals: dict[str, float] = {}
    stacks: dict[str, np.ndarray] = {}  # each agent's last frames, for policies of stacked images
    outcome = env.reset(seed=seed)
    steps = 0
    while not outcome.done:
        actions = {}
        for turn in outcome.turns:
            name = spec.policy_of[turn.agent]
            mask = None if turn.mask is None else torch.from_numpy(turn.mask[None])
            stack = stacks.get(turn.agent)
            if stack is None:
                stack = np.repeat(turn.frame[None], spec.policies[name].spec.stack, axis=0)
            else:
                stack = np.concatenate([stack[1:], turn.frame[None]])
            stacks[turn.agent] = stack
            obs = torch.from_numpy(np.ascontiguousarray(stack[None]))
            with torch.no_grad():
                greedy, _ = greedy_actions(config, nets[name], obs, None, mask)
            action = greedy[0].numpy()
            if rng.random() < epsilon:
                legal = (
                    np.flatnonzero(turn.mask)
                    if turn.mask is not None
                    else np.arange(spec.policies[name].spec.num_actions)
                )
                action = np.int64(rng.choice(legal))
            actions[turn.agent] = action
        outcome = env.step(actions)
        steps += 1
        for agent, reward in outcome.rewards.items():
            totals[agent] = totals.get(agent, 0.0) + reward
    return totals, steps
