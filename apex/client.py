"""``PolicyClient``: a Python client of `apex serve` over ZeroMQ/msgpack, for simulators that
step themselves and want actions from the policy apex is training.

    from apex.client import PolicyClient

    with PolicyClient("tcp://127.0.0.1:8001") as client:
        episode = client.start_episode()
        action = client.get_action(episode, obs)
        client.log_returns(episode, reward)
        ...
        client.end_episode(episode, obs, terminated=True)

``HttpPolicyClient`` has the same methods over HTTP/JSON (the server's ``--http``, the
standard library's keep-alive connection), for where ZeroMQ cannot go.

Each call is one request and waits for its reply (``timeout_s``, then TimeoutError). The
batched forms (``start_episodes``, ``get_actions``, ``log_actions``, ``log_returns_many``,
``end_episodes``) carry many episodes in one request: that is how a vectorised simulator
reaches tens of thousands of steps a second. Errors the server names raise
``PolicyServerError`` with its status (400, 401, 404, 409, 429, 503) and message. No apex
dependencies beyond pyzmq, msgpack and NumPy: the file can be copied into a simulator's code.
"""

from __future__ import annotations

import http.client
import itertools
import json
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth


class PolicyServerError(Exception):
    """A request `apex serve` refused: ``status`` is its HTTP-like code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _array(values: Any) -> dict[str, Any]:
    array = np.ascontiguousarray(values)
    if array.dtype.kind == "f" and array.dtype != np.float32:
        array = array.astype(np.float64)
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "data": array.astype(array.dtype.newbyteorder("<")).tobytes(),
    }


def _actions(values: Any) -> np.ndarray:
    """A reply's actions: indices as int64, a Box's values as float32."""
    actions = np.asarray(values)
    return actions.astype(np.float32) if actions.dtype.kind == "f" else actions.astype(np.int64)


def _wire_actions(actions: Any) -> list[Any]:
    """Client-chosen actions as sent: indices as integers, a Box's values as floats."""
    values = np.asarray(actions)
    wire: list[Any] = (values.astype(np.float64) if values.dtype.kind == "f" else values.astype(np.int64)).tolist()
    return wire


class PolicyClient:
    def __init__(
        self, address: str, *, token: str | None = None, timeout_s: float = 30.0, curve_dir: str | None = None
    ) -> None:
        """``address``: the server's ``--zmq``, e.g. ``tcp://10.0.0.5:8001`` (``tcp://`` may be
        left out). ``curve_dir``: for a server run with ``--curve-dir``, a directory with
        client.key_secret and serve.key (from `apex keygen`)."""
        self.address = address if "://" in address else f"tcp://{address}"
        self.token = token
        self.timeout_s = timeout_s
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if curve_dir is not None:
            public, secret = zmq.auth.load_certificate(f"{curve_dir}/client.key_secret")
            if not secret:
                raise ValueError(f"{curve_dir}/client.key_secret holds no secret key: use the .key_secret file")
            server_public, _ = zmq.auth.load_certificate(f"{curve_dir}/serve.key")
            self._curve = (public, secret, server_public)
        self._context = zmq.Context()
        self._ids = itertools.count()
        self._unanswered: set[int] = set()  # sent with wait=False
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        sock.connect(self.address)
        return sock

    def request(self, op: str, wait: bool = True, **fields: Any) -> dict[str, Any]:
        """One request and its reply (the wire format in docs/serve.md). ``wait=False`` sends it
        and returns at once: its reply is read with the next request's (replies come in
        order), and an error it brings is raised then, so that a simulator can pipeline,
        e.g. end its finished episodes and ask for the next actions in one round trip."""
        request_id = next(self._ids)
        message = {"op": op, "id": request_id, **fields}
        if self.token is not None:
            message["token"] = self.token
        self._socket.send(msgpack.packb(message, use_bin_type=True))
        if not wait:
            self._unanswered.add(request_id)
            return {}
        deadline_ms = int(self.timeout_s * 1000)
        error = None
        while True:
            if not self._socket.poll(deadline_ms):
                # A reply may still come: a fresh socket keeps it from answering the next request.
                self._socket.close(linger=0)
                self._socket = self._connect()
                self._unanswered.clear()
                raise TimeoutError(f"no reply from apex serve at {self.address} within {self.timeout_s} s")
            reply: dict[str, Any] = msgpack.unpackb(self._socket.recv(), raw=False)
            if reply.get("id") in self._unanswered:
                self._unanswered.discard(reply["id"])
                if not reply.get("ok") and error is None:
                    error = PolicyServerError(reply.get("status", 400), reply.get("error", "refused"))
            elif reply.get("id") == request_id:
                break  # older replies (of requests that timed out) are skipped
        if error is not None:
            raise error
        if not reply.get("ok"):
            raise PolicyServerError(reply.get("status", 400), reply.get("error", "refused"))
        return reply

    # -- one episode a request

    def spaces(self) -> dict[str, Any]:
        spaces: dict[str, Any] = self.request("spaces")["spaces"]
        return spaces

    def health(self) -> dict[str, Any]:
        reply = self.request("health")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    def start_episode(self) -> str:
        return self.start_episodes(1)[0]

    def get_action(
        self, episode_id: str, observation: Any, reward: float | None = None
    ) -> int | list[int] | list[float]:
        """The policy's action for ``observation``; ``reward`` (the previous step's, if not
        logged already) saves a ``log_returns`` request."""
        action = self.get_actions([episode_id], [observation], None if reward is None else [reward])[0]
        return action.tolist() if np.ndim(action) else int(action)

    def log_action(self, episode_id: str, observation: Any, action: Any, reward: float | None = None) -> None:
        self.log_actions([episode_id], [observation], [action], None if reward is None else [reward])

    def log_returns(self, episode_id: str, reward: float) -> None:
        """Adds ``reward`` to the episode's current step (call as often as rewards come)."""
        self.log_returns_many([episode_id], [reward])

    def end_episode(
        self,
        episode_id: str,
        observation: Any,
        *,
        terminated: bool = True,
        truncated: bool = False,
        reward: float | None = None,
    ) -> None:
        self.end_episodes([episode_id], [observation], [terminated], [truncated], None if reward is None else [reward])

    # -- many episodes a request

    def start_episodes(self, count: int) -> list[str]:
        ids: list[str] = self.request("start", count=count)["episode_ids"]
        return ids

    def get_actions(self, episode_ids: list[str], observations: Any, rewards: Any = None) -> np.ndarray:
        """Actions for each episode's observation ([n, *observation shape]); ``rewards``: each
        one's previous step, or None."""
        reply = self.request(
            "act",
            episode_ids=list(episode_ids),
            observations=_array(observations),
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        )
        return _actions(reply["actions"])

    def log_actions(self, episode_ids: list[str], observations: Any, actions: Any, rewards: Any = None) -> None:
        self.request(
            "log_action",
            episode_ids=list(episode_ids),
            observations=_array(observations),
            actions=_wire_actions(actions),
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        )

    def log_returns_many(self, episode_ids: list[str], rewards: Any) -> None:
        self.request("rewards", episode_ids=list(episode_ids), rewards=np.asarray(rewards, np.float64).tolist())

    def end_episodes(
        self,
        episode_ids: list[str],
        observations: Any,
        terminated: Any,
        truncated: Any,
        rewards: Any = None,
        wait: bool = True,
    ) -> None:
        """``wait=False``: do not wait for the reply (see ``request``)."""
        self.request(
            "end",
            wait,
            episode_ids=list(episode_ids),
            observations=_array(observations),
            terminated=[bool(t) for t in terminated],
            truncated=[bool(t) for t in truncated],
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        )

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpPolicyClient:
    """``PolicyClient``'s methods over `apex serve`'s HTTP/JSON frontend."""

    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        """``address``: the server's ``--http``, e.g. ``10.0.0.5:8000`` (``http://`` may be given)."""
        host, _, port = address.removeprefix("http://").rstrip("/").rpartition(":")
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        self._deferred_end: dict[str, Any] | None = None  # end_episodes(wait=False): goes with the next request

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._deferred_end is not None:
            deferred, self._deferred_end = self._deferred_end, None
            if path == "/v1/batch/action":  # one round trip: the server ends them, then acts
                body = {**(body or {}), "end": deferred}
            else:
                self.request("POST", "/v1/batch/end", deferred)
        payload = None if body is None else json.dumps(body)
        for attempt in (0, 1):  # a keep-alive connection the server closed is opened again, once
            try:
                self._connection.request(method, path, payload, self._headers)
                response = self._connection.getresponse()
                data: dict[str, Any] = json.loads(response.read() or b"{}")
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._connection.close()
                if attempt:
                    raise
            except TimeoutError:
                self._connection.close()
                raise TimeoutError(
                    f"no reply from apex serve at {self.host}:{self.port} within {self.timeout_s} s"
                ) from None
            except (OSError, http.client.HTTPException):
                self._connection.close()  # e.g. refused: the next request opens a fresh connection
                raise
        if response.status != 200:
            raise PolicyServerError(response.status, data.get("error", response.reason))
        return data

    def spaces(self) -> dict[str, Any]:
        return self.request("GET", "/v1/spaces")

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def start_episode(self) -> str:
        episode_id: str = self.request("POST", "/v1/episodes", {})["episode_id"]
        return episode_id

    def get_action(
        self, episode_id: str, observation: Any, reward: float | None = None
    ) -> int | list[int] | list[float]:
        body = {
            "observation": np.asarray(observation).tolist(),
            **({} if reward is None else {"reward": float(reward)}),
        }
        action: int | list[int] | list[float] = self.request("POST", f"/v1/episodes/{episode_id}/action", body)[
            "action"
        ]
        return action

    def log_action(self, episode_id: str, observation: Any, action: Any, reward: float | None = None) -> None:
        body = {
            "observation": np.asarray(observation).tolist(),
            "action": np.asarray(action).tolist(),
            **({} if reward is None else {"reward": float(reward)}),
        }
        self.request("POST", f"/v1/episodes/{episode_id}/log_action", body)

    def log_returns(self, episode_id: str, reward: float) -> None:
        self.request("POST", f"/v1/episodes/{episode_id}/rewards", {"reward": float(reward)})

    def end_episode(
        self,
        episode_id: str,
        observation: Any,
        *,
        terminated: bool = True,
        truncated: bool = False,
        reward: float | None = None,
    ) -> None:
        body = {
            "observation": np.asarray(observation).tolist(),
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            **({} if reward is None else {"reward": float(reward)}),
        }
        self.request("POST", f"/v1/episodes/{episode_id}/end", body)

    def start_episodes(self, count: int) -> list[str]:
        ids: list[str] = self.request("POST", "/v1/episodes", {"count": int(count)})["episode_ids"]
        return ids

    def get_actions(self, episode_ids: list[str], observations: Any, rewards: Any = None) -> np.ndarray:
        body = {
            "episode_ids": list(episode_ids),
            "observations": np.asarray(observations).tolist(),
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        }
        return _actions(self.request("POST", "/v1/batch/action", body)["actions"])

    def log_actions(self, episode_ids: list[str], observations: Any, actions: Any, rewards: Any = None) -> None:
        body = {
            "episode_ids": list(episode_ids),
            "observations": np.asarray(observations).tolist(),
            "actions": _wire_actions(actions),
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        }
        self.request("POST", "/v1/batch/log_action", body)

    def log_returns_many(self, episode_ids: list[str], rewards: Any) -> None:
        self.request(
            "POST",
            "/v1/batch/rewards",
            {"episode_ids": list(episode_ids), "rewards": np.asarray(rewards, np.float64).tolist()},
        )

    def end_episodes(
        self,
        episode_ids: list[str],
        observations: Any,
        terminated: Any,
        truncated: Any,
        rewards: Any = None,
        wait: bool = True,
    ) -> None:
        """``wait=False``: sent with the next request instead (inside the next ``get_actions``,
        whose request is then checked whole, so that a refusal of either part raises there and
        neither applies), saving a round trip on the steps where episodes end."""
        body = {
            "episode_ids": list(episode_ids),
            "observations": np.asarray(observations).tolist(),
            "terminated": [bool(t) for t in terminated],
            "truncated": [bool(t) for t in truncated],
            **({} if rewards is None else {"rewards": np.asarray(rewards, np.float64).tolist()}),
        }
        if wait or self._deferred_end is not None:  # one deferred at a time: the older goes first
            self.request("POST", "/v1/batch/end", body)
        else:
            self._deferred_end = body

    def close(self) -> None:
        """Sends an end still deferred (``end_episodes(wait=False)``), then closes."""
        try:
            if self._deferred_end is not None:
                deferred, self._deferred_end = self._deferred_end, None
                self.request("POST", "/v1/batch/end", deferred)
        finally:
            self._connection.close()

    def __enter__(self) -> HttpPolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
