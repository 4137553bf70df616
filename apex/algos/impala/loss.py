"""IMPALA's loss: V-trace (Espeholt et al. 2018, Sec. 4.1, eq. 1) and the actor-critic loss on
its targets. For an unroll x_s .. x_{s+n} with behaviour policy mu and target policy pi,
rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu):

    v_s = V(x_s) + sum_{t=s}^{s+n-1} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t V,
    delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t)),

computed backwards as v_s - V(x_s) = delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})), with
per-step discounts gamma_t (0 where the episode terminated). The policy gradient uses
rho_s (r_s + gamma_s v_{s+1} - V(x_s)) (Sec. 4.2). Targets carry no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from apex.envs.make import EnvSpec
from apex.nets.torch_nets import log_prob_and_entropy


class VTraceReturns(NamedTuple):
    vs: torch.Tensor  # [T, B] value targets
    pg_advantages: torch.Tensor  # [T, B] rho-clipped policy-gradient advantages


@torch.no_grad()
def vtrace(
    behaviour_logp: torch.Tensor,  # [T, B] log mu(a_t | x_t)
    target_logp: torch.Tensor,  # [T, B] log pi(a_t | x_t)
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B] gamma_t, 0 at termination
    values: torch.Tensor,  # [T, B] V(x_t)
    bootstrap_value: torch.Tensor,  # [B] V(x_T)
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> VTraceReturns:
    rhos = torch.exp(target_logp - behaviour_logp)
    clipped_rhos = torch.clamp(rhos, max=rho_bar)
    cs = torch.clamp(rhos, max=c_bar)
    next_values = torch.cat([values[1:], bootstrap_value[None]])  # [T, B]
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = torch.empty_like(values)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    pg_advantages = clipped_rhos * (rewards + discounts * next_vs - values)
    return VTraceReturns(vs, pg_advantages)


ADVANTAGE_EPS = 1e-8  # a batch of equal advantages normalizes to zeros


def normalized(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages scaled to mean 0 and standard deviation 1 over the batch (impala.normalize_advantages)."""
    return (advantages - advantages.mean()) / (advantages.std(correction=0) + ADVANTAGE_EPS)


class LossOutput(NamedTuple):
    loss: torch.Tensor
    pg_loss: torch.Tensor
    baseline_loss: torch.Tensor
    entropy: torch.Tensor


def impala_loss(
    params: torch.Tensor,  # [T+1, B, P] policy parameters (the last step only bootstraps)
    values: torch.Tensor,  # [T+1, B]
    actions: torch.Tensor,  # [T, B]; [T, B, components] for MultiDiscrete; [T, B, D] continuous
    behaviour_logp: torch.Tensor,  # [T, B]
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B]
    rho_bar: float,
    c_bar: float,
    baseline_cost: float,
    entropy_cost: float,
    spec: EnvSpec,
    normalize_advantages: bool = False,
) -> LossOutput:
    """The V-trace actor-critic loss. A MultiDiscrete policy is a product of independent
    categoricals, a continuous one of independent Gaussians: log pi(a | x) and the entropy
    are sums over the components. With ``normalize_advantages`` the policy gradient's
    advantages are ``normalized`` over the batch (the value targets are not)."""
    target_logp, policy_entropy = log_prob_and_entropy(params[:-1], actions, spec)  # [T, B] each
    returns = vtrace(
        behaviour_logp,
        target_logp.detach(),
        rewards,
        discounts,
        values[:-1].detach(),
        values[-1].detach(),
        rho_bar,
        c_bar,
    )
    advantages = normalized(returns.pg_advantages) if normalize_advantages else returns.pg_advantages
    pg_loss = -(target_logp * advantages).mean()
    baseline_loss = 0.5 * ((returns.vs - values[:-1]) ** 2).mean()
    policy_entropy = policy_entropy.mean()
    loss = pg_loss + baseline_cost * baseline_loss - entropy_cost * policy_entropy
    return LossOutput(loss, pg_loss.detach(), baseline_loss.detach(), policy_entropy.detach())
