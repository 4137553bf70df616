"""A checkpoint's policy network, as `apex eval` and ``apex.load_policy`` act with it: read from
a learner state (a multi-agent checkpoint's by policy name), and its greedy actions."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from apex import algos
from apex import config as config_module
from apex.config.trust import from_elsewhere
from apex.envs.make import EnvSpec, env_spec
from apex.envs.multi_agent import is_multi_agent
from apex.envs.policy_map import multi_agent_spec
from apex.errors import ApexError


def network_from_checkpoint(
    state: dict[str, Any],
    allow_imports: Collection[str] = (),
    source: str = "the checkpoint",
    policy: str | None = None,
) -> tuple[config_module.Config, EnvSpec, torch.nn.Module]:
    """(config, env spec, the network the policy acts with, in eval mode); ApexError (one
    line) if the state lacks its algorithm's network or the network does not fit, or if its
    config (from ``source``) would import a module ``allow_imports`` does not allow. A
    multi-agent checkpoint's ``policy`` (where it has one only, that one)."""
    config = from_elsewhere(state["config"], allow_imports, source)
    if is_multi_agent(config.env):
        spec, state = policy_state(config, state, policy, source)
    elif policy is not None:
        raise ApexError(f"{source} is a single-agent run's, which has no policies by name: leave out --policy")
    else:
        spec = env_spec(config.env)
    algorithm_policy = algos.get(config.algo).learner().policy
    key, what = algorithm_policy.checkpoint_key, algorithm_policy.description
    if not isinstance(state.get(key), dict):
        raise ApexError(
            f"the checkpoint has no {key!r} ({what} of an {config.algo} checkpoint): "
            "pass a ckpt-*.pt written by apex learner"
        )
    net = algorithm_policy.network(spec, config.model)
    try:
        net.load_state_dict(state[key])
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        raise ApexError(
            f"the checkpoint's {key!r} does not fit {what} of its own config "
            f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
        ) from None
    return config, spec, net.eval()


def policy_state(
    config: config_module.Config, state: dict[str, Any], policy: str | None, source: str
) -> tuple[EnvSpec, dict[str, Any]]:
    """(the spec, the learner state) of a multi-agent checkpoint's ``policy`` (None: its only
    one); ApexError naming the policies there are."""
    policies = state.get("policies")
    names = sorted(policies) if isinstance(policies, dict) else []
    if policy is None and len(names) == 1:
        policy = names[0]
    if policy is None or policy not in names:
        given = "no --policy" if policy is None else f"--policy {policy}"
        raise ApexError(
            f"{source} holds the policies {', '.join(names) or 'none'} and got {given}: name one with --policy"
        )
    spec = multi_agent_spec(config).policies[policy].spec
    part = policies[policy] if isinstance(policies, dict) else {}
    return spec, part


def greedy_actions(
    config: config_module.Config,
    net: torch.nn.Module,
    obs: torch.Tensor,
    state: Any = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """The most valuable (Ape-X) or most likely (IMPALA: the mean of a Gaussian) action of
    each observation in a batch, among the legal ones where ``mask`` [B, A] says: [B],
    [B, components] for MultiDiscrete, [B, D] for continuous; and a recurrent core's next
    state (``state``: where the last call left it, None at episodes' starts), else None."""
    return algos.get(config.algo).learner().policy.greedy(net, obs, state, mask)
