"""An Ape-X DDPG actor's networks (``apex.nets.deterministic`` with one critic): NumPy for
vector observations, so that the actor never imports torch (as ``apex.nets.numpy_nets``);
the torch modules for images. ``tests/unit/test_apex_ddpg.py`` holds the two to the same
outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np

from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.errors import ProtocolError
from apex.nets.numpy_nets import check_weights, linear_shapes, relu_layers

if TYPE_CHECKING:
    from apex.nets.deterministic import DeterministicActorCritic


class DeterministicFunction(Protocol):
    """mu(s) [B, D] and the first critic's Q(s, a) [B], from the learner's weights."""

    def load(self, arrays: Mapping[str, np.ndarray]) -> None: ...
    def policy(self, obs: np.ndarray) -> np.ndarray: ...
    def q(self, obs: np.ndarray, action: np.ndarray) -> np.ndarray: ...


def deterministic_network(spec: EnvSpec, config: ModelConfig) -> DeterministicFunction:
    """The actor's policy and critic: NumPy for vectors, torch for images."""
    if spec.is_image:
        from apex.nets.deterministic import DeterministicActorCritic

        return TorchDeterministic(DeterministicActorCritic(spec, config, critics=1))
    return NumpyDeterministic(spec, config)


class NumpyDeterministic:
    """``DeterministicActorCritic`` over MLPs (one critic), weights by the torch names."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        obs = spec.stack * int(np.prod(spec.frame_shape))
        actions = spec.num_actions
        self.hidden = list(config.hidden)
        last_policy = self.hidden[-1] if self.hidden else obs
        last_critic = self.hidden[-1] if self.hidden else obs + actions
        self.shapes = {
            **linear_shapes("policy.torso", self.hidden, obs),
            "policy.head.weight": (actions, last_policy),
            "policy.head.bias": (actions,),
            **linear_shapes("critics.0.mlp", self.hidden, obs + actions),
            "critics.0.q.weight": (1, last_critic),
            "critics.0.q.bias": (1,),
        }
        self.mid = ((np.asarray(spec.action_high) + np.asarray(spec.action_low)) / 2).astype(np.float32)
        self.half = ((np.asarray(spec.action_high) - np.asarray(spec.action_low)) / 2).astype(np.float32)
        rng = np.random.default_rng(0)  # acts (near the middle) before the first weights arrive
        self.load({name: rng.normal(0, 0.01, shape).astype(np.float32) for name, shape in self.shapes.items()})

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Takes the learner's weights (ProtocolError if they do not fit; the old ones stay)."""
        check_weights(arrays, self.shapes)

        def layers(prefix: str) -> list[tuple[np.ndarray, np.ndarray]]:
            return [
                (
                    np.ascontiguousarray(arrays[f"{prefix}.net.{2 * i + 1}.weight"].T, np.float32),
                    np.array(arrays[f"{prefix}.net.{2 * i + 1}.bias"], np.float32),
                )
                for i in range(len(self.hidden))
            ]

        def linear(name: str) -> tuple[np.ndarray, np.ndarray]:
            return np.ascontiguousarray(arrays[f"{name}.weight"].T, np.float32), np.array(
                arrays[f"{name}.bias"], np.float32
            )

        self.policy_layers, self.policy_head = layers("policy.torso"), linear("policy.head")
        self.critic_layers, self.critic_head = layers("critics.0.mlp"), linear("critics.0.q")

    def policy(self, obs: np.ndarray) -> np.ndarray:
        weight, bias = self.policy_head
        x = relu_layers(obs.reshape(len(obs), -1), self.policy_layers) @ weight + bias
        out: np.ndarray = self.mid + self.half * np.tanh(x)
        return out.astype(np.float32, copy=False)

    def q(self, obs: np.ndarray, action: np.ndarray) -> np.ndarray:
        weight, bias = self.critic_head
        x = np.concatenate([obs.reshape(len(obs), -1).astype(np.float32, copy=False), action], axis=1)
        out: np.ndarray = (relu_layers(x, self.critic_layers) @ weight + bias)[:, 0]
        return out


class TorchDeterministic:
    """The torch module (conv torsos) behind the same calls: NumPy in, NumPy out."""

    def __init__(self, module: DeterministicActorCritic) -> None:
        import torch

        torch.set_num_threads(1)  # one core per actor process
        self._torch = torch
        self.module = module.eval()

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        from apex.nets.torch_nets import load_numpy_weights

        shapes = {name: tuple(t.shape) for name, t in self.module.state_dict().items()}
        check_weights(arrays, shapes)
        try:
            load_numpy_weights(self.module, arrays)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise ProtocolError(f"weights do not fit this actor's network: {str(e).splitlines()[0][:200]}") from None

    def policy(self, obs: np.ndarray) -> np.ndarray:
        with self._torch.no_grad():
            out: np.ndarray = self.module(self._torch.from_numpy(obs)).numpy()
        return out

    def q(self, obs: np.ndarray, action: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.no_grad():
            out: np.ndarray = self.module.critics[0](torch.from_numpy(obs), torch.from_numpy(action)).numpy()
        return out
