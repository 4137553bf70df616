"""Networks: an MLP torso for vector observations, a conv torso for images (the Nature CNN
from 64 x 64 up, as for Atari's 84 x 84, smaller ones below), a dueling Q head (Ape-X) and
a policy-value head (IMPALA, with an optional LSTM core) whose policy is one categorical,
one per component of a MultiDiscrete action (factorised), or a diagonal Gaussian for
continuous actions."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.nets.gaussian import LOG_2PI, LOG_STD_MAX, LOG_STD_MIN


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for size in hidden:
            layers += [nn.Linear(in_features, size), nn.ReLU()]
            in_features = size
        self.net = nn.Sequential(*layers)
        self.out_features: int = in_features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(obs.float())
        return out


def _conv_features(convs: list[nn.Module], channels: int, height: int, width: int) -> int:
    """Features out of ``convs`` for one input of that size: computed, not hard-coded."""
    with torch.no_grad():
        return int(nn.Sequential(*convs, nn.Flatten())(torch.zeros(1, channels, height, width)).shape[1])


class ConvTorso(nn.Module):
    """Conv layers and one fully connected layer over stacks of image frames: [B, stack, H, W]
    or [B, stack, C, H, W] (stack and C become the input channels), uint8 scaled to 0..1,
    float32 as it is."""

    def __init__(
        self, convs: list[nn.Module], channels: int, height: int, width: int, hidden: int, scale: float
    ) -> None:
        super().__init__()
        features = _conv_features(convs, channels, height, width)
        self.net = nn.Sequential(*convs, nn.Flatten(), nn.Linear(features, hidden), nn.ReLU())
        self.out_features: int = hidden
        self.scale = scale

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.float() if self.scale == 1.0 else obs.float() * self.scale
        out: torch.Tensor = self.net(x.flatten(1, -3))  # [B, stack * C, H, W]
        return out


def NatureCNN(in_channels: int, height: int = 84, width: int = 84, scale: float = 1 / 255) -> ConvTorso:
    """Mnih et al. 2015: three conv layers and a 512-unit layer (64 * 7 * 7 inputs at 84 x 84)."""
    return ConvTorso(
        [
            nn.Conv2d(in_channels, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
        ],
        in_channels,
        height,
        width,
        512,
        scale,
    )


def SmallCNN(in_channels: int, height: int, width: int, scale: float) -> ConvTorso:
    """Images below 64 x 64: from 20 x 20 (e.g. 40 x 40), strides 2, 2, 1 and 256 units;
    below (MinAtar's 10 x 10), one 3 x 3 conv of 16 channels and 128 units, as in
    Young & Tian 2019 (the MinAtar paper)."""
    if min(height, width) >= 20:
        convs = [
            nn.Conv2d(in_channels, 32, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
        ]
        return ConvTorso(convs, in_channels, height, width, 256, scale)
    return ConvTorso([nn.Conv2d(in_channels, 16, 3, stride=1), nn.ReLU()], in_channels, height, width, 128, scale)


NATURE_CNN_MIN_SIDE = 64


def make_torso(spec: EnvSpec, config: ModelConfig) -> MLP | ConvTorso:
    """A conv torso for image frames (the Nature CNN from 64 x 64, as for Atari), an MLP for
    vectors."""
    if spec.is_image:
        height, width = spec.frame_shape[-2:]
        channels = spec.stack * (spec.frame_shape[0] if len(spec.frame_shape) == 3 else 1)
        scale = 1 / 255 if spec.frame_dtype == np.uint8 else 1.0
        if min(height, width) >= NATURE_CNN_MIN_SIDE:
            return NatureCNN(channels, height, width, scale)
        return SmallCNN(channels, height, width, scale)
    in_features = spec.stack
    for d in spec.frame_shape:
        in_features *= d
    return MLP(in_features, config.hidden)


State = tuple[torch.Tensor, torch.Tensor]  # an LSTM core's (h, c), each [B, lstm_size]


class PolicyValueNetwork(nn.Module):
    """A policy and a state value over a shared torso (IMPALA), with an LSTM core between
    them where ``model.recurrent`` is ``lstm``.

    The policy's parameters come out as one tensor [B, P]: a Discrete action's logits; a
    MultiDiscrete action's, the components' side by side (``spec.num_actions`` = their sum,
    see ``log_probs``); a continuous action's mean and log-std side by side ([B, 2D]: a
    diagonal Gaussian whose log-std is learned but the same for every state, clamped to
    [LOG_STD_MIN, LOG_STD_MAX], as in PPO's reference implementations)."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        super().__init__()
        self.torso = make_torso(spec, config)
        features = self.torso.out_features
        self.core = nn.LSTMCell(features, config.lstm_size) if config.recurrent == "lstm" else None
        if self.core is not None:
            features = config.lstm_size
        self.policy = nn.Linear(features, spec.num_actions)
        self.log_std = nn.Parameter(torch.zeros(spec.num_actions)) if spec.continuous else None
        self.value = nn.Linear(features, 1)
        self.nvec = spec.action_nvec

    @property
    def recurrent(self) -> bool:
        return self.core is not None

    def initial_state(self, batch: int) -> State | None:
        """The core's state at an episode's start (zeros), None for a feed-forward network."""
        if self.core is None:
            return None
        zeros = torch.zeros(batch, self.core.hidden_size, device=self.policy.weight.device)
        return zeros, zeros.clone()

    def forward(self, obs: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, torch.Tensor, State | None]:
        """One step: (policy parameters [B, P], values [B], the core's next state or None);
        ``state`` None is an episode's start."""
        features = self.torso(obs)
        if self.core is not None:
            state = self.core(features, state)
            features = state[0]
        return *self._heads(features), state

    def unroll(
        self, obs: torch.Tensor, done: torch.Tensor | None, state: State | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The learner's pass over unrolls, time-major: obs [T+1, B, ...], ``done`` [T, B]
        (step t ended its episode, so the core starts afresh at observation t + 1), ``state``
        the core's state at observation 0 -> policy parameters [T+1, B, P], values [T+1, B].
        Step by step exactly what ``forward`` computes for an actor."""
        steps, size = obs.shape[:2]
        features = self.torso(obs.reshape(steps * size, *obs.shape[2:])).reshape(steps, size, -1)
        if self.core is not None:
            if done is None or state is None:
                raise ValueError("a recurrent network unrolls from the core's state, with the steps' done flags")
            h, c = state
            keep = 1.0 - done.to(h.dtype)[..., None]  # [T, B, 1]: 0 after a step that ended an episode
            outputs = []
            for t in range(steps):
                if t > 0:
                    h, c = h * keep[t - 1], c * keep[t - 1]
                h, c = self.core(features[t], (h, c))
                outputs.append(h)
            features = torch.stack(outputs)
        return self._heads(features)

    def _heads(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = self.policy(features)
        if self.log_std is not None:
            log_std = self.log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).expand_as(params)
            params = torch.cat([params, log_std], dim=-1)
        return params, self.value(features).squeeze(-1)

    def greedy(self, params: torch.Tensor) -> torch.Tensor:
        """The most likely action: [B] for Discrete, [B, components] for MultiDiscrete, the
        mean [B, D] for continuous actions (the adapter bounds it)."""
        if self.log_std is not None:
            return params[..., : params.shape[-1] // 2]
        if self.nvec is None:
            return params.argmax(dim=-1)
        return torch.stack([part.argmax(dim=-1) for part in torch.split(params, list(self.nvec), dim=-1)], dim=-1)


def log_prob_and_entropy(
    params: torch.Tensor, actions: torch.Tensor, spec: EnvSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a | x) and the policy's entropy, [...] each, for policy parameters [..., P]
    (``PolicyValueNetwork``) and actions [...], [..., components] or [..., D]."""
    if spec.continuous:
        return gaussian_log_prob(params, actions), gaussian_entropy(params)
    log_policies = log_probs(params, spec.action_nvec)
    return action_log_prob(log_policies, actions, spec.action_nvec), entropy(log_policies)


def gaussian_log_prob(params: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log N(u; mean, diag(std^2)) of the sample u the actor drew, summed over its D values:
    params [..., 2D] (mean, log-std), u [..., D] -> [...]. The environment got u clipped or
    squashed into its bounds (env.action_bounds), a fixed function of u that counts as part
    of the environment: the ratio pi(u)/mu(u) that V-trace takes is that of what the actor
    sampled. (A squashed action's log-density, ``squashed_log_prob``, differs from this by a
    term that does not depend on the policy, so its ratio is the same.)"""
    mean, log_std = params.chunk(2, dim=-1)
    z = (u - mean) * torch.exp(-log_std)
    return (-0.5 * z * z - log_std).sum(-1) - 0.5 * LOG_2PI * u.shape[-1]


def gaussian_entropy(params: torch.Tensor) -> torch.Tensor:
    """The Gaussian's entropy, summed over its D values (before any squashing) -> [...]."""
    log_std = params.chunk(2, dim=-1)[1]
    return log_std.sum(-1) + 0.5 * (1.0 + LOG_2PI) * log_std.shape[-1]


def squashed_log_prob(params: torch.Tensor, u: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """log-density of the action a = low + (tanh(u) + 1) (high - low) / 2 that the squashing
    adapter makes of u: ``gaussian_log_prob`` less log |da/du|, which does not depend on the
    policy's parameters (log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), stable for
    large |u|)."""
    log_det: torch.Tensor = (torch.log((high - low) / 2) + 2 * (np.log(2.0) - u - F.softplus(-2 * u))).sum(-1)
    return gaussian_log_prob(params, u) - log_det


def log_probs(logits: torch.Tensor, nvec: tuple[int, ...] | None) -> list[torch.Tensor]:
    """Log-softmax of each component's logits ([..., A] -> [[..., n_i]]): one for Discrete
    (``nvec`` None), one per component for a factorised MultiDiscrete policy."""
    if nvec is None:
        return [F.log_softmax(logits, dim=-1)]
    return [F.log_softmax(part, dim=-1) for part in torch.split(logits, list(nvec), dim=-1)]


def action_log_prob(
    log_policies: list[torch.Tensor], actions: torch.Tensor, nvec: tuple[int, ...] | None
) -> torch.Tensor:
    """log pi(a | x): the chosen entry, summed over the components of a MultiDiscrete action
    (actions [...] for Discrete, [..., components] for MultiDiscrete) -> [...]."""
    if nvec is None:
        return log_policies[0].gather(-1, actions[..., None]).squeeze(-1)
    return functools.reduce(
        operator.add, (lp.gather(-1, actions[..., i, None]).squeeze(-1) for i, lp in enumerate(log_policies))
    )


def entropy(log_policies: list[torch.Tensor]) -> torch.Tensor:
    """The policy's entropy, summed over components (they are independent) -> [...]."""
    return functools.reduce(operator.add, (-(lp.exp() * lp).sum(-1) for lp in log_policies))


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
        advantage: torch.Tensor = self.advantage(features)
        if self.value is None:
            return advantage
        value: torch.Tensor = self.value(features)
        return value + advantage - advantage.mean(dim=1, keepdim=True)


def numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters and buffers as NumPy arrays on the host. On a CPU learner these
    are views of the live tensors: the publisher copies them as it encodes (no torn weights),
    so a copy here would be a second one."""
    return {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}


def load_numpy_weights(model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    state = {name: torch.from_numpy(arrays[name].copy()) for name in model.state_dict()}
    model.load_state_dict(state)


def check_fits(model: nn.Module, saved: Mapping[Any, Any], name: str) -> None:
    """ValueError (one line) unless ``saved`` holds ``model``'s state_dict keys with its
    shapes: the run's model or env is not the checkpoint's."""
    ours = model.state_dict()
    if saved.keys() != ours.keys():
        missing, extra = sorted(ours.keys() - saved.keys()), sorted(map(str, saved.keys() - ours.keys()))
        raise ValueError(f"{name}: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, tensor in ours.items():
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name}.{key} is {got}, this run's model has {tuple(tensor.shape)}")
