"""The Python API: apex.train from inside this process (and off its main thread) on an
environment registered only through env.imports, apex.load_policy, apex.evaluate,
apex.load_config; env.kwargs and env.wrappers seen from the actors' side."""

from __future__ import annotations

import json
import threading

import gymnasium as gym
import numpy as np
import pytest

import apex
from apex.bench.transport import free_base_port
from apex.errors import ApexError


def test_train_refuses_an_env_registered_only_in_this_process(tmp_path):
    gym.register("apex-test/OnlyHere-v0", entry_point=lambda: gym.make("CartPole-v1"))
    try:
        with pytest.raises(ApexError, match="fresh Python process.*env.imports"):
            apex.train(
                None,
                overrides={"env.id": "apex-test/OnlyHere-v0"},
                stop_env_steps=1000,
                logdir=tmp_path / "run",
                port=free_base_port(),
            )
    finally:
        gym.registry.pop("apex-test/OnlyHere-v0")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ApexError, match="stop condition"):
        apex.train(None)


def test_train_from_a_thread_on_an_imported_env_then_act(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    overrides = {
        "env.imports": ["tests.probe_envs"],
        "env.id": "apex-test/ProbeCartPole-v0",
        "env.kwargs": {"marker_dir": str(markers), "tag": "from-kwargs"},
        "env.wrappers": [
            {"type": "tests.probe_envs.Mark", "kwargs": {"marker_dir": str(markers), "label": "a"}},
            "gymnasium.wrappers.RecordEpisodeStatistics",
        ],
        "actor.num_envs": 4,
        "learner.metrics_interval_s": 0.5,
    }
    rows: list[dict] = []
    outcome: dict = {}

    def run() -> None:  # as a notebook's worker thread would: no signal handlers there
        try:
            outcome["result"] = apex.train(
                None,
                actors=1,
                stop_env_steps=4000,
                logdir=tmp_path / "run",
                overrides=overrides,
                on_metrics=rows.append,
                port=free_base_port(),
            )
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(180)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.summary["env_steps"] >= 4000 and result.summary["stop_reason"] == "4000 env steps"
    assert result.logdir == tmp_path / "run" and result.best_checkpoint.is_file()
    assert rows and rows[-1]["env_steps"] >= 4000 and all("return_mean_100" in r for r in rows)
    # what the actor process made: the env with its kwargs, then the wrapper with its kwargs
    records = [json.loads(p.read_text()) for p in markers.iterdir()]
    actor_records = [r for r in records if " actor " in f" {r['argv']} "]
    assert {r["what"] for r in actor_records} == {"env", "wrapper-a"}, records
    assert all(r["tag"] == "from-kwargs" for r in actor_records if r["what"] == "env")

    # The checkpoint's config names modules: a loader imports them only where it allows them.
    with pytest.raises(ApexError, match="module 'tests.probe_envs'.*--allow-import tests.probe_envs"):
        apex.load_policy(result.best_checkpoint)
    trusted = ["tests.probe_envs", "gymnasium.wrappers"]
    policy = apex.load_policy(result.best_checkpoint, allow_imports=trusted)
    assert policy.env_config.id == "apex-test/ProbeCartPole-v0" and policy.observation_shape == (4,)
    env = policy.make_env(seed=0)
    obs, _ = env.reset(seed=0)
    action = policy.act(obs)
    assert isinstance(action, int) and action in (0, 1)
    env.step(action)
    env.close()
    batch = policy.act(np.zeros((5, 4), np.float32), epsilon=1.0)
    assert batch.shape == (5,) and set(batch.tolist()) <= {0, 1}
    with pytest.raises(ApexError, match=r"shape \(4,\)"):
        policy.act(np.zeros(3))
    assert apex.load_policy(result.logdir, which="newest", allow_imports=trusted).source.suffix == ".pt"
    report = apex.evaluate(result.logdir, episodes=2, allow_imports=trusted)
    assert report["episodes"] == 2 and report["env"] == "apex-test/ProbeCartPole-v0"
