"""Ape-X DDPG's networks (torch, the learner's; ``apex.nets.numpy_nets`` has the actors'):
a deterministic policy mu(s) whose tanh output is scaled into the action bounds, and one or
two critics Q(s, a) (TD3's twins) on the observation and the action side by side. Each has
its own torso (an MLP, or a conv torso for images whose features meet the action in one
more layer), as in TD3: a shared torso would let the policy's loss move the critics'."""

from __future__ import annotations

import torch
from torch import nn

from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.nets.torch_nets import MLP, make_torso

IMAGE_CRITIC_HIDDEN = 256  # the layer where a conv torso's features meet the action


def action_scale(spec: EnvSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The middle and half range of each action value (finite: env_spec checked them)."""
    low = torch.tensor(spec.action_low, dtype=torch.float32)
    high = torch.tensor(spec.action_high, dtype=torch.float32)
    return (high + low) / 2, (high - low) / 2


class DeterministicPolicy(nn.Module):
    """mu(s) = mid + half * tanh(linear(torso(s))): an action inside the bounds, [B, D]."""

    action_mid: torch.Tensor
    action_half: torch.Tensor

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.torso = make_torso(spec, config)
        self.head = nn.Linear(self.torso.out_features, spec.num_actions)
        mid, half = action_scale(spec)
        # not in the state dict: they come from the env's spec on both sides, never from weights
        self.register_buffer("action_mid", mid, persistent=False)
        self.register_buffer("action_half", half, persistent=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.action_mid + self.action_half * torch.tanh(self.head(self.torso(obs)))
        return out


class Critic(nn.Module):
    """Q(s, a) [B]: vector observations and the action side by side through an MLP; images
    through a conv torso first."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.torso = make_torso(spec, config) if spec.is_image else None
        if self.torso is not None:
            features, hidden = self.torso.out_features, [IMAGE_CRITIC_HIDDEN]
        else:
            features, hidden = spec.stack * int(torch.Size(spec.frame_shape).numel()), list(config.hidden)
        self.mlp = MLP(features + spec.num_actions, hidden)
        self.q = nn.Linear(self.mlp.out_features, 1)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = self.torso(obs) if self.torso is not None else obs.flatten(1).float()
        out: torch.Tensor = self.q(self.mlp(torch.cat([x, action], dim=1))).squeeze(-1)
        return out


class DeterministicActorCritic(nn.Module):
    """The policy and ``critics`` critics (2 with apex_ddpg.twin_critics); ``forward`` is the
    policy's action. Actors hold one with a single critic: its Q-values give their initial
    priorities."""

    def __init__(self, spec: EnvSpec, config: ModelConfig, critics: int = 1) -> None:
        super().__init__()
        self.policy = DeterministicPolicy(spec, config)
        self.critics = nn.ModuleList(Critic(spec, config) for _ in range(critics))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.policy(obs)
        return out

    def q_values(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Every critic's Q(s, a): [critics, B]."""
        return torch.stack([critic(obs, action) for critic in self.critics])

    def act_and_value(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu(s) [B, D], the first critic's Q(s, mu(s)) [B]): what an actor needs."""
        action = self.policy(obs)
        return action, self.critics[0](obs, action)
