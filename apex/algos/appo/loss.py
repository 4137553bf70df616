"""APPO's loss: PPO's clipped surrogate on V-trace advantages against a target policy (Luo et
al. 2020, "IMPACT: Importance Weighted Asynchronous Architectures with Clipped Target
Networks", Sec. 3; Schulman et al. 2017 for the surrogate and the KL penalty).

Three policies meet: the actors' behaviour policy mu (the log-probabilities they sent), the
target network's pi_old (a copy of the network every ``target_update_every`` updates) and
the network being trained, pi. The surrogate's ratio is pi / pi_old, taken as

    w_t = pi(a_t | x_t) / mu(a_t | x_t) * min(mu(a_t | x_t) / pi_old(a_t | x_t), 2),

which is pi / pi_old except for an action the actor took that pi_old has made unlikely (mu
more than twice pi_old): there the weight is held, so that stale experience cannot push the
policy without bound (IMPACT's clipped target importance weight; RLlib's APPO holds it the
same way). Without it, on CartPole with a policy lag of tens of updates, the policy
collapsed to one action within seconds. Then

    L_pg    = - E[ min(w_t A_t, clip(w_t, 1 - eps, 1 + eps) A_t) ]
    L_v     = E[ (v_t - V(x_t))^2 ] / 2      (with value clipping: the larger of that and the
              error of V_old(x_t) + clip(V(x_t) - V_old(x_t), -c, c))
    L       = L_pg + baseline_cost L_v - entropy_cost H[pi] + kl_coeff KL(pi_old || pi).

Advantages: ``vtrace``, V-trace (``apex.algos.impala.loss.vtrace``) with pi_old as its target
policy, A_t = rho_t (r_t + gamma_t v_{t+1} - V(x_t)) with rho_t = min(rho_bar, pi_old / mu),
v_t its value targets (IMPACT: the target network's ratios to mu, so that the surrogate's
ratio is against a policy that moves slowly); ``gae``, generalised advantage estimation,
A_t = sum_l (prod gamma lambda) delta_{t+l}, delta_t = r_t + gamma_t V(x_{t+1}) - V(x_t), and
v_t = A_t + V(x_t), uncorrected for the actors' lag. V here is the trained network's value,
without gradient; targets and advantages carry no gradient. With ``impala.normalize_advantages`` the
advantages of a minibatch are scaled to mean 0 and standard deviation 1 (as PPO's reference
implementations and Sample Factory do), so that the entropy bonus and the clip mean the same
whatever the scale of the rewards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from apex.algos.impala.loss import normalized, vtrace
from apex.envs.make import EnvSpec
from apex.nets.torch_nets import log_prob_and_entropy, log_probs

MAX_TARGET_WEIGHT = 2.0


@dataclass(frozen=True)
class SurrogateSettings:
    """What ``appo_loss`` takes of the ``impala`` and ``appo`` sections."""

    clip: float
    kl_coeff: float
    value_clip: float | None
    advantages: str  # vtrace | gae
    normalize_advantages: bool
    gae_lambda: float
    rho_bar: float
    c_bar: float
    baseline_cost: float
    entropy_cost: float


class AppoLossOutput(NamedTuple):
    loss: torch.Tensor
    pg_loss: torch.Tensor
    baseline_loss: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor  # KL(pi_old || pi), mean over steps
    clip_fraction: torch.Tensor  # share of steps whose ratio was clipped


@torch.no_grad()
def gae(
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B] gamma_t, 0 at termination
    values: torch.Tensor,  # [T, B] V(x_t)
    bootstrap_value: torch.Tensor,  # [B] V(x_T)
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(value targets A_t + V(x_t), advantages A_t), each [T, B], computed backwards."""
    next_values = torch.cat([values[1:], bootstrap_value[None]])
    deltas = rewards + discounts * next_values - values
    advantages = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * lam * acc
        advantages[t] = acc
    return advantages + values, advantages


def policy_kl(old_params: torch.Tensor, params: torch.Tensor, spec: EnvSpec) -> torch.Tensor:
    """KL(pi_old || pi) per step, [...]: over each categorical component (summed), or the
    diagonal Gaussians' closed form."""
    if spec.continuous:
        old_mean, old_log_std = old_params.chunk(2, dim=-1)
        mean, log_std = params.chunk(2, dim=-1)
        ratio = torch.exp(2 * (old_log_std - log_std))
        terms = log_std - old_log_std + 0.5 * (ratio + (old_mean - mean) ** 2 * torch.exp(-2 * log_std)) - 0.5
        return terms.sum(-1)
    kl = torch.zeros(params.shape[:-1], dtype=params.dtype, device=params.device)
    for old, new in zip(log_probs(old_params, spec.action_nvec), log_probs(params, spec.action_nvec), strict=True):
        kl = kl + (old.exp() * (old - new)).sum(-1)
    return kl


def appo_loss(
    params: torch.Tensor,  # [T+1, B, P] the trained network's policy parameters (the last only bootstraps)
    values: torch.Tensor,  # [T+1, B] its values
    old_params: torch.Tensor,  # [T+1, B, P] the target network's (pi_old), no gradient
    old_values: torch.Tensor,  # [T+1, B] the target network's values (value clipping)
    actions: torch.Tensor,  # [T, B]; [T, B, components] MultiDiscrete; [T, B, D] continuous
    behaviour_logp: torch.Tensor,  # [T, B] log mu(a_t | x_t)
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B]
    settings: SurrogateSettings,
    spec: EnvSpec,
) -> AppoLossOutput:
    """The loss of the module docstring, and its parts (detached) for the metrics."""
    logp, policy_entropy = log_prob_and_entropy(params[:-1], actions, spec)  # [T, B] each
    with torch.no_grad():
        old_logp, _ = log_prob_and_entropy(old_params[:-1], actions, spec)
        if settings.advantages == "vtrace":
            targets, advantages = vtrace(
                behaviour_logp,
                old_logp,
                rewards,
                discounts,
                values[:-1].detach(),
                values[-1].detach(),
                settings.rho_bar,
                settings.c_bar,
            )
        else:
            lam = settings.gae_lambda
            targets, advantages = gae(rewards, discounts, values[:-1].detach(), values[-1].detach(), lam)
        if settings.normalize_advantages:
            advantages = normalized(advantages)
    # pi / pi_old, as (pi / mu) (mu / pi_old) with the second factor at most MAX_TARGET_WEIGHT
    ratio = torch.exp(logp - behaviour_logp) * torch.exp(behaviour_logp - old_logp).clamp(max=MAX_TARGET_WEIGHT)
    clipped = ratio.clamp(1.0 - settings.clip, 1.0 + settings.clip)
    pg_loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    errors = (targets - values[:-1]) ** 2
    if settings.value_clip is not None:
        old = old_values[:-1]
        held = old + (values[:-1] - old).clamp(-settings.value_clip, settings.value_clip)
        errors = torch.maximum(errors, (targets - held) ** 2)
    baseline_loss = 0.5 * errors.mean()
    kl = policy_kl(old_params[:-1], params[:-1], spec).mean()
    policy_entropy = policy_entropy.mean()
    loss = (
        pg_loss
        + settings.baseline_cost * baseline_loss
        - settings.entropy_cost * policy_entropy
        + settings.kl_coeff * kl
    )
    clip_fraction = ((ratio.detach() - 1.0).abs() > settings.clip).float().mean()
    return AppoLossOutput(
        loss, pg_loss.detach(), baseline_loss.detach(), policy_entropy.detach(), kl.detach(), clip_fraction
    )
