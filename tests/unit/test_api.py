"""The Python API's surface: what `apex` exports, and apex.load_config (apex.train,
apex.load_policy and apex.evaluate on real runs: tests/system/test_api.py)."""

from __future__ import annotations

import pytest

import apex
from apex.errors import ApexError


def test_the_api_is_there_and_light():
    assert {"train", "load_config", "load_policy", "evaluate", "RunResult", "Config"} <= set(dir(apex))
    assert callable(apex.evaluate) and callable(apex.train)


def test_load_config_takes_a_preset_and_overrides_as_set_does():
    config = apex.load_config("pong_apex", {"apex_dqn.lr": 1e-3, "env.kwargs": {"repeat_action_probability": 0.0}})
    assert (config.env.id, config.apex_dqn.lr, config.env.kwargs) == (
        "ALE/Pong-v5",
        1e-3,
        {"repeat_action_probability": 0.0},
    )
    with pytest.raises(ApexError, match="did you mean apex_dqn.lr"):
        apex.load_config(None, {"apex_dqn.lrr": 1})
