"""Networks: an MLP torso for vector observations, the Nature CNN for Atari, a dueling Q
head (Ape-X) and a policy-value head (IMPALA)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from apex.config import ModelConfig
from apex.envs import EnvSpec


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for size in hidden:
            layers += [nn.Linear(in_features, size), nn.ReLU()]
            in_features = size
        self.net = nn.Sequential(*layers)
        self.out_features = in_features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.float())


class NatureCNN(nn.Module):
    """Mnih et al. 2015: three conv layers and a 512-unit layer over uint8 frame stacks."""

    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
        )
        self.out_features = 512

    def forward(self, obs: torch.Tensor) -> torch.Tensor:  # obs: [B, stack, 84, 84] uint8
        return self.net(obs.float() / 255.0)


def make_torso(spec: EnvSpec, config: ModelConfig) -> nn.Module:
    """The Nature CNN for image frames, an MLP for vectors."""
    if len(spec.frame_shape) == 2:
        return NatureCNN(spec.stack)
    in_features = spec.stack
    for d in spec.frame_shape:
        in_features *= d
    return MLP(in_features, config.hidden)


class PolicyValueNetwork(nn.Module):
    """Policy logits and a state value over a shared torso (IMPALA)."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.torso = make_torso(spec, config)
        self.policy = nn.Linear(self.torso.out_features, spec.num_actions)
        self.value = nn.Linear(self.torso.out_features, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # -> [B, A], [B]
        features = self.torso(obs)
        return self.policy(features), self.value(features).squeeze(-1)


class QNetwork(nn.Module):
    """Q(s, ·) with a dueling head (V + A - mean A, Wang et al. 2016) or a plain one."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.torso = make_torso(spec, config)
        features = self.torso.out_features
        self.dueling = config.dueling
        self.advantage = nn.Linear(features, spec.num_actions)
        self.value = nn.Linear(features, 1) if config.dueling else None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:  # [B, *obs_shape] -> [B, A]
        features = self.torso(obs)
        advantage = self.advantage(features)
        if self.value is None:
            return advantage
        return self.value(features) + advantage - advantage.mean(dim=1, keepdim=True)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device: through pinned memory and without blocking on CUDA."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def numpy_weights(model: nn.Module) -> dict:
    """The model's parameters and buffers as NumPy arrays on the host. On a CPU learner these
    are views of the live tensors: the publisher copies them as it encodes (no torn weights),
    so a copy here would be a second one."""
    return {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}


def load_numpy_weights(model: nn.Module, arrays: dict) -> None:
    state = {name: torch.from_numpy(arrays[name].copy()) for name in model.state_dict()}
    model.load_state_dict(state)
