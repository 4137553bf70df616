"""The actors' NumPy networks compute what the learner's torch networks compute, from the
weights the learner sends; weights that do not fit are refused (vector actors never import
torch: tests/system/test_inference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.errors import ProtocolError
from apex.nets import numpy_nets as inference
from apex.nets.torch_nets import PolicyValueNetwork, QNetwork, log_probs, numpy_weights


def vector_spec(num_actions: int = 3, nvec: tuple[int, ...] | None = None, stack: int = 2) -> EnvSpec:
    return EnvSpec(
        frame_shape=(5,), frame_dtype=np.dtype(np.float32), stack=stack, num_actions=num_actions, action_nvec=nvec
    )


def observations(spec: EnvSpec, batch: int = 7) -> np.ndarray:
    return np.random.default_rng(1).normal(0, 2, (batch, spec.stack, *spec.frame_shape)).astype(np.float32)


@pytest.mark.parametrize("dueling", [True, False])
@pytest.mark.parametrize("hidden", [[16, 8], [12], []])
def test_numpy_q_network_matches_torch(dueling, hidden):
    spec, config = vector_spec(), ModelConfig(hidden=hidden, dueling=dueling)
    torch.manual_seed(0)
    net = QNetwork(spec, config)
    actor_net = inference.q_network(spec, config)
    assert isinstance(actor_net, inference.NumpyQNetwork)
    actor_net.load(numpy_weights(net))
    obs = observations(spec)
    with torch.no_grad():
        expected = net(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(actor_net(obs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nvec", [None, (2, 3)])
def test_numpy_policy_value_network_matches_torch(nvec):
    spec, config = vector_spec(num_actions=5, nvec=nvec), ModelConfig(hidden=[16, 16])
    torch.manual_seed(0)
    net = PolicyValueNetwork(spec, config)
    actor_net = inference.policy_value_network(spec, config)
    actor_net.load(numpy_weights(net))
    obs = observations(spec)
    with torch.no_grad():
        logits, values, _ = net(torch.from_numpy(obs))
    got_logits, got_values, _ = actor_net(obs)
    np.testing.assert_allclose(got_logits, logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_values, values.numpy(), rtol=1e-5, atol=1e-6)
    for got, expected in zip(inference.log_probs(got_logits, nvec), log_probs(logits, nvec)):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_integer_observations_are_cast_as_the_torch_network_does():
    spec = EnvSpec(frame_shape=(4,), frame_dtype=np.dtype(np.int64), stack=1, num_actions=2)
    config = ModelConfig(hidden=[8])
    net = QNetwork(spec, config)
    actor_net = inference.q_network(spec, config)
    actor_net.load(numpy_weights(net))
    obs = np.arange(12, dtype=np.int64).reshape(3, 1, 4)
    with torch.no_grad():
        expected = net(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(actor_net(obs), expected, rtol=1e-5, atol=1e-6)


def test_weights_that_do_not_fit_are_refused_and_the_old_ones_kept():
    spec, config = vector_spec(), ModelConfig(hidden=[16, 8])
    net = QNetwork(spec, config)
    actor_net = inference.q_network(spec, config)
    good = numpy_weights(net)
    actor_net.load(good)
    obs = observations(spec)
    before = actor_net(obs)
    wrong_shape = dict(good, **{"advantage.weight": np.zeros((4, 8), np.float32)})
    missing = {k: v for k, v in good.items() if k != "value.bias"}
    extra = dict(good, **{"torso.net.9.weight": np.zeros((2, 2), np.float32)})
    not_float = dict(good, **{"advantage.bias": np.zeros(3, np.int64)})
    nan = dict(good, **{"torso.net.1.bias": np.full(16, np.nan, np.float32)})
    inf = dict(good, **{"value.weight": np.full((1, 8), np.inf, np.float32)})
    for bad, words in (
        (wrong_shape, "advantage.weight"),
        (missing, "missing"),
        (extra, "unexpected"),
        (not_float, "advantage.bias"),
        (nan, "torso.net.1.bias hold NaN"),
        (inf, "value.weight hold NaN"),
    ):
        with pytest.raises(ProtocolError, match=words):
            actor_net.load(bad)
    np.testing.assert_array_equal(actor_net(obs), before)


def test_image_observations_use_the_torch_network():
    spec = EnvSpec(frame_shape=(10, 10), frame_dtype=np.dtype(np.uint8), stack=2, num_actions=3)
    config = ModelConfig()
    net = QNetwork(spec, config)
    actor_net = inference.q_network(spec, config)
    assert isinstance(actor_net, inference.TorchNetwork)
    actor_net.load(numpy_weights(net))
    obs = np.random.default_rng(0).integers(0, 255, (4, 2, 10, 10), dtype=np.uint8)
    with torch.no_grad():
        expected = net(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(actor_net(obs), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ProtocolError, match="do not fit"):
        actor_net.load({"nope": np.zeros(1, np.float32)})
    poisoned = {name: np.full_like(a, np.nan) for name, a in numpy_weights(net).items()}
    with pytest.raises(ProtocolError, match="NaN"):
        actor_net.load(poisoned)
    np.testing.assert_allclose(actor_net(obs), expected, rtol=1e-5, atol=1e-6)  # the old weights act on
