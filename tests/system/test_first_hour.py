"""A new user's first hour: command-line shorthands, errors before any process starts,
`apex config`, one answer per hello, the ladder over however many actors join, and what
`apex run` prints (one banner, a status line that says what it shows, a closing line)."""

from __future__ import annotations

import json
import socket
import time

import pytest
import yaml

from apex import config as config_module
from apex.bench.transport import free_base_port
from tests.support.processes import apex


def run_cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    proc = apex(*args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# -- flags


def test_an_actors_num_envs_is_its_own_not_a_config_shorthand():
    """`apex actor --num-envs 1` (APEX_NUM_ENVS in containers) asks the learner for 1
    environment; it is not checked against the actor's local config's eval_envs."""
    code, _, err = run_cli(
        "actor",
        "--learner",
        f"127.0.0.1:{free_base_port()}",
        "--num-envs",
        "1",
        "--set",
        "transport.heartbeat_interval_s=0.5",
        "--set",
        "transport.heartbeat_timeout_s=1",
        "--set",
        "transport.give_up_after_s=2",
    )
    assert code == 2 and "no learner answered" in err, err


def test_the_learners_resume_command_repeats_its_port_and_stops(tmp_path):
    port = free_base_port()
    code, _, err = run_cli("learner", "--port", str(port), "--logdir", str(tmp_path / "run"), "--stop-seconds", "1")
    assert code == 0, err
    closing = next(line for line in err.splitlines() if "stopped (" in line)
    assert closing.endswith(f"resume with: apex learner --resume {tmp_path / 'run'} --port {port} --stop-seconds 1.0")
    assert "newest checkpoint" in closing and "none scored yet" in closing


def test_an_unknown_flag_points_at_set():
    code, _, err = run_cli("run", "--lr", "1e-3")
    assert code == 2 and "unrecognized arguments: --lr" in err and "--set" in err


def test_an_actor_refuses_settings_that_the_learner_decides():
    code, _, err = run_cli("actor", "--learner", "127.0.0.1:1", "--set", "env.id=Acrobot-v1")
    assert code == 2 and "env.id" in err and "learner" in err


def test_a_wrong_env_id_fails_in_the_parent_within_3s(tmp_path):
    start = time.monotonic()
    code, _, err = run_cli("run", "--env", "CartPool-v1", "--logdir", str(tmp_path / "run"))
    assert time.monotonic() - start < 3
    assert code == 2 and "CartPool-v1" in err and "CartPole-v1" in err  # names it and the nearest id
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize("command", ["run", "learner"])
def test_an_unusable_action_space_fails_before_anything_starts(tmp_path, command):
    start = time.monotonic()
    code, _, err = run_cli(
        command, "--env", "Pendulum-v1", "--logdir", str(tmp_path / "run"), "--port", str(free_base_port())
    )
    assert time.monotonic() - start < 3  # checked before torch is imported
    assert code == 2 and "Pendulum-v1" in err and "Discrete" in err
    assert not (tmp_path / "run").exists()


def test_taken_ports_fail_in_the_parent(tmp_path):
    port = free_base_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        code, _, err = run_cli("run", "--port", str(port), "--logdir", str(tmp_path / "run"), timeout=20)
    assert code == 2 and f"port {port + 1}" in err and "--port" in err


# -- apex config


def test_config_list_names_every_preset_and_each_loads_by_name():
    code, out, _ = run_cli("config", "list")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert names == sorted(config_module.presets()) and {"cartpole_apex", "pong_apex"} <= set(names)
    for name in names:
        assert config_module.load(name) == config_module.load(f"{name}.yaml")
    assert config_module.load("pong_apex").env.id == "ALE/Pong-v5"


def test_config_show_explains_every_setting_and_reads_back(tmp_path):
    code, out, _ = run_cli("config", "show", "cartpole_impala", "--set", "impala.lr=0.0005")
    assert code == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert config_module.load(shown) == config_module.load("cartpole_impala", ["impala.lr=0.0005"])
    # every setting line is preceded by its docstring
    lines = out.splitlines()
    settings = [i for i, line in enumerate(lines) if not line.lstrip().startswith("#") and not line.endswith(":")]
    assert len(settings) > 50
    assert all(lines[i - 1].lstrip().startswith("#") for i in settings)
    assert "# Seconds between lines of metrics.jsonl" in out


# -- what apex run prints


def test_apex_run_prints_one_banner_progress_and_a_closing_line(tmp_path):
    logdir = tmp_path / "run"
    code, _out, err = run_cli(
        "run",
        "--env",
        "Acrobot-v1",
        "--algo",
        "impala",
        "--seed",
        "3",
        "--num-envs",
        "4",
        "--actors",
        "1",
        "--stop-env-steps",
        "3000",
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
        timeout=120,
    )
    assert code == 0, err
    saved = yaml.safe_load((logdir / "config.yaml").read_text())
    assert (saved["env"]["id"], saved["algo"], saved["seed"], saved["actor"]["num_envs"]) == (
        "Acrobot-v1",
        "impala",
        3,
        4,
    )
    lines = err.splitlines()
    banners = [line for line in lines if "starting" in line or "apex run:" in line or "apex learner:" in line]
    assert len(banners) == 1 and "starting impala on Acrobot-v1" in banners[0] and str(logdir) in banners[0], banners
    # not a terminal: plain progress lines that say what their numbers are
    assert any("env steps" in line and "eval return" in line and "policy lag" in line for line in lines)
    assert len([line for line in lines if "joined" in line]) == 1, lines  # one actor, answered once
    closing = [line for line in lines if "stopped (" in line]
    assert len(closing) == 1, lines
    assert "3000 env steps" in closing[0] and "checkpoint" in closing[0]
    assert f"resume with: apex run --resume {logdir} --actors 1" in closing[0]
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["env_steps"] >= 3000


def test_the_learner_keeps_its_best_checkpoint_and_eval_plays_it(tmp_path):
    logdir = tmp_path / "run"
    code, _, err = run_cli(
        "run",
        "--stop-env-steps",
        "40000",
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
        "--set",
        "learner.checkpoint_interval_updates=40",
        "--set",
        "learner.keep_checkpoints=1",
        "--set",
        "learner.best_checkpoint_interval_s=0.5",
        "--set",
        "learner.metrics_interval_s=0.5",
        timeout=180,
    )
    assert code == 0, err
    manifests = {m.stem: json.loads(m.read_text()) for m in (logdir / "checkpoints").glob("ckpt-*.json")}
    scores = {name: m["return_mean_100"] for name, m in manifests.items() if m["return_mean_100"] is not None}
    assert scores, "no checkpoint carries the run's return_mean_100"
    best = max(scores, key=lambda name: (scores[name], name))
    newest = max(manifests)
    assert set(manifests) == {best, newest}  # keep_checkpoints=1, and the best beside it
    closing = next(line for line in err.splitlines() if "stopped (" in line)
    assert f"{best}.pt" in closing
    code, out, err = run_cli("eval", "--checkpoint", str(logdir), "--episodes", "1")
    assert code == 0, err
    assert f"{best}.pt (best)" in out
    code, out, err = run_cli("eval", "--checkpoint", str(logdir), "--episodes", "1", "--which", "newest")
    assert code == 0, err
    assert f"{newest}.pt (newest)" in out
