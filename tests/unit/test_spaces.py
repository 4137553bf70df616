"""Observation and action spaces (apex.envs.spaces): the adapters that turn any supported space
into frames and 0-based actions, the specs, networks and batch schemas they lead to, and
the refusals (real runs on the environments of tests/envs.py: tests/system/test_spaces.py)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces as gs

import tests.envs  # noqa: F401 - registers the test environments
from apex import config as config_module
from apex.algos.apex_dqn import learner as apex_dqn
from apex.algos.impala import actor as impala_actor
from apex.algos.impala import learner as impala
from apex.config import Config, EnvConfig
from apex.envs import spaces
from apex.envs.make import EnvSpec, VectorEnv, env_spec, make_env
from apex.errors import ConfigError, RejectedMessage
from apex.nets.torch_nets import (
    ConvTorso,
    PolicyValueNetwork,
    QNetwork,
    action_log_prob,
    entropy,
    log_probs,
    make_torso,
    numpy_weights,
)


def convert(space: gym.Space, x, layout: str | None = None) -> np.ndarray:
    plan = spaces.observation_plan(space, layout)
    out = x if plan.convert is None else plan.convert(x)
    assert out.shape == plan.frame_shape and out.dtype == plan.frame_dtype
    assert plan.space.contains(out) or plan.frame_dtype.kind == "f"
    return out


# -- observations: vectors


def test_discrete_is_one_hot_from_its_start():
    out = convert(gs.Discrete(4, start=2), 3)
    np.testing.assert_array_equal(out, [0, 1, 0, 0])
    assert out.dtype == np.float32


def test_multibinary_is_floats_and_a_box_of_any_rank_is_raveled():
    np.testing.assert_array_equal(convert(gs.MultiBinary(3), np.array([1, 0, 1], np.int8)), [1.0, 0.0, 1.0])
    box = gs.Box(0, 9, (2, 3), np.int64)  # small: a vector, not an image
    np.testing.assert_array_equal(convert(box, np.arange(6).reshape(2, 3)), np.arange(6, dtype=np.float32))


def test_a_float32_vector_passes_as_it_is_and_float64_becomes_float32():
    assert spaces.observation_plan(gs.Box(-1, 1, (4,), np.float32)).convert is None
    out = convert(gs.Box(-1, 1, (4,), np.float64), np.array([0.5, -0.5, 0.25, 1.0]))
    assert out.dtype == np.float32


def test_dict_keys_flatten_in_sorted_order_each_part_recursively():
    space = gs.Dict(
        {
            "position": gs.Discrete(3),
            "goal": gs.Box(0, 1, (2,), np.float32),
            "dials": gs.MultiDiscrete([2, 3]),
            "flags": gs.MultiBinary(2),
            "pair": gs.Tuple((gs.Discrete(2, start=1), gs.Box(-1, 1, (1,), np.float32))),
        }
    )
    x = {
        "position": 2,
        "goal": np.array([0.25, 0.75], np.float32),
        "dials": np.array([1, 2]),
        "flags": np.array([1, 0], np.int8),
        "pair": (2, np.array([-0.5], np.float32)),
    }
    expected = [
        0,
        1,
        0,
        0,
        1,  # dials: one-hot per component (2, then 3)
        1,
        0,  # flags
        0.25,
        0.75,  # goal
        0,
        1,
        -0.5,  # pair: Discrete(2, start=1) at 2, then the Box
        0,
        0,
        1,  # position
    ]
    out = convert(space, x)
    np.testing.assert_array_equal(out, np.asarray(expected, np.float32))
    np.testing.assert_array_equal(out, gs.flatten(space, x).astype(np.float32))  # gymnasium's order exactly


def test_unflattenable_observations_are_refused_naming_a_wrapper():
    with pytest.raises(ConfigError, match="Text.*cannot be flattened.*wrapper") as e:
        spaces.observation_plan(gs.Dict({"name": gs.Text(5), "x": gs.Discrete(2)}))
    assert "\n" not in str(e.value)


# -- observations: images


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((84, 84), "hw"),
        ((84, 84, 3), "hwc"),
        ((3, 84, 84), "chw"),
        ((84, 84, 1), "hwc"),
        ((1, 84, 84), "chw"),
        ((10, 10, 4), "hwc"),
        ((10, 10, 10), "hwc"),
        ((10, 10, 7), "hwc"),
        ((4, 10, 10), "chw"),
        ((40, 60, 2), "hwc"),
        ((5, 5), None),
        ((5, 5, 3), None),
        ((3, 5, 5), None),
        ((84,), None),
        ((2, 8, 8, 3), None),
    ],
)
def test_image_layout_rule(shape, layout):
    assert spaces.image_layout(shape) == layout


def test_channels_last_becomes_channels_first_pixel_for_pixel():
    space = gs.Box(0, 255, (40, 30, 3), np.uint8)
    x = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    out = convert(space, x)
    assert out.shape == (3, 40, 30) and out.flags.c_contiguous
    for c in range(3):
        np.testing.assert_array_equal(out[c], x[..., c])


def test_one_channel_becomes_h_by_w_as_atari_frames_are():
    x = np.arange(1600, dtype=np.uint8).reshape(40, 40, 1)
    np.testing.assert_array_equal(convert(gs.Box(0, 255, (40, 40, 1), np.uint8), x), x[..., 0])
    np.testing.assert_array_equal(convert(gs.Box(0, 255, (1, 40, 40), np.uint8), x.reshape(1, 40, 40)), x[..., 0])


def test_uint8_frames_already_in_place_pass_untouched():
    assert spaces.observation_plan(gs.Box(0, 255, (84, 84), np.uint8)).convert is None
    assert spaces.observation_plan(gs.Box(0, 255, (3, 84, 84), np.uint8)).convert is None


def test_bool_images_become_uint8_0_or_255_and_other_dtypes_float32():
    x = np.zeros((10, 10, 4), bool)
    x[2, 3, 1] = True
    out = convert(gs.Box(0, 1, (10, 10, 4), bool), x)
    assert out.dtype == np.uint8 and out.shape == (4, 10, 10)
    assert out[1, 2, 3] == 255 and out.sum() == 255
    out = convert(gs.Box(0, 1, (16, 16), np.float64), np.full((16, 16), 0.5))
    assert out.dtype == np.float32 and out.shape == (16, 16) and out[0, 0] == 0.5
    out = convert(gs.Box(0, 1000, (16, 16, 2), np.uint16), np.full((16, 16, 2), 700, np.uint16))
    assert out.dtype == np.float32 and out.shape == (2, 16, 16) and out.max() == 700


def test_image_layout_wrapper_overrides_the_rule():
    space = gs.Box(0, 255, (8, 8, 20), np.uint8)  # the rule reads 8 channels of 8 x 20
    assert spaces.observation_plan(space).frame_shape == (8, 8, 20)
    assert spaces.observation_plan(space, "hwc").frame_shape == (20, 8, 8)
    assert spaces.observation_plan(space, "vector").frame_shape == (8 * 8 * 20,)
    with pytest.raises(ConfigError, match="ImageLayout 'hw' does not fit"):
        spaces.observation_plan(space, "hw")
    config = EnvConfig(
        id="apex-test/Catch-v0",
        kwargs={"channels": 2, "layout": "chw"},
        wrappers=[{"type": "apex.envs.spaces.ImageLayout", "kwargs": {"layout": "vector"}}],
    )
    assert env_spec(config).frame_shape == (2 * 40 * 40,)


# -- actions


def test_action_adapters_shift_start_and_restore_shape():
    env = gym.make("apex-test/Corridor-v0")
    md = gs.MultiDiscrete(np.array([[2, 3], [4, 5]]), start=np.array([[1, 0], [0, -2]]))
    plan = spaces.action_plan(md, "x")
    assert plan.kind == "MultiDiscrete" and plan.nvec == (2, 3, 4, 5)
    action = plan.convert(np.array([1, 2, 3, 4]))
    assert md.contains(action) and action.tolist() == [[2, 2], [3, 2]]
    plan = spaces.action_plan(gs.Discrete(3, start=-1), "x")
    assert plan.nvec == (3,) and [plan.convert(a) for a in range(3)] == [-1, 0, 1]
    plan = spaces.action_plan(gs.MultiBinary(3), "x")
    assert plan.nvec == (2, 2, 2) and gs.MultiBinary(3).contains(plan.convert(np.array([1, 0, 1])))
    assert spaces.action_plan(gs.Discrete(4), "x").convert is None
    assert spaces.action_plan(gs.MultiDiscrete([3, 4]), "x").convert is None
    env.close()


@pytest.mark.parametrize(
    "space, words",
    [
        (gs.Box(0, 3, (2,), np.int64), "integer Box actions.*MultiDiscrete"),
        (gs.Tuple((gs.Discrete(2), gs.Discrete(3))), "Tuple.*ActionWrapper"),
    ],
)
def test_unusable_actions_are_refused_naming_a_fix(space, words):
    with pytest.raises(ConfigError, match=words) as e:
        spaces.action_plan(space, "my:Env-v0")
    assert "\n" not in str(e.value) and "my:Env-v0" in str(e.value)


def test_apex_dqn_refuses_multidiscrete_actions_before_anything_starts():
    config = EnvConfig(id="tests.envs:apex-test/MultiDial-v0")
    with pytest.raises(ConfigError, match="algo apex_dqn needs Discrete actions.*--algo impala") as e:
        env_spec(config, "apex_dqn")
    assert "\n" not in str(e.value)
    spec = env_spec(config, "impala")
    assert spec.action_nvec == (3, 4) and spec.num_actions == 7 and spec.frame_shape == (7,)
    with pytest.raises(ConfigError, match="--algo impala"):  # the learner's own backstop
        apex_dqn.ApexDqnLearner(Config(env=config), spec, torch.device("cpu"))


def test_continuous_actions_are_impala_only_and_squash_needs_finite_bounds():
    with pytest.raises(
        ConfigError, match="algo apex_dqn needs Discrete actions.*continuous.*--algo impala.*Discretize"
    ):
        env_spec(EnvConfig(id="Pendulum-v1"), "apex_dqn")
    spec = env_spec(EnvConfig(id="Pendulum-v1"), "impala")
    assert spec.continuous and spec.num_actions == 1 and spec.action_shape == (1,) and spec.action_dtype == np.float32
    with pytest.raises(ConfigError, match="squash needs finite bounds.*env.action_bounds: clip"):
        spaces.action_plan(gs.Box(-np.inf, np.inf, (2,), np.float32), "my:Env-v0", "squash")


@pytest.mark.parametrize("how", ["clip", "squash"])
def test_the_adapter_maps_a_gaussian_sample_into_the_bounds(how):
    space = gs.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 1.0], np.float32))
    convert = spaces.action_plan(space, "x", how).convert
    u = np.array([[-100.0, 100.0], [0.0, 0.0], [0.5, -0.3], [3.0, 2.0]], np.float32)
    got = np.stack([convert(row) for row in u])
    assert all(space.contains(a) for a in got)
    if how == "clip":
        np.testing.assert_allclose(got, np.clip(u, space.low, space.high))
    else:  # low + (tanh(u) + 1) (high - low) / 2
        np.testing.assert_allclose(got, space.low + (np.tanh(u) + 1) * (space.high - space.low) / 2, rtol=1e-6)


def test_pendulum_runs_through_the_named_fix():
    wrap = [{"type": "gymnasium.wrappers.DiscretizeAction", "kwargs": {"bins": 5}}]
    with pytest.raises(ConfigError, match="DiscretizeAction"):
        env_spec(EnvConfig(id="Pendulum-v1"), "apex_dqn")
    assert env_spec(EnvConfig(id="Pendulum-v1", wrappers=wrap), "apex_dqn").num_actions == 5


# -- specs of the test environments, and Atari unchanged


@pytest.mark.parametrize(
    "kwargs, shape, dtype",
    [
        ({}, (40, 40), np.uint8),
        ({"channels": 2, "layout": "hwc", "dtype": "bool"}, (2, 40, 40), np.uint8),
        ({"channels": 2, "layout": "chw", "dtype": "float32"}, (2, 40, 40), np.float32),
        ({"rows": 10, "columns": 10, "cell": 1}, (10, 10), np.uint8),
    ],
)
def test_catch_frames_are_stacked_images(kwargs, shape, dtype):
    config = EnvConfig(id="tests.envs:apex-test/Catch-v0", kwargs=kwargs, frame_stack=3)
    spec = env_spec(config)
    assert (spec.frame_shape, spec.frame_dtype, spec.stack) == (shape, np.dtype(dtype), 3)
    envs = VectorEnv(config, 2, seed=0)
    frames = envs.reset()
    assert frames.shape == (2, *shape) and frames.dtype == dtype
    assert frames.max() == (1.0 if dtype == np.float32 else 255)
    envs.close()


@pytest.mark.parametrize(
    "env_id, shape",
    [
        ("apex-test/Corridor-v0", (8,)),
        ("apex-test/DictGoal-v0", (12,)),
        ("FrozenLake-v1", (16,)),
        ("Blackjack-v1", (32 + 11 + 2,)),
    ],
)
def test_vector_specs_are_never_stacked(env_id, shape):
    spec = env_spec(EnvConfig(id=env_id, frame_stack=4))
    assert spec.frame_shape == shape and spec.frame_dtype == np.float32 and spec.stack == 1


def test_atari_frames_are_as_before():
    pytest.importorskip("ale_py")
    spec = env_spec(EnvConfig(id="ALE/Pong-v5"))
    assert spec == EnvSpec((84, 84), np.dtype(np.uint8), 4, 6, spec.max_episode_steps)
    env = make_env(EnvConfig(id="ALE/Pong-v5"))
    assert not isinstance(env, (spaces.ObservationAdapter, spaces.ActionAdapter))  # nothing added
    env.close()


# -- networks


def test_the_nature_cnn_keeps_its_atari_parameters():
    torso = make_torso(EnvSpec((84, 84), np.dtype(np.uint8), 4, 6), Config().model)
    shapes = {name: tuple(p.shape) for name, p in torso.state_dict().items()}
    assert shapes == {
        "net.0.weight": (32, 4, 8, 8),
        "net.0.bias": (32,),
        "net.2.weight": (64, 32, 4, 4),
        "net.2.bias": (64,),
        "net.4.weight": (64, 64, 3, 3),
        "net.4.bias": (64,),
        "net.7.weight": (512, 3136),
        "net.7.bias": (512,),
    }


@pytest.mark.parametrize(
    "frame_shape, dtype, stack",
    [
        ((40, 40), np.uint8, 4),
        ((4, 10, 10), np.uint8, 4),
        ((2, 40, 60), np.float32, 2),
        ((3, 96, 96), np.uint8, 2),
        ((10, 10), np.float32, 1),
    ],
)
def test_conv_torsos_fit_their_input(frame_shape, dtype, stack):
    spec = EnvSpec(frame_shape, np.dtype(dtype), stack, 3)
    net = QNetwork(spec, Config().model)
    assert isinstance(net.torso, ConvTorso)
    assert net.torso.net[0].in_channels == stack * (frame_shape[0] if len(frame_shape) == 3 else 1)
    obs = torch.from_numpy(np.ones((5, stack, *frame_shape), dtype))
    assert net(obs).shape == (5, 3)


def test_uint8_images_reach_the_network_scaled_to_one_and_float_images_as_they_are():
    pixels = make_torso(EnvSpec((40, 40), np.dtype(np.uint8), 1, 3), Config().model)
    floats = make_torso(EnvSpec((40, 40), np.dtype(np.float32), 1, 3), Config().model)
    floats.load_state_dict(pixels.state_dict())
    torch.testing.assert_close(
        pixels(torch.full((1, 1, 40, 40), 255, dtype=torch.uint8)), floats(torch.ones(1, 1, 40, 40))
    )


def test_factorised_policy_sums_component_log_probs_and_entropies():
    torch.manual_seed(0)
    nvec = (3, 4)
    logits = torch.randn(6, 2, 7)
    actions = torch.stack([torch.randint(0, 3, (6, 2)), torch.randint(0, 4, (6, 2))], dim=-1)
    first, second = (
        torch.distributions.Categorical(logits=logits[..., :3]),
        torch.distributions.Categorical(logits=logits[..., 3:]),
    )
    lps = log_probs(logits, nvec)
    torch.testing.assert_close(
        action_log_prob(lps, actions, nvec), first.log_prob(actions[..., 0]) + second.log_prob(actions[..., 1])
    )
    torch.testing.assert_close(entropy(lps), first.entropy() + second.entropy())
    net = PolicyValueNetwork(EnvSpec((5,), np.dtype(np.float32), 1, 7, None, nvec), Config().model)
    assert (
        net.greedy(logits[0]).tolist()
        == torch.stack([logits[0, :, :3].argmax(-1), logits[0, :, 3:].argmax(-1)], -1).tolist()
    )


def test_impala_loss_on_multidiscrete_is_the_product_policy():
    torch.manual_seed(0)
    T, B, nvec = 4, 3, (2, 3)
    logits = torch.randn(T + 1, B, 5)
    values = torch.randn(T + 1, B)
    actions = torch.stack([torch.randint(0, 2, (T, B)), torch.randint(0, 3, (T, B))], dim=-1)
    behaviour = torch.full((T, B), -2.0)
    out = impala.impala_loss(
        logits,
        values,
        actions,
        behaviour,
        torch.ones(T, B),
        torch.full((T, B), 0.9),
        1.0,
        1.0,
        0.5,
        0.01,
        EnvSpec((4,), np.dtype(np.float32), 1, 5, None, nvec),
    )
    ent = (
        torch.distributions.Categorical(logits=logits[:-1, :, :2]).entropy()
        + torch.distributions.Categorical(logits=logits[:-1, :, 2:]).entropy()
    ).mean()
    torch.testing.assert_close(out.entropy, ent)


# -- actors and batch schemas on MultiDiscrete actions


def dial_config() -> Config:
    return config_module.load(
        None, ["algo=impala", "env.id=tests.envs:apex-test/MultiDial-v0", "impala.unroll_length=5"]
    )


def test_impala_actor_samples_each_component_and_logs_their_joint_probability():
    config = dial_config()
    actor = impala_actor.ImpalaActor(config, {"num_envs": 3}, seed=0)
    net = PolicyValueNetwork(actor.spec, config.model)  # the learner's network, its weights sent to the actor
    actor.net.load(numpy_weights(net))
    obs = actor.stacker.obs.copy()
    batch = None
    while batch is None:
        batch, _ = actor.act()
    assert batch["action"].shape == (3, 5, 2) and batch["action"].dtype == np.int64
    first = torch.from_numpy(batch["action"][:, 0])
    with torch.no_grad():
        logits, _, _ = net(torch.from_numpy(obs))
    expected = action_log_prob(log_probs(logits, (3, 4)), first, (3, 4)).numpy()
    np.testing.assert_allclose(batch["behaviour_logp"][:, 0], expected, rtol=1e-5)
    spec = actor.spec
    _, sizes = impala.batch_schema(spec, config).validate(batch, impala.batch_limits(3, spec, config))
    assert sizes["unrolls"] == 3
    actor.close()


def dial_batch() -> tuple[dict, EnvSpec, Config]:
    config = dial_config()
    actor = impala_actor.ImpalaActor(config, {"num_envs": 2}, seed=1)
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    return batch, actor.spec, config


@pytest.mark.parametrize(
    "component, value, ok", [(0, 2, True), (0, 3, False), (1, 3, True), (1, 4, False), (0, -1, False), (1, -1, False)]
)
def test_multidiscrete_actions_are_checked_component_by_component(component, value, ok):
    batch, spec, config = dial_batch()
    batch["action"][1, 2, component] = value
    schema, limits = impala.batch_schema(spec, config), impala.batch_limits(2, spec, config)
    if ok:
        schema.validate(batch, limits)
    else:
        with pytest.raises(RejectedMessage, match=f"action component {component}") as e:
            schema.validate(batch, limits)
        assert e.value.reason == "out_of_range"


def test_multidiscrete_actions_without_their_component_axis_are_refused():
    batch, spec, config = dial_batch()
    batch["action"] = batch["action"][..., 0]
    with pytest.raises(RejectedMessage) as e:
        impala.batch_schema(spec, config).validate(batch, impala.batch_limits(2, spec, config))
    assert e.value.reason == "shape"
