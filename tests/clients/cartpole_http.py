"""A simulator that steps its own CartPoles and asks `apex serve` for actions over HTTP/JSON
(one request a step: the previous step's reward rides on the action request), with the
standard library's keep-alive client: what the serve tests run as separate processes.

    python -m tests.clients.cartpole_http 127.0.0.1:8000 --envs 8 --seconds 60
"""

from __future__ import annotations

import argparse
import http.client
import json
import time

import gymnasium as gym


class Http:
    def __init__(self, address: str, token: str | None) -> None:
        host, _, port = address.rpartition(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {token}"} if token else {})}

    def post(self, path: str, body: dict | None = None) -> dict:
        while True:
            self.connection.request("POST", path, json.dumps(body or {}), self.headers)
            response = self.connection.getresponse()
            data = json.loads(response.read())
            if response.status == 503:  # the learner is behind: try again
                continue
            if response.status != 200:
                raise RuntimeError(f"{path}: {response.status} {data}")
            return data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--envs", type=int, default=8, help="episodes played in turn, one request each a step")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token")
    args = parser.parse_args()
    server = Http(args.address, args.token)
    envs = [gym.make("CartPole-v1") for _ in range(args.envs)]
    ids = [server.post("/v1/episodes")["episode_id"] for _ in envs]
    obs = [env.reset(seed=args.seed * 1000 + i)[0] for i, env in enumerate(envs)]
    rewards: list[float | None] = [None] * args.envs
    deadline = time.monotonic() + args.seconds
    steps = 0
    while time.monotonic() < deadline:
        for i, env in enumerate(envs):
            body = {"observation": obs[i].tolist()}
            if rewards[i] is not None:
                body["reward"] = rewards[i]
            action = server.post(f"/v1/episodes/{ids[i]}/action", body)["action"]
            o, r, term, trunc, _ = env.step(action)
            steps += 1
            rewards[i] = float(r)
            if term or trunc:
                server.post(f"/v1/episodes/{ids[i]}/end", {"observation": o.tolist(), "terminated": term,
                                                          "truncated": trunc, "reward": rewards[i]})
                ids[i] = server.post("/v1/episodes")["episode_id"]
                o, _ = env.reset()
                rewards[i] = None
            obs[i] = o
    print(f"steps {steps}", flush=True)


if __name__ == "__main__":
    main()
