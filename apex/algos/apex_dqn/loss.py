"""Ape-X DQN's loss: double DQN (van Hasselt et al. 2016) with a target network and a Huber
loss weighted by the replay's importance-sampling weights; it returns the new priorities |td|."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, to minimise
    priorities: torch.Tensor  # [B] |td|, detached
    q_mean: torch.Tensor  # scalar, detached
    td_abs_mean: torch.Tensor  # scalar, detached


def dqn_loss(
    online: nn.Module,
    target: nn.Module,
    obs: torch.Tensor,  # [B, *obs_shape]
    action: torch.Tensor,  # [B] int64
    reward: torch.Tensor,  # [B] n-step return
    discount: torch.Tensor,  # [B] gamma^k, 0 where the episode terminated
    next_obs: torch.Tensor,  # [B, *obs_shape]
    weights: torch.Tensor,  # [B] importance-sampling weights
    next_mask: torch.Tensor | None = None,  # [B, A] uint8: the legal actions at next_obs
) -> LossOutput:
    """Double DQN: the online network picks the next action (a legal one, with
    ``next_mask``), the target network values it."""
    q = online(obs).gather(1, action[:, None]).squeeze(1)  # [B]
    with torch.no_grad():  # separate passes: backward then runs over B rows, not 2B
        next_q_online = online(next_obs)
        if next_mask is not None:
            next_q_online = next_q_online.masked_fill(next_mask == 0, -torch.inf)
        next_action = next_q_online.argmax(dim=1, keepdim=True)  # [B, 1]
        next_q = target(next_obs).gather(1, next_action).squeeze(1)  # [B]
        td_target = reward + discount * next_q
    td = td_target - q
    loss = (weights * F.huber_loss(q, td_target, reduction="none")).mean()
    return LossOutput(loss, td.detach().abs(), q.detach().mean(), td.detach().abs().mean())
