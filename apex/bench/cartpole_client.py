"""A simulator that steps its own CartPoles (gymnasium's vectorised NumPy CartPole; another
Gymnasium id with ``--env``) and asks `apex serve` for all their actions in one request a
step, over ZeroMQ (PolicyClient) or HTTP/JSON (HttpPolicyClient): the client process of
`apex bench serve` and the serve tests, and an example to start from. It retries until the
server answers.

    python -m apex.bench.cartpole_client zmq 127.0.0.1:8001 --envs 64 --seconds 60
    python -m apex.bench.cartpole_client http 127.0.0.1:8000 --env Pendulum-v1
    python -m apex.bench.cartpole_client zmq 127.0.0.1:8001 --env tests.multiagent_envs:meet --multi-agent
"""

from __future__ import annotations

import argparse
import json
import time

from apex.bench.serve import play_batched
from apex.bench.serve_clients import play_teams
from apex.client import HttpPolicyClient, PolicyClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("transport", choices=["zmq", "http"])
    parser.add_argument("address")
    parser.add_argument("--envs", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token")
    parser.add_argument("--env", default="CartPole-v1", help="a Gymnasium id (module:id imports the module first)")
    parser.add_argument("--env-kwargs", default="{}", help="its keyword arguments, as JSON")
    parser.add_argument(
        "--multi-agent", action="store_true", help="--env names a PettingZoo ParallelEnv (module:function)"
    )
    args = parser.parse_args()
    client_type = PolicyClient if args.transport == "zmq" else HttpPolicyClient
    deadline = time.monotonic() + 60
    with client_type(args.address, token=args.token) as client:
        while True:  # started with the server: wait for it
            try:
                client.spaces()
                break
            except (OSError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if args.multi_agent:
            steps = play_teams(client, args.env, args.envs, args.seconds, seed=args.seed)
        else:
            steps = play_batched(
                client, args.envs, args.seconds, seed=args.seed, env_id=args.env, env_kwargs=json.loads(args.env_kwargs)
            )
    print(f"steps {steps}", flush=True)


if __name__ == "__main__":
    main()
