"""apex.wire.schema: the one check of a received batch, for both algorithms, on batches that the
real actor cores produce (then made hostile one way at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from apex import algos
from apex import config as config_module
from apex.algos.apex_dqn import learner as apex_dqn
from apex.algos.impala import learner as impala
from apex.bench.batches import BATCH_FIELDS
from apex.config import Config
from apex.envs.make import EnvSpec
from apex.errors import RejectedMessage
from apex.wire.protocol import Compressed, decode, encode
from apex.wire.schema import check_episodes

ATARI = EnvSpec((84, 84), np.dtype(np.uint8), 4, 6)


def actor_batch(algo: str, num_envs: int = 3) -> tuple[dict, EnvSpec, Config]:
    """A batch exactly as an actor of ``algo`` sends it on CartPole."""
    config = config_module.load(None, [f"algo={algo}", "impala.unroll_length=5", "apex_dqn.chunk_transitions=8"])
    welcome = {"num_envs": num_envs, "epsilons": [0.5] * num_envs, "eval_envs": [False] * num_envs}
    actor = algos.get(algo).actor().core(config, welcome, seed=0)
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    return batch, actor.spec, config


def validate(algo: str, batch: dict, spec: EnvSpec, config: Config, num_envs: int = 3):
    module = apex_dqn if algo == "apex_dqn" else impala
    return module.batch_schema(spec, config).validate(batch, module.batch_limits(num_envs, spec, config))


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_an_actors_own_batch_passes_cast_to_its_stored_dtypes(algo):
    batch, spec, config = actor_batch(algo)
    arrays, sizes = validate(algo, batch, spec, config)
    assert arrays["action"].dtype == np.int64 and arrays["obs_frame"].dtype == np.int32
    assert arrays["reward"].dtype == np.float32 and arrays["frames"].dtype == np.float32
    steps = sizes["transitions"] if algo == "apex_dqn" else sizes["unrolls"] * config.impala.unroll_length
    assert steps == (len(batch["action"]) if algo == "apex_dqn" else batch["action"].size)


HOSTILE = [
    # (algo or None for both, change, reason, words in the message)
    (None, lambda b: b["frames"].__setitem__((0, 0), np.nan), "nonfinite", "frames"),
    (None, lambda b: b.update(frames=b["frames"].astype(np.float64) * 1e39), "nonfinite", "frames"),  # inf as float32
    (None, lambda b: b.update(reward=b["reward"].astype(np.float64) + 1e300), "nonfinite", "reward"),
    (None, lambda b: b.update(reward=b["reward"] * 0 + 1e12), "out_of_range", "reward"),
    (None, lambda b: b.update(discount=b["discount"] + 1.5), "out_of_range", "discount"),
    (None, lambda b: b.update(discount=b["discount"] * np.nan), "nonfinite", "discount"),
    (None, lambda b: b.update(action=b["action"] + 2), "out_of_range", "action"),
    (None, lambda b: b.update(action=b["action"] - 3), "out_of_range", "action"),
    (None, lambda b: b.update(action=b["action"].astype(np.float32)), "dtype", "action"),
    (None, lambda b: b.update(action=b["action"].astype(np.uint64) + np.uint64(2**63)), "out_of_range", "action"),
    (None, lambda b: b.update(obs_frame=b["obs_frame"] + len(b["frames"])), "out_of_range", "obs_frame"),
    (None, lambda b: b.update(obs_frame=b["obs_frame"] - 100), "out_of_range", "obs_frame"),
    (None, lambda b: b.update(extra=np.zeros(3)), "fields", "unexpected ['extra']"),
    (None, lambda b: b.pop("discount"), "fields", "missing ['discount']"),
    (None, lambda b: b.update(frames=b["frames"][:, :2]), "shape", "frames"),
    (None, lambda b: b.update(frames=b["frames"][:0]), "shape", "at least one"),
    ("apex_dqn", lambda b: b.update(action=b["action"][:2]), "shape", "action"),
    ("apex_dqn", lambda b: b.update(priority=b["priority"] * np.inf), "nonfinite", "priority"),
    ("apex_dqn", lambda b: b.update(priority=-b["priority"] - 1), "out_of_range", "priority"),
    ("apex_dqn", lambda b: b.update(next_obs_frame=b["next_obs_frame"] + 10_000), "out_of_range", "next_obs_frame"),
    ("impala", lambda b: b.update(obs_frame=b["obs_frame"][:, :-1]), "shape", "obs_frame"),
    ("impala", lambda b: b.update(behaviour_logp=b["behaviour_logp"] * 0 + 1.0), "out_of_range", "behaviour_logp"),
    ("impala", lambda b: b.update(behaviour_logp=b["behaviour_logp"] * np.nan), "nonfinite", "behaviour_logp"),
]


@pytest.mark.parametrize(
    "algo, change, reason, words",
    [
        (algo, change, reason, words)
        for algo in ("apex_dqn", "impala")
        for only, change, reason, words in HOSTILE
        if only in (None, algo)
    ],
)
def test_hostile_batches_are_rejected_with_a_reason(algo, change, reason, words):
    batch, spec, config = actor_batch(algo)
    batch = {k: np.array(v) for k, v in batch.items()}
    change(batch)
    with pytest.raises(RejectedMessage, match=words.replace("[", r"\[").replace("]", r"\]")) as caught:
        validate(algo, batch, spec, config)
    assert caught.value.reason == reason


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_uint8_actions_are_accepted_and_cast_to_int64(algo):
    """Found against IMPALA: uint8 actions passed the dtype check and crashed the loss's gather."""
    batch, spec, config = actor_batch(algo)
    arrays, _ = validate(algo, {**batch, "action": batch["action"].astype(np.uint8)}, spec, config)
    assert arrays["action"].dtype == np.int64


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_sizes_over_the_sessions_limits_are_refused_before_anything_is_decompressed(algo):
    """A batch declaring more than an actor of its size can send: refused from its layout."""
    batch, spec, config = actor_batch(algo, num_envs=3)
    n = 50_000
    huge = {name: np.zeros((n, *a.shape[1:]), a.dtype) for name, a in batch.items()}
    lazy = decode(encode("batch", BATCH_FIELDS, huge), lazy=True).arrays
    assert all(isinstance(a, Compressed) for a in lazy.values())
    for array in lazy.values():  # had anything been decompressed, this would fail loudly
        object.__setattr__(array, "payload", b"not lz4 at all")
    with pytest.raises(RejectedMessage, match="over this actor's limit") as caught:
        validate(algo, lazy, spec, config, num_envs=3)
    assert caught.value.reason == "too_large"


def test_image_frames_stay_compressed_for_the_ring_and_float_frames_are_checked():
    config = Config()
    schema, limits = apex_dqn.batch_schema(ATARI, config), apex_dqn.batch_limits(16, ATARI, config)
    n = 32
    chunk = {
        "frames": np.zeros((n + 4 + 3, 84, 84), np.uint8),
        "obs_frame": np.arange(n, dtype=np.int32),
        "next_obs_frame": np.arange(n, dtype=np.int32) + 3,
        "action": np.zeros(n, np.int64),
        "reward": np.ones(n, np.float32),
        "discount": np.full(n, 0.97, np.float32),
        "priority": np.ones(n, np.float32),
    }
    arrays, sizes = schema.validate(decode(encode("batch", BATCH_FIELDS, chunk), lazy=True).arrays, limits)
    assert isinstance(arrays["frames"], Compressed) and sizes == {"frames": n + 7, "transitions": n}
    with pytest.raises(RejectedMessage, match="expected uint8") as caught:  # pixels are never cast
        schema.validate({**chunk, "frames": chunk["frames"].astype(np.uint16)}, limits)
    assert caught.value.reason == "dtype"
    # Float frames (CartPole) sent lz4-compressed are decompressed and checked, NaN found.
    batch, spec, config = actor_batch("apex_dqn")
    frames = np.repeat(batch["frames"], 200, axis=0)
    frames[-1, 0] = np.nan
    big = {**batch, "frames": frames}
    lazy = decode(encode("batch", BATCH_FIELDS, big), lazy=True).arrays
    assert isinstance(lazy["frames"], Compressed)
    with pytest.raises(RejectedMessage, match="NaN"):
        apex_dqn.batch_schema(spec, config).validate(lazy, {"frames": 10**6, "transitions": 10**6})


def test_batch_limits_hold_every_batch_an_honest_actor_sends():
    """The limits are an upper bound of what the actor cores produce (or honest data is lost)."""
    for algo, num_envs in (("apex_dqn", 1), ("apex_dqn", 7), ("impala", 5)):
        # episodes end all the time (max_episode_steps 3): the most chunks and stacks
        config = config_module.load(
            None, [f"algo={algo}", "apex_dqn.chunk_transitions=4", "impala.unroll_length=3", "env.max_episode_steps=3"]
        )
        module = apex_dqn if algo == "apex_dqn" else impala
        welcome = {"num_envs": num_envs, "epsilons": [1.0] * num_envs, "eval_envs": [False] * num_envs}
        actor = algos.get(algo).actor().core(config, welcome, seed=1)
        schema, limits = module.batch_schema(actor.spec, config), module.batch_limits(num_envs, actor.spec, config)
        for _ in range(100):
            batch, _ = actor.act()
            if batch is not None:
                schema.validate(batch, limits)
        actor.close()


EPISODES = {"max_episodes": 10, "step_limit": 500, "max_abs_reward": 1.0, "step_budget": 1000}


@pytest.mark.parametrize(
    "info, words",
    [
        ({"env_steps": 16}, "info must be"),  # env steps are never taken from the sender
        ({"episodes": "x"}, "at most 10 records"),
        ({"episodes": [[1.0, 2, True]] * 11}, "at most 10 records"),
        ({"episodes": [[1.0, 2]]}, r"\[return, length, is_eval\]"),
        ({"episodes": [[1.0, 2, "yes"]]}, r"\[return, length, is_eval\]"),
        ({"episodes": [[1.0, 2.0, True]]}, r"\[return, length, is_eval\]"),
        ({"episodes": [[float("nan"), 2, True]]}, "return of nan"),
        ({"episodes": [[3.0, 2, True]]}, "return of 3.0 over 2 steps"),  # more than 1.0 a step
        ({"episodes": [[1.0, 0, True]]}, "outside 1..500"),
        ({"episodes": [[1.0, 501, True]]}, "outside 1..500"),
        ({"episodes": [[500.0, 500, True]] * 3}, "1500 steps in all"),  # more than it played
    ],
)
def test_episode_records_are_bounded(info, words):
    with pytest.raises(RejectedMessage, match=words) as caught:
        check_episodes(info, **EPISODES)
    assert caught.value.reason in ("info", "episodes")


def test_honest_episode_records_pass():
    records, used = check_episodes({"episodes": [[200.0, 200, True], [-3, 10, False]]}, **EPISODES)
    assert records == [(200.0, 200, True), (-3.0, 10, False)] and used == 210
    assert check_episodes({}, **EPISODES) == ([], 0)


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_observations_are_held_to_the_spaces_bounds_and_1e6_where_it_has_none(algo):
    """Issue 30 item 3: 1e30 in CartPole's unbounded velocities is finite as float32, and
    made most updates non-finite; its position is bounded by the space (4.8)."""
    batch, spec, config = actor_batch(algo)
    assert spec.frame_bound[0] == pytest.approx(4.8) and spec.frame_bound[1] == np.inf

    def with_value(column: int, value: float, max_abs_obs: float | None = None):
        frames = np.array(batch["frames"])
        frames[-1, column] = value
        cfg = (
            config
            if max_abs_obs is None
            else config_module.load_dict(config.to_dict(), [f"transport.max_abs_obs={max_abs_obs}"])
        )
        return validate(algo, {**batch, "frames": frames}, spec, cfg)

    with_value(1, 9e5)  # fast, not poison
    for column, value, reason in (
        (1, 1e30, "out_of_range"),
        (1, -2e6, "out_of_range"),
        (0, 5.0, "out_of_range"),
        (3, np.nan, "nonfinite"),
    ):
        with pytest.raises(RejectedMessage, match=f"frames component {column} holds") as caught:
            with_value(column, value)
        assert caught.value.reason == reason
    with pytest.raises(RejectedMessage, match=r"frames component 1 holds values outside \[-10, 10\]"):
        with_value(1, 11.0, max_abs_obs=10)  # the key bounds every value, the space's bounds aside
    with_value(0, 9.0, max_abs_obs=10)
