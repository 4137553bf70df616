"""Ape-X DDPG's losses (Horgan et al. 2018's Ape-X DPG; TD3's fixes, Fujimoto et al. 2018), in
the papers' notation. For a batch of n-step transitions (s, a, G, gamma^n, s') with importance
weights w from the prioritized replay:

    a'  = clip(mu'(s') + clip(sigma~ * eps, -c, c) * h, low, high),  eps ~ N(0, I)
    y   = G + gamma^n * min_i Q'_i(s', a')                   (twin critics; Q'_1 alone without)
    L_Q = mean_b w_b * sum_i (y_b - Q_i(s_b, a_b))^2 / 2
    p_b = |y_b - Q_1(s_b, a_b)|                               (the new priorities)
    L_mu = -mean_b Q_1(s_b, mu(s_b))                          (every policy_delay updates)

mu' and Q' are the target networks (Polyak averages), h each action's half range, sigma~ the
target smoothing noise (``apex_ddpg.target_noise``; 0: none) and c its clip. The policy's
loss moves only the policy: the critic's weights take no gradient from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from apex.nets.deterministic import DeterministicActorCritic


@dataclass(frozen=True)
class TargetSettings:
    twin_critics: bool
    target_noise: float
    target_noise_clip: float


class CriticOutput(NamedTuple):
    loss: torch.Tensor  # L_Q, a scalar
    q_mean: torch.Tensor  # mean Q_1(s, a)
    td_abs_mean: torch.Tensor
    priorities: torch.Tensor  # [B], detached


def bootstrap_targets(
    target: DeterministicActorCritic,
    reward: torch.Tensor,
    discount: torch.Tensor,
    next_obs: torch.Tensor,
    settings: TargetSettings,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """y [B]: the n-step return bootstrapped from the target networks at a smoothed target
    action (no gradient)."""
    with torch.no_grad():
        policy = target.policy
        next_action = policy(next_obs)
        if settings.target_noise > 0:
            eps = torch.randn(next_action.shape, generator=generator, device=next_action.device)
            smoothing = (eps * settings.target_noise).clamp(-settings.target_noise_clip, settings.target_noise_clip)
            mid, half = policy.action_mid, policy.action_half
            next_action = torch.maximum(torch.minimum(next_action + smoothing * half, mid + half), mid - half)
        next_q = target.q_values(next_obs, next_action)
        next_value = next_q.min(dim=0).values if settings.twin_critics else next_q[0]
        return reward + discount * next_value


def critic_loss(
    net: DeterministicActorCritic,
    obs: torch.Tensor,
    action: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
) -> CriticOutput:
    """L_Q over every critic of ``net``, and the priorities from the first."""
    q = net.q_values(obs, action)  # [critics, B]
    td = y - q
    loss = (weights * (0.5 * td.pow(2)).sum(dim=0)).mean()
    priorities = td[0].detach().abs()
    return CriticOutput(loss, q[0].detach().mean(), priorities.mean(), priorities)


def policy_loss(net: DeterministicActorCritic, obs: torch.Tensor) -> torch.Tensor:
    """L_mu = -mean Q_1(s, mu(s)), with the first critic's weights held (no gradient to them):
    the gradient flows through the action into the policy only."""
    critic = net.critics[0]
    held = [p for p in critic.parameters() if p.requires_grad]
    for p in held:
        p.requires_grad_(False)
    try:
        loss: torch.Tensor = -critic(obs, net.policy(obs)).mean()
        return loss
    finally:
        for p in held:
            p.requires_grad_(True)
