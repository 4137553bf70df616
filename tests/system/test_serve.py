"""`apex serve` as users run it: a real learner and server, clients over HTTP and ZeroMQ, and
hostile requests, each of which gets its error while the server and honest clients go on."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import msgpack
import numpy as np
import pytest
import zmq

from apex.bench.transport import free_base_port
from apex.client import PolicyClient, PolicyServerError
from tests.support.processes import kill_leftovers, wait_for
from tests.support.runs import FAST, metrics

TOKEN = "s3cret-token-for-the-serve-tests"


@dataclass
class Served:
    learner: subprocess.Popen
    serve: subprocess.Popen
    http_port: int
    zmq_port: int
    logdir: Path
    log: Path

    def http(
        self,
        method: str,
        path: str,
        body: bytes | str | dict | None = None,
        token: str | None = TOKEN,
        headers: dict | None = None,
    ) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            payload = json.dumps(body) if isinstance(body, dict) else body
            connection.request(
                method, path, payload, {**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})}
            )
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def health(self) -> dict:
        return self.http("GET", "/v1/health")[1]


def start_served(
    tmp_path: Path, algo: str = "apex_dqn", extra: tuple[str, ...] = (), learner_args: tuple[str, ...] = ()
) -> Served:
    port, front = free_base_port(), free_base_port()
    (tmp_path / "token").write_text(TOKEN + "\n")
    log = tmp_path / "serve.log"
    learner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "learner",
            "--algo",
            algo,
            "--port",
            str(port),
            "--logdir",
            str(tmp_path / "run"),
            "--stop-seconds",
            "300",
            *FAST,
            *learner_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "learner.log", "w"),
    )
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "serve",
            "--learner",
            f"127.0.0.1:{port}",
            "--http",
            f"127.0.0.1:{front}",
            "--zmq",
            str(front + 1),
            "--token-file",
            str(tmp_path / "token"),
            *extra,
            *FAST[:4],
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )
    served = Served(learner, serve, front, front + 1, tmp_path / "run", log)

    def up() -> bool:
        try:
            return served.health()["connected"]
        except OSError:
            return False

    try:
        wait_for(up, 60, "apex serve to answer")
    except AssertionError:
        kill_leftovers([learner, serve])
        raise AssertionError(log.read_text()) from None
    return served


def stop(served: Served) -> None:
    served.serve.terminate()
    served.learner.terminate()
    try:
        assert served.serve.wait(timeout=30) == 0, served.log.read_text()
        served.learner.wait(timeout=30)
    finally:
        kill_leftovers([served.serve, served.learner])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = start_served(tmp_path_factory.mktemp("serve"), extra=("--episode-timeout", "2"))
    yield served
    stop(served)


def play_http(served: Served, episodes: int) -> int:
    """Honest CartPole episodes over HTTP; returns their steps."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    steps = 0
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        status, started = served.http("POST", "/v1/episodes")
        assert status == 200, started
        episode = started["episode_id"]
        reward = None
        while True:
            status, reply = served.http(
                "POST",
                f"/v1/episodes/{episode}/action",
                {"observation": obs.tolist(), **({} if reward is None else {"reward": reward})},
            )
            assert status == 200, reply
            obs, reward, terminated, truncated, _ = env.step(reply["action"])
            steps += 1
            if terminated or truncated:
                status, reply = served.http(
                    "POST",
                    f"/v1/episodes/{episode}/end",
                    {"observation": obs.tolist(), "terminated": terminated, "truncated": truncated, "reward": reward},
                )
                assert status == 200, reply
                break
    return steps


def test_spaces_health_and_an_honest_episode(served):
    status, spaces = served.http("GET", "/v1/spaces")
    assert status == 200
    assert spaces["observation"]["shape"] == [4] and spaces["observation"]["dtype"] == "float32"
    assert spaces["action"] == {"type": "Discrete", "n": 2}
    before = served.health()
    steps = play_http(served, 3)
    after = served.health()
    assert after["episodes_finished"] - before["episodes_finished"] == 3
    assert after["env_steps"] - before["env_steps"] == steps
    assert after["algo"] == "apex_dqn" and after["status"] == "ok"


def test_a_server_of_vector_observations_never_loads_torch(served):
    """As local actors: the NumPy forward pass serves CartPole, and torch's import (~0.7 s and
    ~190 MB a server) would only delay the first actions and crowd the learner's cores."""
    play_http(served, 1)
    libraries = Path(f"/proc/{served.serve.pid}/maps").read_text()
    assert "_multiarray_umath" in libraries  # NumPy's extension: the maps list what the process loaded
    assert "libtorch" not in libraries


@pytest.mark.parametrize("token", [None, "wrong-token-of-some-length"])
def test_a_missing_or_wrong_token_is_401(served, token):
    for method, path in (("GET", "/v1/spaces"), ("POST", "/v1/episodes"), ("GET", "/v1/health")):
        status, reply = served.http(method, path, token=token)
        assert status == 401 and "bearer token" in reply["error"]
    assert served.health()["rejected_by_reason"]["token"] >= 3


def test_each_hostile_http_request_gets_its_error_and_nothing_moves(served):
    _, started = served.http("POST", "/v1/episodes")
    episode = started["episode_id"]
    assert served.http("POST", f"/v1/episodes/{episode}/action", {"observation": [0.0, 0.0, 0.0, 0.0]})[0] == 200
    before = served.health()
    action = f"/v1/episodes/{episode}/action"
    cases = [
        ("POST", action, "{not json", 400, "malformed JSON"),
        ("POST", action, "[1, 2]", 400, "JSON object"),
        ("POST", action, "[" * 100_000, 400, "nested too deep"),
        ("POST", action, {"observation": {"x": 1}}, 400, "does not match"),
        ("POST", action, {"observation": [[0.0], 0.0, 0.0, 0.0]}, 400, "not an array of numbers"),
        ("POST", action, {}, 400, "missing 'observation'"),
        ("POST", action, {"observation": [0.0, 0.0, 0.0]}, 400, "does not match the run's [4]"),
        ("POST", action, {"observation": [[0.0] * 4] * 2}, 400, "does not match"),
        ("POST", action, {"observation": ["a", "b", "c", "d"]}, 400, "numbers"),
        ("POST", action, {"observation": [0.0, 1e400, 0.0, 0.0]}, 400, "finite"),
        # finite as float64, inf as the run's float32: the learner would refuse the batch it went
        # into, honest episodes' steps with it
        ("POST", action, {"observation": [0.0, 1e300, 0.0, 0.0]}, 400, "float32: at most"),
        (
            "POST",
            action,
            '{"observation": [0.0, 0.0, 0.0, 0.0], "reward": 1' + "0" * 400 + "}",
            400,
            "rewards must be numbers",
        ),
        ("POST", action, {"observation": [0.0] * 4, "reward": "lots"}, 400, "rewards must be numbers"),
        ("POST", action, {"observation": [0.0] * 4, "reward": 1e300}, 400, "max_abs_reward"),
        ("POST", "/v1/episodes/0123456789abcdef01234567/action", {"observation": [0.0] * 4}, 404, "no open episode"),
        ("POST", f"/v1/episodes/{episode}/end", {"observation": [0.0] * 4, "terminated": "yes"}, 400, "terminated"),
        ("POST", f"/v1/episodes/{episode}/log_action", {"observation": [0.0] * 4, "action": 7}, 400, "0..1"),
        ("POST", action, {"observation": [0.0] * 4, "rewrad": 1.0}, 400, "unknown: rewrad"),
        ("POST", "/v1/episodes/x/fly", {}, 404, "no such endpoint"),
        ("GET", action, None, 405, ""),
        ("POST", action, "[" + "0.0," * 400_000 + "0.0]", 413, "request body over"),
    ]
    for method, path, body, status, words in cases:
        got, reply = served.http(method, path, body)
        assert (got, words in reply.get("error", "")) == (status, True), (method, path, str(body)[:60], got, reply)
    # a token header that is not UTF-8 (aiohttp keeps its bytes as surrogates)
    got, reply = served.http(
        "POST",
        action,
        {"observation": [0.0] * 4},
        token=None,
        headers={"Authorization": b"Bearer " + TOKEN.encode() + b"\xff"},
    )
    assert got == 401 and "bearer token" in reply["error"], reply
    after = served.health()
    assert after["env_steps"] == before["env_steps"]  # not one step taken by a bad request
    assert sum(after["rejected_by_reason"].values()) - sum(before["rejected_by_reason"].values()) == len(cases) + 1
    assert "internal" not in after["rejected_by_reason"]
    # and the episode goes on
    assert served.http("POST", action, {"observation": [0.01, 0.0, 0.0, 0.0], "reward": 1.0})[0] == 200
    assert served.health()["env_steps"] == before["env_steps"] + 1


def test_one_address_holds_at_most_its_share_of_episodes_over_both_transports(served):
    """serve.max_episodes_per_client (256): a client's address, over HTTP and ZeroMQ together;
    the 257th is 429 on either, and the room comes back as its episodes expire (2 s here)."""
    time.sleep(2.5)  # earlier tests' episodes from this address expire first
    status, reply = served.http("POST", "/v1/episodes", {"count": 256})
    assert status == 200 and len(reply["episode_ids"]) == 256
    status, reply = served.http("POST", "/v1/episodes", {})
    assert status == 429 and "serve.max_episodes_per_client" in reply["error"], reply
    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        with pytest.raises(PolicyServerError, match="holds 256 open episodes") as error:
            client.start_episodes(1)
        assert error.value.status == 429
        time.sleep(2.5)
        assert len(client.start_episodes(1)) == 1
    assert served.health()["rejected_by_reason"]["client_episodes"] >= 2


def test_an_idle_episode_expires_and_is_404_after(served):
    _, started = served.http("POST", "/v1/episodes")
    episode = started["episode_id"]
    assert served.http("POST", f"/v1/episodes/{episode}/action", {"observation": [0.0] * 4})[0] == 200
    expired = served.health()["episodes_expired"]
    wait_for(lambda: served.health()["episodes_expired"] > expired, 10, "the idle episode to expire")
    status, reply = served.http("POST", f"/v1/episodes/{episode}/action", {"observation": [0.0] * 4})
    assert status == 404 and "expired" in reply["error"]


def test_ends_ride_inside_the_next_act_request_over_both_transports(served):
    """One round trip a step: a deferred end goes inside the next act request, and an act
    request whose end part is bad is refused whole (neither part applies)."""
    from apex.client import HttpPolicyClient

    with HttpPolicyClient(f"127.0.0.1:{served.http_port}", token=TOKEN) as client:
        a, b, c = client.start_episodes(3)
        client.get_actions([a, b], [[0.0] * 4, [0.01] * 4])
        before = served.health()
        client.end_episodes([a], [[0.02] * 4], [True], [False], [1.0], wait=False)
        assert served.health()["episodes_finished"] == before["episodes_finished"]  # held for the next request
        client.get_actions([b, c], [[0.02] * 4, [0.0] * 4], [1.0, 0.0])
        after = served.health()
        assert after["requests"] - before["requests"] == 1  # one act request (health checks are not counted)
        assert after["episodes_finished"] - before["episodes_finished"] == 1
        assert after["env_steps"] - before["env_steps"] == 2  # a's last step and b's
        status, reply = served.http(
            "POST",
            "/v1/batch/action",
            {
                "episode_ids": [b],
                "observations": [[0.03] * 4],
                "end": {"episode_ids": [c], "observations": [[0.0] * 3]},
            },
        )
        assert status == 400 and "does not match" in reply["error"]
        status, reply = served.http(
            "POST", "/v1/batch/action", {"episode_ids": [b], "observations": [[0.03] * 4], "end": "all of them"}
        )
        assert status == 400 and "end must be a map" in reply["error"]
        assert served.health()["env_steps"] == after["env_steps"]  # neither part of either applied

    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        a, b = client.start_episodes(2)
        client.get_actions([a, b], [[0.0] * 4, [0.01] * 4])
        before = served.health()
        bad = {"dtype": "float32", "shape": [1, 4], "data": b"\0" * 12}
        with pytest.raises(PolicyServerError, match="data must be 16 bytes"):
            client.request(
                "act", episode_ids=[b], observations=[[0.02] * 4], end={"episode_ids": [a], "observations": bad}
            )
        assert served.health()["env_steps"] == before["env_steps"]
        good = {**bad, "data": np.zeros(4, np.float32).tobytes()}
        client.request(
            "act",
            episode_ids=[b],
            observations=[[0.02] * 4],
            end={"episode_ids": [a], "observations": good, "terminated": [True]},
        )
        after = served.health()
        assert (
            after["env_steps"] - before["env_steps"] == 2
            and after["episodes_finished"] - before["episodes_finished"] == 1
        )


def raw_zmq(served: Served, frames: list[bytes]) -> dict:
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{served.zmq_port}")
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        return msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
    finally:
        sock.close()


def test_each_hostile_zmq_request_gets_its_error(served):
    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        (episode,) = client.start_episodes(1)
        client.get_actions([episode], [[0.0] * 4])
    request = {"op": "act", "token": TOKEN, "episode_ids": [episode], "id": 7}
    array = {"dtype": "float32", "shape": [1, 4], "data": b"\0" * 16}
    cases = [
        (b"\xc1garbage", 400, "not a msgpack message"),
        (msgpack.packb([1, 2, 3]), 400, "msgpack map"),
        (msgpack.packb({"op": "spaces"}), 401, "token"),
        (msgpack.packb({"op": "spaces", "token": "wrong"}), 401, "token"),
        (msgpack.packb({**request, "op": "fly"}), 400, "unknown op"),
        (msgpack.packb({**request, "observations": {**array, "dtype": "object"}}), 400, "dtype must be one of"),
        # unhashable dtypes once ended the frontend's loop: no reply to anyone after
        (msgpack.packb({**request, "observations": {**array, "dtype": ["float32"]}}), 400, "dtype must be one of"),
        (
            msgpack.packb(
                {
                    **request,
                    "observations": array,
                    "end": {"episode_ids": [episode], "observations": {**array, "dtype": {}}},
                }
            ),
            400,
            "end.observations: dtype must be one of",
        ),
        (
            msgpack.packb(
                {
                    **request,
                    "observations": {**array, "dtype": "float64", "data": np.array([[0.0, 1e300, 0.0, 0.0]]).tobytes()},
                }
            ),
            400,
            "float32: at most",
        ),
        (msgpack.packb({**request, "observations": {**array, "data": b"\0" * 15}}), 400, "data must be 16 bytes"),
        (msgpack.packb({**request, "observations": {**array, "shape": [1, -4]}}), 400, "shape must be"),
        (msgpack.packb({**request, "observations": {**array, "shape": [1, 3], "data": b"\0" * 12}}), 400, "shape"),
        (msgpack.packb({**request, "episode_ids": ["nope"], "observations": array}), 404, "no open episode"),
        (msgpack.packb({**request, "episode_ids": "x" * 10_000, "observations": array}), 404, "no open episode"),
        (msgpack.packb({**request, "observations": array, "rewards": [float("nan")]}), 400, "finite"),
        (msgpack.packb({"op": "start", "token": TOKEN, "count": 10**12}), 429, "--max-episodes"),
        (msgpack.packb({"op": "start", "token": TOKEN, "count": -1}), 400, "positive integer"),
        (msgpack.packb({**request, "episode_ids": ["x"] * 5000, "observations": array}), 400, "at most"),
        (msgpack.packb({**request, "observations": array, "rewrad": [1.0]}), 400, "unknown: rewrad"),
    ]
    for payload, status, words in cases:
        reply = raw_zmq(served, [payload])
        assert reply["ok"] is False and reply["status"] == status and words in reply["error"], (payload[:40], reply)
    assert raw_zmq(served, [msgpack.packb({**request, "observations": array})])["id"] == 7  # the id comes back
    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        with pytest.raises(PolicyServerError) as error:
            client.get_actions(["nope"], [[0.0] * 4])
        assert error.value.status == 404
        assert client.get_actions([episode], [[0.0] * 4], [1.0]).shape == (1,)  # the episode goes on


def test_a_client_that_leaves_mid_body_is_counted_not_a_traceback(served):
    import socket

    before = served.health()["rejected_by_reason"].get("disconnected", 0)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.http_port)) as sock:
            sock.sendall(
                f"POST /v1/episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Length: 100\r\n\r\n{".encode()
            )
    wait_for(
        lambda: served.health()["rejected_by_reason"].get("disconnected", 0) == before + 3,
        10,
        "the three to be counted",
    )
    assert "Error handling request" not in served.log.read_text()


def test_a_request_that_finds_a_bug_is_answered_500_counted_and_the_frontend_serves_on():
    import asyncio
    import logging
    from collections import Counter

    from apex.serve.server import Server
    from apex.serve.zmq_frontend import Handler
    from apex.system.logs import RateLimitedLog

    class Broken:  # a server whose episode code fails as a bug would
        rejected: ClassVar[Counter] = Counter()
        _internal_log = RateLimitedLog(logging.getLogger("test"))
        internal_error = Server.internal_error
        refused = Server.refused
        _bad_log = _internal_log

        def authorised(self, presented):
            return True

        def call(self, *args):
            raise IndexError("a bug")

        async def wait_for_room(self):
            pass

    handler = Handler(Broken())
    for request in ({"op": "start", "id": 3}, {"op": "rewards", "id": 3, "episode_ids": [], "rewards": []}):
        reply = asyncio.run(handler(msgpack.packb(request)))
        assert reply == {"id": 3, "ok": False, "status": 500, "error": reply["error"]} and "its log" in reply["error"]
    assert handler.server.rejected["internal"] == 2


def test_a_flood_from_one_client_does_not_stop_another_from_training(served):
    stop_flood = threading.Event()
    sent = {"http": 0, "zmq": 0}

    def flood_http():
        connection = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
        while not stop_flood.is_set():
            connection.request("POST", "/v1/episodes/x/action", "{garbage", {"Authorization": f"Bearer {TOKEN}"})
            connection.getresponse().read()
            sent["http"] += 1

    def flood_zmq():
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{served.zmq_port}")
        while not stop_flood.is_set():  # sends and never reads its replies
            try:
                sock.send(b"\xc1" * 100, flags=zmq.NOBLOCK)
                sent["zmq"] += 1
            except zmq.Again:
                time.sleep(0.001)
        sock.close()

    floods = [threading.Thread(target=flood_http), threading.Thread(target=flood_zmq)]
    before = served.health()
    learner_steps = metrics(served.logdir)[-1]["env_steps"] if metrics(served.logdir) else 0
    for thread in floods:
        thread.start()
    try:
        honest = subprocess.run(
            [
                sys.executable,
                "-m",
                "apex.bench.cartpole_client",
                "zmq",
                f"127.0.0.1:{served.zmq_port}",
                "--envs",
                "16",
                "--seconds",
                "8",
                "--token",
                TOKEN,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        stop_flood.set()
        for thread in floods:
            thread.join()
    assert honest.returncode == 0, honest.stderr
    steps = int(honest.stdout.split()[-1])
    after = served.health()
    assert steps >= 2000, (steps, sent)  # the honest client trained on
    assert sent["http"] >= 200 and sent["zmq"] >= 200
    assert sum(after["rejected_by_reason"].values()) - sum(before["rejected_by_reason"].values()) >= sent["http"]
    assert served.serve.poll() is None and served.learner.poll() is None
    wait_for(
        lambda: metrics(served.logdir)[-1]["env_steps"] >= learner_steps + steps // 2,
        30,
        "the learner to count the honest client's steps",
    )
    assert metrics(served.logdir)[-1]["rejected_messages"] == 0  # nothing bad reached the learner


def test_serving_beyond_loopback_needs_a_token(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "apex", "serve", "--learner", "127.0.0.1:9", "--http", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "--token-file" in out.stderr, out.stderr
    for text in ("abc\n", "  \n\n"):  # too short, or only blanks
        (tmp_path / "short").write_text(text)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "apex",
                "serve",
                "--learner",
                "127.0.0.1:9",
                "--token-file",
                str(tmp_path / "short"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2 and "at least 16 characters" in out.stderr, out.stderr


def test_impala_refuses_logged_actions_with_a_reason(tmp_path):
    served = start_served(tmp_path, algo="impala")
    try:
        _, started = served.http("POST", "/v1/episodes")
        status, reply = served.http(
            "POST", f"/v1/episodes/{started['episode_id']}/log_action", {"observation": [0.0] * 4, "action": 1}
        )
        assert status == 409 and "on-policy" in reply["error"]
        steps = play_http(served, 2)
        assert served.health()["env_steps"] == steps
    finally:
        stop(served)


def test_apex_ddpg_serves_bounded_torques_and_learns_logged_ones(tmp_path):
    """Ape-X DDPG behind apex serve on Pendulum: the action space is the Box, every action
    comes back inside its bounds, a client's own action is taken as logged (one outside the
    bounds is refused) and every step reaches the learner."""
    import gymnasium as gym

    served = start_served(
        tmp_path, algo="apex_ddpg", learner_args=("--env", "Pendulum-v1", "--set", "apex_ddpg.eval_envs=1")
    )
    try:
        status, spaces = served.http("GET", "/v1/spaces")
        assert status == 200 and spaces["action"]["type"] == "Box" and spaces["action"]["shape"] == [1]
        _, hostile = served.http("POST", "/v1/episodes")
        # huge, outside [-2, 2], not a number, wrong shapes
        for action in ([1e300], [2.5], ["a lot"], [1.0, 2.0], [[1.0]] * 2):
            body = {"observation": [1.0, 0.0, 0.0], "action": action}
            status, reply = served.http("POST", f"/v1/episodes/{hostile['episode_id']}/log_action", body)
            assert status == 400 and "action" in reply["error"], reply
        refused = served.health()
        assert refused["env_steps"] == 0 and refused["rejected_by_reason"]["action"] >= 5
        env = gym.make("Pendulum-v1", max_episode_steps=20)
        steps = 0
        for seed in range(2):
            obs, _ = env.reset(seed=seed)
            _, started = served.http("POST", "/v1/episodes")
            episode, reward = started["episode_id"], None
            while True:
                body = {"observation": obs.tolist(), **({} if reward is None else {"reward": reward})}
                if steps % 5 == 4:  # the client's own torque: logged
                    status, reply = served.http("POST", f"/v1/episodes/{episode}/log_action", {**body, "action": [2.0]})
                    assert status == 200, reply
                    action = [2.0]
                else:
                    status, reply = served.http("POST", f"/v1/episodes/{episode}/action", body)
                    assert status == 200, reply
                    action = reply["action"]
                    assert len(action) == 1 and -2.0 <= action[0] <= 2.0
                obs, reward, terminated, truncated, _ = env.step(np.asarray(action, np.float32))
                steps += 1
                if terminated or truncated:
                    end = {"observation": obs.tolist(), "terminated": terminated, "truncated": truncated}
                    status, reply = served.http("POST", f"/v1/episodes/{episode}/end", {**end, "reward": reward})
                    assert status == 200, reply
                    break
        health = served.health()
        assert health["algo"] == "apex_ddpg" and health["env_steps"] == steps == 40
        assert health["episodes_finished"] == 2
    finally:
        stop(served)


def test_zmq_with_curve_lets_in_only_clients_with_an_authorised_key(tmp_path):
    for name in ("keys", "other"):
        assert (
            subprocess.run(
                [sys.executable, "-m", "apex", "keygen", str(tmp_path / name)], capture_output=True, check=False
            ).returncode
            == 0
        )
    keys = str(tmp_path / "keys")
    port, front = free_base_port(), free_base_port()
    learner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "learner",
            "--port",
            str(port),
            "--curve-dir",
            keys,
            "--logdir",
            str(tmp_path / "run"),
            "--stop-seconds",
            "120",
            *FAST,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "learner.log", "w"),
    )
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apex",
            "serve",
            "--learner",
            f"127.0.0.1:{port}",
            "--curve-dir",
            keys,
            "--http",
            "off",
            "--zmq",
            str(front),
            *FAST[:4],
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "w"),
    )
    try:
        with PolicyClient(f"127.0.0.1:{front}", curve_dir=keys, timeout_s=60) as client:
            assert client.spaces()["action"] == {"type": "Discrete", "n": 2}
            (episode,) = client.start_episodes(1)
            assert client.get_actions([episode], [[0.0] * 4]).shape == (1,)
        for curve_dir in (None, str(tmp_path / "other")):  # no keys, or keys the server does not know
            with (
                PolicyClient(f"127.0.0.1:{front}", curve_dir=curve_dir, timeout_s=2) as client,
                pytest.raises(TimeoutError),
            ):
                client.spaces()
        assert "CURVE" in (tmp_path / "serve.log").read_text()
    finally:
        for process in (serve, learner):
            process.terminate()
        kill_leftovers([serve, learner])


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def body_limit(served: Served) -> int:
    """The server's largest body, as its 413 says it."""
    status, reply = served.http("POST", "/v1/batch/action", "[" + "0.0," * 400_000 + "0.0]")
    assert status == 413, reply
    return int(reply["error"].split("over ")[1].split()[0])


def patient_request(served: Served, method: str, path: str, body=None, seconds: float = 20.0) -> dict:
    """A request an honest client retries while the server says it is full (503) or drops
    the connection at accept."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            status, reply = served.http(method, path, body)
            if status == 200:
                return reply
            assert status == 503, (status, reply)
        except (OSError, http.client.HTTPException):
            pass
        assert time.monotonic() < deadline, f"{method} {path} not served within {seconds} s"
        time.sleep(0.1)


def test_held_bodies_and_slowloris_cost_bounded_memory_while_honest_clients_are_served(tmp_path):
    """Issue 30, item 6: 300 connections each holding a body one byte short of the limit and
    100 slowloris connections (a request head dribbled a line a second) once grew apex serve
    by 120 MiB (64 MiB bodies for image observations: gigabytes). Now the bytes of the bodies
    being read are budgeted (serve.max_body_bytes_in_flight, default 8 MiB), the connections
    capped (serve.max_connections, here below the 400 of the attack) and both kinds closed
    after serve.idle_timeout_s; an honest client is served throughout."""
    import socket

    idle_s = 15
    served = start_served(
        tmp_path, extra=("--set", "serve.max_connections=350", "--set", f"serve.idle_timeout_s={idle_s}")
    )
    attack: list[socket.socket] = []
    try:
        limit = body_limit(served)
        play_http(served, 2)
        time.sleep(0.5)
        base = resident_mib(served.serve.pid)
        before = served.health()["rejected_by_reason"]

        def connect() -> socket.socket | None:
            try:
                sock = socket.create_connection(("127.0.0.1", served.http_port), timeout=10)
            except OSError:
                return None
            sock.setblocking(False)
            attack.append(sock)
            return sock

        head = (
            f"POST /v1/batch/action HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit}\r\n\r\n"
        ).encode()
        # All connect before any sends, so that the 400 are open at once.
        holders = [s for s in (connect() for _ in range(300)) if s is not None]
        slow = [s for s in (connect() for _ in range(100)) if s is not None]
        pending = {s: memoryview(head + b" " * (limit - 1)) for s in holders}
        slow_head = b"POST /v1/episodes HTTP/1.1\r\nHost: x\r\n"
        stop_attack = threading.Event()

        def pump() -> None:  # what the attackers send: as fast as the server takes it, and a line a second
            next_line = 0.0
            while not stop_attack.is_set():
                for sock, data in list(pending.items()):
                    try:
                        sent = sock.send(data)
                    except BlockingIOError:
                        continue
                    except OSError:
                        sent = len(data)  # refused and closed: done
                    if sent == len(data):
                        del pending[sock]
                    else:
                        pending[sock] = data[sent:]
                if time.monotonic() >= next_line:
                    for sock in slow:
                        try:
                            sock.send(slow_head if next_line == 0.0 else b"X-Pad: 1\r\n")
                        except OSError:
                            pass
                    next_line = time.monotonic() + 1.0
                time.sleep(0.01)

        def still_open(sock: socket.socket) -> bool:
            try:
                while sock.recv(65536):  # a 503 before the close
                    pass
                return False
            except BlockingIOError:
                return True
            except OSError:
                return False

        peak = base
        sampling = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not sampling.is_set():
                peak = max(peak, resident_mib(served.serve.pid))
                time.sleep(0.05)

        threads = [threading.Thread(target=pump), threading.Thread(target=sample)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(3.0)  # the bodies and heads arrive (a few MiB a second is enough to fill the budget)
            # An honest episode, served while the slowloris connections are still open.
            started = patient_request(served, "POST", "/v1/episodes", seconds=idle_s / 2)
            reply = patient_request(
                served,
                "POST",
                f"/v1/episodes/{started['episode_id']}/action",
                {"observation": [0.0] * 4},
                seconds=idle_s / 2,
            )
            assert reply["action"] in (0, 1)
            assert sum(still_open(s) for s in slow) >= 10, "the honest client came after the slowloris ones closed"
            time.sleep(1.0)
        finally:
            sampling.set()
        growth = peak - base
        print(f"apex serve: {base:.0f} MiB resident, {peak:.0f} MiB at the peak of the attack (+{growth:.1f} MiB)")
        assert growth < 30, f"apex serve grew by {growth:.0f} MiB under the attack"
        rejected = served.health()["rejected_by_reason"]
        # 400 > serve.max_connections: the idlest closed for the newest, all sent before any request began
        assert rejected.get("idle_closed", 0) - before.get("idle_closed", 0) >= 1
        assert rejected.get("body_bytes", 0) - before.get("body_bytes", 0) >= 50  # past the 8 MiB of bodies
        # Past the idle timeout the rest are closed and counted: the slow heads and bodies.
        wait_for(lambda: not any(still_open(s) for s in slow + holders), idle_s + 30, "the server to close them all")
        stop_attack.set()
        for thread in threads:
            thread.join()
        rejected = served.health()["rejected_by_reason"]
        assert rejected.get("incomplete", 0) - before.get("incomplete", 0) >= 10, rejected
        assert rejected.get("body_timeout", 0) - before.get("body_timeout", 0) >= 1, rejected
        assert served.serve.poll() is None
        assert play_http(served, 1) >= 1
        assert "Traceback" not in served.log.read_text()
    finally:
        for sock in attack:
            sock.close()
        stop(served)


def test_a_full_server_closes_its_idlest_connection_for_a_new_one_and_refuses_only_when_all_are_busy(tmp_path):
    """Issue 34, item 5: 20,000 idle connections once took every serve.max_connections slot,
    and honest clients got 503s. Now a new connection closes the one idle longest (no request
    being handled), counted as idle_closed; only when every connection is busy with a request
    is the new one answered 503 (counted as connections)."""
    import socket

    from apex.client import HttpPolicyClient

    served = start_served(tmp_path, extra=("--set", "serve.max_connections=4", "--set", "serve.handshake_timeout_s=1"))
    sockets: list[socket.socket] = []

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", served.http_port), timeout=10)
        sockets.append(sock)
        time.sleep(0.2)  # accepted in this order
        return sock

    def reply_of(sock: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < content_length(data):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        return data

    def content_length(data: bytes) -> int:
        for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                return int(line.split(b":")[1])
        return 0

    def closed(sock: socket.socket) -> bool:
        sock.settimeout(2.0)
        try:
            return sock.recv(1) == b""
        except TimeoutError:
            return False

    try:
        before = served.health()["rejected_by_reason"]
        time.sleep(0.5)  # the health request's connection is gone
        # Every slot busy: four requests whose bodies lack their last byte.
        body = b'{"count": 1}' + b" " * 500
        head = (
            f"POST /v1/episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        holders = [connect() for _ in range(4)]
        for sock in holders:
            sock.sendall(head + body[:-1])
        time.sleep(0.5)
        refused = connect()
        assert reply_of(refused).startswith(b"HTTP/1.1 503"), "every connection busy: the new one is refused"
        # Their requests done, the four are idle; the first done is the first closed for a new one.
        for sock in holders:
            sock.sendall(body[-1:])
            assert reply_of(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.2)
        client = HttpPolicyClient(f"127.0.0.1:{served.http_port}", token=TOKEN)
        episode = client.start_episode()
        assert client.get_action(episode, [0.0] * 4) in (0, 1)
        for _ in range(20):
            assert client.get_action(episode, [0.0] * 4, reward=1.0) in (0, 1)
        assert closed(holders[0]), "the connection idle longest is closed for the new one"
        assert not any(closed(sock) for sock in holders[1:]), "only one was needed"
        # The client's connection, busy a moment ago, outlives older idle ones.
        for _ in range(3):
            connect().sendall(
                b"GET /v1/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
            )
        assert all(closed(sock) for sock in holders[1:])
        assert client.get_action(episode, [0.0] * 4, reward=1.0) in (0, 1)
        rejected = client.health()["rejected_by_reason"]
        assert rejected.get("connections", 0) - before.get("connections", 0) == 1, rejected
        assert rejected.get("idle_closed", 0) - before.get("idle_closed", 0) >= 4, rejected
        client.close()
        # ZeroMQ's frontend closes a connection that has not finished its handshake in time.
        silent = socket.create_connection(("127.0.0.1", served.zmq_port), timeout=10)
        sockets.append(silent)
        started = time.monotonic()
        while silent.recv(4096):  # the server's greeting, then the close
            pass
        assert time.monotonic() - started < 5, "serve.handshake_timeout_s is 1 s"
        with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as zmq_client:
            assert len(zmq_client.start_episodes(2)) == 2
        assert "Traceback" not in served.log.read_text()
    finally:
        for sock in sockets:
            sock.close()
        stop(served)
