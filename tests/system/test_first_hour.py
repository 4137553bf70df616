"""A new user's first hour: command-line shorthands, errors before any process starts,
`apex config`, one answer per hello, the ladder over however many actors join, and what
`apex run` prints (one banner, a status line that says what it shows, a closing line)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
import yaml

from apex import config as config_module
from apex.algos import exploration
from apex.bench.transport import free_base_port
from apex.cli import build_parser, load_config
from apex.transport import LearnerClient, LearnerEndpoint, TransportConfig
from tests.test_e2e import apex

FAST = TransportConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
PATIENT = TransportConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0)  # for clients that do not tick


def run_cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    proc = apex(*args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# -- flags


def test_shorthands_set_the_config_and_set_wins_over_them():
    args = build_parser().parse_args(["run", "--env", "Acrobot-v1", "--algo", "impala", "--seed", "3",
                                      "--num-envs", "4"])
    config = load_config(args)
    assert (config.env.id, config.algo, config.seed, config.actor.num_envs) == ("Acrobot-v1", "impala", 3, 4)
    args = build_parser().parse_args(["learner", "--env", "Acrobot-v1", "--set", "env.id=MountainCar-v0"])
    assert load_config(args).env.id == "MountainCar-v0"
    args = build_parser().parse_args(["learner", "--env", "ALE/Pong-v5", "--seed", "0"])
    assert (load_config(args).env.id, load_config(args).seed) == ("ALE/Pong-v5", 0)


def test_an_actors_num_envs_is_its_own_not_a_config_shorthand():
    """`apex actor --num-envs 1` (APEX_NUM_ENVS in containers) asks the learner for 1
    environment; it is not checked against the actor's local config's eval_envs."""
    code, _, err = run_cli("actor", "--learner", f"127.0.0.1:{free_base_port()}", "--num-envs", "1",
                           "--set", "transport.heartbeat_interval_s=0.5", "--set", "transport.heartbeat_timeout_s=1",
                           "--set", "transport.give_up_after_s=2")
    assert code == 2 and "no learner answered" in err, err


def test_a_seed_out_of_range_is_a_config_error():
    with pytest.raises(config_module.ConfigError, match="seed must be in 0..2"):
        config_module.load(None, ["seed=-1"])


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
    code, _, err = run_cli(command, "--env", "Pendulum-v1", "--logdir", str(tmp_path / "run"),
                           "--port", str(free_base_port()))
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
    code, out, _ = run_cli("config", "show", "cartpole_impala", "--set", "learner.lr=0.0005")
    assert code == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert config_module.load(shown) == config_module.load("cartpole_impala", ["learner.lr=0.0005"])
    # every setting line is preceded by its docstring
    lines = out.splitlines()
    settings = [i for i, line in enumerate(lines) if not line.lstrip().startswith("#") and not line.endswith(":")]
    assert len(settings) > 50
    assert all(lines[i - 1].lstrip().startswith("#") for i in settings)
    assert "# Seconds between lines of metrics.jsonl" in out


def test_a_config_that_is_neither_a_file_nor_a_preset_is_named():
    with pytest.raises(config_module.ConfigError, match="pong_apx.*pong_apex"):
        config_module.load("pong_apx")


def test_a_retired_key_in_an_old_config_is_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        config = config_module.load_dict({"actor": {"num_actors": 4, "num_envs": 8}})
    assert config.actor.num_envs == 8 and "actor.num_actors" in caplog.text


# -- the learner's side of joining


class Endpoint:
    """A LearnerEndpoint polled in a thread, welcoming with the Ape-X ladder."""

    def __init__(self, port: int, options: TransportConfig = FAST) -> None:
        actor = config_module.ActorConfig(num_envs=4, eval_envs=1)
        self.endpoint = LearnerEndpoint(
            "127.0.0.1", port,
            lambda hello, index: {"epsilons": exploration.actor_epsilons(index, 4, actor)[0]}, options)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.endpoint.poll(10)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.endpoint.close()


def test_actors_started_before_the_learner_are_each_answered_once(caplog):
    port = free_base_port()
    clients = [LearnerClient("127.0.0.1", port, options=PATIENT) for _ in range(3)]
    welcomes: list = [None] * 3

    def handshake(i: int) -> None:
        welcomes[i] = clients[i].handshake(timeout_s=20)

    threads = [threading.Thread(target=handshake, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(2.5)  # several hellos each, unanswered: the learner is not there yet
    with caplog.at_level(logging.INFO, logger="apex.transport"):
        endpoint = Endpoint(port, PATIENT)
        try:
            for t in threads:
                t.join(20)
            time.sleep(1.0)  # any late duplicate hello would be answered by now
            indices = sorted(w.fields["actor_index"] for w in welcomes)
            assert indices == [0, 1, 2]
            assert sorted(s.index for s in endpoint.endpoint.sessions) == [0, 1, 2]
        finally:
            endpoint.close()
            for c in clients:
                c.close()
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joined) == 3, joined


def test_more_actors_than_ever_configured_explore_with_distinct_epsilons():
    port = free_base_port()
    endpoint = Endpoint(port)
    clients = [LearnerClient("127.0.0.1", port, options=FAST) for _ in range(6)]
    try:
        welcomes = [c.handshake(timeout_s=10) for c in clients]
        epsilons = {w.fields["actor_index"]: w.fields["setup"]["epsilons"][:3] for w in welcomes}
        assert sorted(epsilons) == list(range(6))
        flat = [e for eps in epsilons.values() for e in eps]
        assert len(set(flat)) == len(flat) == 18
        # one leaves: the next to join takes its place on the ladder
        clients[2].close()
        gone = welcomes[2].fields["actor_index"]
        deadline = time.monotonic() + 5
        while endpoint.endpoint.actors_connected > 5 and time.monotonic() < deadline:
            for c in clients[:2] + clients[3:]:
                c.tick()
            time.sleep(0.05)
        clients[2] = LearnerClient("127.0.0.1", port, options=FAST)
        newcomer = clients[2].handshake(timeout_s=10)
        assert newcomer.fields["actor_index"] == gone
        assert newcomer.fields["setup"]["epsilons"][:3] == epsilons[gone]
    finally:
        endpoint.close()
        for c in clients:
            c.close()


def test_an_actor_keeps_its_connection_alive_while_its_environments_are_made():
    """16 Atari environments take longer to make than the learner's heartbeat timeout: the
    actor ticks (heartbeats) between them, or the learner drops it and it joins twice."""
    from apex.envs import VectorEnv

    ticks = []
    envs = VectorEnv(config_module.EnvConfig(), 3, seed=0, tick=lambda: ticks.append(time.monotonic()))
    assert len(ticks) == 3
    envs.reset()
    assert len(ticks) == 6


# -- what apex run prints


def test_apex_run_prints_one_banner_progress_and_a_closing_line(tmp_path):
    logdir = tmp_path / "run"
    code, out, err = run_cli("run", "--env", "Acrobot-v1", "--algo", "impala", "--seed", "3", "--num-envs", "4",
                             "--actors", "1", "--stop-env-steps", "3000", "--logdir", str(logdir),
                             "--port", str(free_base_port()), timeout=120)
    assert code == 0, err
    saved = yaml.safe_load((logdir / "config.yaml").read_text())
    assert (saved["env"]["id"], saved["algo"], saved["seed"], saved["actor"]["num_envs"]) == ("Acrobot-v1", "impala", 3, 4)
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
    code, _, err = run_cli("run", "--stop-env-steps", "40000", "--logdir", str(logdir), "--port", str(free_base_port()),
                           "--set", "learner.checkpoint_interval_updates=40", "--set", "learner.keep_checkpoints=1",
                           "--set", "learner.best_checkpoint_interval_s=0.5", "--set", "learner.metrics_interval_s=0.5",
                           timeout=180)
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
