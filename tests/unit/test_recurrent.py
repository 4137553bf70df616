"""Recurrent IMPALA (model.recurrent: lstm): what the actor did is what the learner scores,
the core starts afresh where an episode ends inside an unroll, and what a batch's recurrent
arrays may hold (the memory task end to end: tests/system/test_recurrent.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tests.envs  # noqa: F401 - registers the test environments
from apex import config as config_module
from apex.algos.impala import actor as impala_actor
from apex.algos.impala import learner as impala
from apex.config import ModelConfig
from apex.envs.make import EnvSpec
from apex.errors import RejectedMessage
from apex.nets.torch_nets import PolicyValueNetwork, log_prob_and_entropy, numpy_weights

T = 10


def recurrent_config(env_id: str, *more: str):
    return config_module.load(
        None,
        [
            "algo=impala",
            f"env.id={env_id}",
            "model.recurrent=lstm",
            "model.lstm_size=16",
            "model.hidden=[32]",
            f"impala.unroll_length={T}",
            *more,
        ],
    )


class Recording:
    """An actor's network that keeps what each of its acting steps computed (K rows)."""

    def __init__(self, net, rows: int) -> None:
        self.net, self.rows, self.params = net, rows, []

    def __getattr__(self, name):
        return getattr(self.net, name)

    def __call__(self, obs, state=None):
        params, values, state = self.net(obs, state)
        if len(obs) == self.rows:  # not a truncation's bootstrap
            self.params.append(params.copy())
        return params, values, state


@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        ("tests.envs:apex-test/Recall-v0", "env.kwargs={delay: 3}"),  # the MLP torso, NumPy actor
        ("tests.envs:apex-test/Catch-v0", "env.frame_stack=2"),  # the conv torso, torch actor
    ],
)
def test_the_learners_unroll_scores_what_the_actor_did(env_id, kwargs):
    """Two unrolls per environment with episodes ending inside them (every 4 steps), the
    second starting from a carried state: the learner's unroll over the queued batch gives,
    step by step, the policy the actor acted on, and the behaviour log-probabilities."""
    K = 3
    config = recurrent_config(env_id, kwargs, f"impala.batch_unrolls={2 * K}")
    actor = impala_actor.ImpalaActor(config, {"num_envs": K}, seed=0)
    learner = impala.ImpalaLearner(config, actor.spec, torch.device("cpu"))
    actor.net.load(numpy_weights(learner.net))
    actor.net = Recording(actor.net, K)
    batches = 0
    while batches < 2:
        batch, _ = actor.act()
        if batch is not None:
            assert batch["done"].any() and batch["core_h"].shape == (K, 16)
            arrays, _ = learner.schema.validate(batch, learner.batch_limits(K))
            learner.insert(arrays)
            batches += 1
    actor.close()
    assert np.abs(batch["core_h"]).max() > 0.01  # the second unrolls start from a carried state
    staged = learner.sample()
    tensors = staged.tensors
    with torch.no_grad():
        params, _ = learner.net.unroll(tensors["obs"], tensors["done"], (tensors["core_h"], tensors["core_c"]))
        logp, _ = log_prob_and_entropy(params[:-1], tensors["action"], actor.spec)
    acted = np.stack(actor.net.params)  # [2T, K, P]
    for b in range(2):  # the learner's batch: the first unrolls of the K environments, then the second ones
        np.testing.assert_allclose(
            params[:T, b * K : (b + 1) * K].numpy(), acted[b * T : (b + 1) * T], rtol=1e-4, atol=1e-5
        )
    np.testing.assert_allclose(logp.numpy(), tensors["behaviour_logp"].numpy(), rtol=1e-4, atol=1e-5)


def test_the_core_starts_afresh_where_an_episode_ended_inside_an_unroll():
    torch.manual_seed(0)
    spec = EnvSpec((5,), np.dtype(np.float32), 1, 3)
    net = PolicyValueNetwork(spec, ModelConfig(hidden=[8], recurrent="lstm", lstm_size=6))
    steps, size, k = 8, 2, 3
    obs = torch.randn(steps, size, 1, 5)
    done = torch.zeros(steps - 1, size)
    done[k, 0] = 1  # environment 0's episode ended at step k: observation k + 1 starts a new one
    state = (torch.randn(size, 6).tanh(), torch.randn(size, 6))
    with torch.no_grad():
        params, values = net.unroll(obs, done, state)
        fresh, fresh_values = net.unroll(obs[k + 1 :], done[k + 1 :], net.initial_state(size))
        stepped, carried = [], state
        for t in range(steps):  # the actor's way: one step at a time, its state carried
            out, _, carried = net(obs[t], carried)
            stepped.append(out)
    torch.testing.assert_close(params[k + 1 :, 0], fresh[:, 0])
    torch.testing.assert_close(values[k + 1 :, 0], fresh_values[:, 0])
    assert not torch.allclose(params[k + 1 :, 1], fresh[:, 1], atol=1e-4)  # no reset there: its past counts
    torch.testing.assert_close(params[:, 1], torch.stack(stepped)[:, 1])
    torch.testing.assert_close(params[: k + 1, 0], torch.stack(stepped)[: k + 1, 0])


def recall_batch(config, K: int = 2) -> dict:
    actor = impala_actor.ImpalaActor(config, {"num_envs": K}, seed=0)
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    return batch


@pytest.mark.parametrize(
    "name, value, reason",
    [
        ("core_h", 1.5, "core_h"),  # an LSTM's h is tanh of something
        ("core_c", np.inf, "core_c"),
        ("core_c", np.nan, "core_c"),
        ("done", 2, "done"),
    ],
)
def test_a_forged_core_state_or_episode_end_is_refused(name, value, reason):
    config = recurrent_config("tests.envs:apex-test/Recall-v0")
    spec = impala_actor.ImpalaActor(config, {"num_envs": 1}, seed=0).spec
    batch = recall_batch(config)
    batch[name] = batch[name].copy()
    batch[name].flat[0] = value
    with pytest.raises(RejectedMessage, match=reason):
        impala.batch_schema(spec, config).validate(batch, impala.batch_limits(2, spec, config))


def test_a_recurrent_learner_refuses_unrolls_without_their_state():
    config = recurrent_config("tests.envs:apex-test/Recall-v0")
    batch = recall_batch(config)
    spec = impala_actor.ImpalaActor(config, {"num_envs": 1}, seed=0).spec
    del batch["core_h"]
    with pytest.raises(RejectedMessage):
        impala.batch_schema(spec, config).validate(batch, impala.batch_limits(2, spec, config))


def test_ape_x_refuses_a_recurrent_model_in_one_line():
    with pytest.raises(config_module.ConfigError, match="model.recurrent lstm needs algo impala"):
        config_module.load(None, ["model.recurrent=lstm"])
