"""``PolicyClient``: `apex serve`'s ZeroMQ/msgpack frontend (see the package's docstring)."""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth

from apex.client.wire import (
    PolicyServerError,
    of_one,
    one_action,
    reply_actions,
    wire_actions,
    wire_flags,
    wire_observations,
    wire_per_agent,
    wire_rewards,
)


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
        self,
        episode_id: str,
        observation: Any,
        reward: Any = None,
        *,
        terminated: Any = None,
        truncated: Any = None,
        action_mask: Any = None,
    ) -> Any:
        """The policy's action for ``observation``; ``reward`` (the previous step's, if not
        logged already) saves a ``log_returns`` request. A multi-agent run's episode: a map by
        agent id of each (and ``terminated``, ``truncated``: agents that finish at this
        observation; ``action_mask``: the legal actions of those that act), and of the actions."""
        rewards = None if reward is None else [reward]
        maps = of_one(terminated, truncated, action_mask)
        return one_action(self.get_actions([episode_id], [observation], rewards, **maps)[0])

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

    def get_actions(self, episode_ids: list[str], observations: Any, rewards: Any = None, **per_agent: Any) -> Any:
        """Actions for each episode's observation ([n, *observation shape]); ``rewards``: each
        one's previous step, or None. A multi-agent run's: a list of maps by agent of each
        (``terminated``, ``truncated``, ``action_masks`` too), and of the actions."""
        reply = self.request(
            "act",
            episode_ids=list(episode_ids),
            observations=wire_observations(observations, packed=True),
            **wire_rewards(rewards),
            **wire_per_agent(**per_agent),
        )
        return reply_actions(reply["actions"])

    def log_actions(self, episode_ids: list[str], observations: Any, actions: Any, rewards: Any = None) -> None:
        self.request(
            "log_action",
            episode_ids=list(episode_ids),
            observations=wire_observations(observations, packed=True),
            actions=wire_actions(actions),
            **wire_rewards(rewards),
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
            observations=wire_observations(observations, packed=True),
            terminated=wire_flags(terminated),
            truncated=wire_flags(truncated),
            **wire_rewards(rewards),
        )

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
