"""The actors' forward pass. For vector observations (MLP torsos) it is NumPy: an actor then
never imports torch, which costs 1.35 s of CPU and ~250 MB per process; on two cores that
import, run by every actor beside the learner's own, was most of a CartPole run's start-up.
Image observations (conv torsos) go through the torch networks of ``apex.nets.torch_nets``, imported
only then.

The NumPy networks read the learner's weights by the torch modules' state-dict names
(``torso.net.1.weight``, ``advantage.bias``, ...) and compute what those modules compute:
``tests/unit/test_inference.py`` holds the two to the same outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.errors import ProtocolError
from apex.nets.gaussian import LOG_STD_MAX, LOG_STD_MIN

if TYPE_CHECKING:
    import torch

# A Gaussian policy's log-std is clamped to these (apex.nets.torch_nets imports them: one definition,
# where an actor can read it without torch).

CoreState = tuple[np.ndarray, np.ndarray]  # an LSTM core's (h, c), each [B, lstm_size]


class QFunction(Protocol):
    """An Ape-X actor's network (``q_network``): Q-values [B, A] of observations [B, ...]."""

    def load(self, arrays: Mapping[str, np.ndarray]) -> None: ...
    def __call__(self, obs: np.ndarray, /) -> np.ndarray: ...


class PolicyValueFunction(Protocol):
    """An IMPALA actor's network (``policy_value_network``): (policy parameters [B, P],
    values [B], the core's next state or None) of observations and the core's state."""

    def load(self, arrays: Mapping[str, np.ndarray]) -> None: ...
    def initial_state(self, batch: int) -> CoreState | None: ...
    def __call__(
        self, obs: np.ndarray, state: CoreState | None = None, /
    ) -> tuple[np.ndarray, np.ndarray, CoreState | None]: ...


def q_network(spec: EnvSpec, config: ModelConfig) -> QFunction:
    """Q(s, ·) for an Ape-X actor: ``net(obs) -> [B, A]``, ``net.load(arrays)``."""
    if spec.is_image:
        # torch only here: an actor of vector observations never imports it (1.35 s, 250 MB)
        from apex.nets.torch_nets import QNetwork

        return TorchNetwork(QNetwork(spec, config))
    heads = {"advantage": spec.num_actions, **({"value": 1} if config.dueling else {})}
    return NumpyQNetwork(spec, config, heads)


def policy_value_network(spec: EnvSpec, config: ModelConfig) -> PolicyValueFunction:
    """Policy parameters and values for an IMPALA actor: ``net(obs, state) -> ([B, P], [B],
    next state)``, the state an LSTM core's (h, c) (None for a feed-forward network, or to
    start episodes); ``net.initial_state(B)``."""
    if spec.is_image:
        # torch only for images, as above
        from apex.nets.torch_nets import PolicyValueNetwork

        return TorchNetwork(PolicyValueNetwork(spec, config))
    return NumpyPolicyValueNetwork(spec, config)


def log_probs(logits: np.ndarray, nvec: tuple[int, ...] | None) -> list[np.ndarray]:
    """Log-softmax of each component's logits, as ``apex.nets.torch_nets.log_probs`` in NumPy."""
    parts = [logits] if nvec is None else np.split(logits, np.cumsum(nvec)[:-1], axis=-1)
    out = []
    for part in parts:
        shifted = part - part.max(axis=-1, keepdims=True)
        out.append(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))
    return out


def check_weights(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ProtocolError unless ``arrays`` are exactly the named float arrays of ``shapes``, all
    finite (NaN Q-values or logits would act at random, silently)."""
    if set(arrays) != set(shapes):
        missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
        raise ProtocolError(f"weights do not fit this actor's network: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in shapes.items():
        array = arrays[name]
        if array.shape != shape or array.dtype.kind != "f":
            raise ProtocolError(f"weights {name}: {array.dtype}{list(array.shape)}, expected float{list(shape)}")
        if not np.isfinite(array).all():
            raise ProtocolError(f"weights {name} hold NaN or infinite values")


def linear_shapes(prefix: str, sizes: list[int], in_features: int) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``apex.nets.torch_nets.MLP`` (Flatten, then Linear + ReLU per
    size) named ``prefix``.net.1, .3, ..."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i, size in enumerate(sizes):
        shapes[f"{prefix}.net.{2 * i + 1}.weight"] = (size, in_features)
        shapes[f"{prefix}.net.{2 * i + 1}.bias"] = (size,)
        in_features = size
    return shapes


def relu_layers(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """An MLP's hidden layers on x [B, in], weights transposed ([in, out])."""
    x = x.astype(np.float32, copy=False)  # the first matmul makes a new array
    for weight, bias in layers:
        x = x @ weight
        x += bias
        np.maximum(x, 0.0, out=x)
    return x


class NumpyMLP:
    """``apex.nets.torch_nets.MLP`` (Flatten, then Linear + ReLU per hidden layer) and linear heads on
    its features, with weights loaded from the torch modules' state dict."""

    def __init__(
        self, spec: EnvSpec, config: ModelConfig, heads: dict[str, int], extra: dict[str, tuple[int, ...]] | None = None
    ) -> None:
        """``heads``: linear layers on the features (a core's, where ``extra`` adds one);
        ``extra``: further arrays by name and shape (an LSTM core, a log-std)."""
        in_features = spec.stack * int(np.prod(spec.frame_shape))
        self.shapes = linear_shapes("torso", config.hidden, in_features)
        in_features = config.hidden[-1] if config.hidden else in_features
        self.shapes.update(extra or {})
        self.extra_names = tuple(extra or ())
        if "core.weight_hh" in self.shapes:
            in_features = self.shapes["core.weight_hh"][1]
        for name, size in heads.items():
            self.shapes[f"{name}.weight"] = (size, in_features)
            self.shapes[f"{name}.bias"] = (size,)
        self.num_layers = len(config.hidden)
        self.head_names = tuple(heads)
        rng = np.random.default_rng(0)  # acts (randomly) before the first weights arrive
        self.load({name: rng.normal(0, 0.01, shape).astype(np.float32) for name, shape in self.shapes.items()})

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Takes the learner's weights; a message that does not fit this network (names,
        shapes or dtypes, or non-finite values) is a ProtocolError, and the previous weights
        stay."""
        check_weights(arrays, self.shapes)
        # Transposed and contiguous once here, so that each step is one matmul per layer.
        weight = {
            name: np.ascontiguousarray(arrays[name].T, np.float32) for name in self.shapes if name.endswith("weight")
        }
        bias = {name: np.array(arrays[name], np.float32) for name in self.shapes if name.endswith("bias")}
        self.layers = [
            (weight[f"torso.net.{2 * i + 1}.weight"], bias[f"torso.net.{2 * i + 1}.bias"])
            for i in range(self.num_layers)
        ]
        self.heads = {name: (weight[f"{name}.weight"], bias[f"{name}.bias"]) for name in self.head_names}
        # The extras (an LSTM's weights transposed, as the layers' are)
        self.extras = {
            name: np.ascontiguousarray(arrays[name].T if arrays[name].ndim == 2 else arrays[name], np.float32)
            for name in self.extra_names
        }

    def features(self, obs: np.ndarray) -> np.ndarray:
        return relu_layers(obs.reshape(len(obs), -1), self.layers)

    def head(self, name: str, features: np.ndarray) -> np.ndarray:
        weight, bias = self.heads[name]
        out: np.ndarray = features @ weight + bias
        return out


class NumpyQNetwork(NumpyMLP):
    """``apex.nets.torch_nets.QNetwork`` over an MLP torso: dueling (V + A - mean A) or plain."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        features = self.features(obs)
        advantage = self.head("advantage", features)
        if "value" not in self.heads:
            return advantage
        q: np.ndarray = self.head("value", features) + advantage - advantage.mean(axis=1, keepdims=True)
        return q


class NumpyPolicyValueNetwork(NumpyMLP):
    """``apex.nets.torch_nets.PolicyValueNetwork`` over an MLP torso: (policy parameters [B, P],
    values [B], the LSTM core's next state or None)."""

    def __init__(self, spec: EnvSpec, config: ModelConfig) -> None:
        extra: dict[str, tuple[int, ...]] = {}
        self.lstm_size = config.lstm_size if config.recurrent == "lstm" else 0
        if self.lstm_size:  # torch.nn.LSTMCell's parameters, gates in the order i, f, g, o
            L = self.lstm_size
            features = config.hidden[-1] if config.hidden else spec.stack * int(np.prod(spec.frame_shape))
            extra.update(
                {
                    "core.weight_ih": (4 * L, features),
                    "core.weight_hh": (4 * L, L),
                    "core.bias_ih": (4 * L,),
                    "core.bias_hh": (4 * L,),
                }
            )
        if spec.continuous:
            extra["log_std"] = (spec.num_actions,)
        super().__init__(spec, config, {"policy": spec.num_actions, "value": 1}, extra)

    def initial_state(self, batch: int) -> CoreState | None:
        if not self.lstm_size:
            return None
        return self._zero_state(batch)

    def _zero_state(self, batch: int) -> CoreState:
        return np.zeros((batch, self.lstm_size), np.float32), np.zeros((batch, self.lstm_size), np.float32)

    def __call__(
        self, obs: np.ndarray, state: CoreState | None = None
    ) -> tuple[np.ndarray, np.ndarray, CoreState | None]:
        features = self.features(obs)
        if self.lstm_size:
            state = self._core(features, state if state is not None else self._zero_state(len(obs)))
            features = state[0]
        params = self.head("policy", features)
        if "log_std" in self.extras:
            log_std = np.clip(self.extras["log_std"], LOG_STD_MIN, LOG_STD_MAX)
            params = np.concatenate([params, np.broadcast_to(log_std, params.shape)], axis=1)
        return params, self.head("value", features)[:, 0], state

    def _core(self, x: np.ndarray, state: CoreState) -> CoreState:
        h, c = state
        a = self.extras  # weights transposed: [in, 4L]
        gates = x @ a["core.weight_ih"] + a["core.bias_ih"] + h @ a["core.weight_hh"] + a["core.bias_hh"]
        i, f, g, o = np.split(gates, 4, axis=1)
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        return _sigmoid(o) * np.tanh(c), c


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # no overflow for large |x|


class TorchNetwork:
    """A torch network (conv torsos) behind the same calls: NumPy in, NumPy out."""

    def __init__(self, module: torch.nn.Module) -> None:
        import torch

        torch.set_num_threads(1)  # one core per actor process
        self._torch = torch
        self.module = module.eval()

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        from apex.nets.torch_nets import load_numpy_weights  # (a torch network: torch is imported already)

        if not all(
            np.isfinite(a).all()
            for a in arrays.values()
            if getattr(a, "dtype", None) is not None and a.dtype.kind == "f"
        ):
            raise ProtocolError("weights hold NaN or infinite values")
        try:
            load_numpy_weights(self.module, arrays)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise ProtocolError(f"weights do not fit this actor's network: {str(e).splitlines()[0][:200]}") from None

    def initial_state(self, batch: int) -> CoreState | None:
        from apex.nets.torch_nets import PolicyValueNetwork  # (a torch network: torch is imported already)

        if not isinstance(self.module, PolicyValueNetwork):
            raise AttributeError(f"{type(self.module).__name__} has no core state")
        state = self.module.initial_state(batch)
        if state is None:
            return None
        h, c = state
        return h.numpy(), c.numpy()

    def __call__(self, obs: np.ndarray, *state: Any) -> Any:
        """``state``: for a policy-value network, the core's state (NumPy, or None). Returns
        what ``QFunction`` or ``PolicyValueFunction`` does, as the module is one or the other."""
        torch = self._torch
        with torch.no_grad():
            if state and state[0] is not None:
                state = (tuple(torch.from_numpy(part) for part in state[0]),)
            out = self.module(torch.from_numpy(obs), *state)
        if not isinstance(out, tuple):
            return out.numpy()
        *heads, core = out
        return (*(o.numpy() for o in heads), None if core is None else tuple(part.numpy() for part in core))
