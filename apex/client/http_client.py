"""``HttpPolicyClient``: `apex serve`'s HTTP/JSON frontend (see the package's docstring)."""

from __future__ import annotations

import http.client
import json
from typing import Any

import numpy as np

from apex.client.wire import (
    PolicyServerError,
    of_one,
    reply_actions,
    wire_actions,
    wire_flags,
    wire_observations,
    wire_per_agent,
    wire_rewards,
)


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
        self,
        episode_id: str,
        observation: Any,
        reward: Any = None,
        *,
        terminated: Any = None,
        truncated: Any = None,
        action_mask: Any = None,
    ) -> Any:
        """As ``PolicyClient.get_action``."""
        maps = wire_per_agent(**of_one(terminated, truncated, action_mask))
        body = {
            "observation": wire_observations([observation])[0],
            **({} if reward is None else {"reward": wire_rewards([reward])["rewards"][0]}),
            **{name.removesuffix("s") if name == "action_masks" else name: value[0] for name, value in maps.items()},
        }
        return self.request("POST", f"/v1/episodes/{episode_id}/action", body)["action"]

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

    def get_actions(self, episode_ids: list[str], observations: Any, rewards: Any = None, **per_agent: Any) -> Any:
        body = {
            "episode_ids": list(episode_ids),
            "observations": wire_observations(observations),
            **wire_rewards(rewards),
            **wire_per_agent(**per_agent),
        }
        return reply_actions(self.request("POST", "/v1/batch/action", body)["actions"])

    def log_actions(self, episode_ids: list[str], observations: Any, actions: Any, rewards: Any = None) -> None:
        body = {
            "episode_ids": list(episode_ids),
            "observations": wire_observations(observations),
            "actions": wire_actions(actions),
            **wire_rewards(rewards),
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
            "observations": wire_observations(observations),
            "terminated": wire_flags(terminated),
            "truncated": wire_flags(truncated),
            **wire_rewards(rewards),
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
