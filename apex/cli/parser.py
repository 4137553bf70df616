"""The `apex` argument parser: the commands that run (learner, actor, serve, run); the tools
around them (bench, eval, plot, config, keygen) are in ``apex.cli.tool_parsers``, the flags
they share in ``apex.cli.flags``."""

from __future__ import annotations

import argparse

from apex import __version__
from apex.cli import commands as cmd
from apex.cli import learner_command
from apex.cli.environment import ENV
from apex.cli.flags import (
    Parser,
    Subcommands,
    add_allow_import,
    add_config_flags,
    add_logdir,
    add_resume,
    add_shorthands,
    add_stop_flags,
    env_default,
)
from apex.cli.tool_parsers import add_bench, add_config, add_eval, add_keygen, add_plot
from apex.config import DEFAULT_PORT


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="apex",
        description="Distributed reinforcement learning (Ape-X DQN, IMPALA) over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"apex {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_bench(commands)
    _add_learner(commands)
    _add_actor(commands)
    _add_serve(commands)
    _add_run(commands)
    add_eval(commands)
    add_plot(commands)
    add_config(commands)
    add_keygen(commands)
    return parser


def _add_learner(commands: Subcommands) -> None:
    learner = commands.add_parser(
        "learner",
        help="run the learner (binds ports P, P+1, P+2)",
        description="Run the learner: it binds its ports and trains from what actors send.",
    )
    add_config_flags(learner)
    add_shorthands(learner)
    add_logdir(learner)
    learner.add_argument(
        "--bind-host",
        default=env_default("bind_host") or "127.0.0.1",
        metavar="HOST",
        help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 for actors on "
        f"other hosts, with CURVE keys from `apex keygen`; env {ENV['bind_host']})",
    )
    learner.add_argument(
        "--port",
        type=int,
        default=env_default("port", int),
        metavar="P",
        help=f"control port; P+1 and P+2 are used too (default: transport.port, {DEFAULT_PORT}; env {ENV['port']})",
    )
    add_stop_flags(learner)
    add_resume(learner)
    add_allow_import(learner, "the checkpoint's (--resume without --config)")
    learner.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from --logdir's newest valid checkpoint if it has one, else start afresh "
        "(for a container or service manager that restarts the learner)",
    )
    ranks = learner.add_argument_group(
        "data-parallel learners (torch.distributed: gloo on CPU, NCCL on CUDA; or torchrun's RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT)"
    )
    ranks.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="start N learner processes on this host as one group (rank r > 0 takes trajectories "
        "on P+2+r; the group meets on P+2+N)",
    )
    ranks.add_argument(
        "--rank", type=int, default=None, metavar="R", help="this process's rank in a group (0 talks to actors)"
    )
    ranks.add_argument("--world-size", type=int, default=None, metavar="W", help="ranks in the group")
    ranks.add_argument("--master", default=None, metavar="HOST:PORT", help="where the group meets (rank 0's host)")
    # apex run passes its own command for the closing line's "resume with".
    learner.add_argument("--resume-command", help=argparse.SUPPRESS)
    learner.set_defaults(handler=learner_command.learner)


def _add_actor(commands: Subcommands) -> None:
    actor = commands.add_parser(
        "actor",
        help="run one actor process against a learner",
        description="Run an actor: it gets the environment and model from the learner.",
    )
    actor.add_argument(
        "--learner",
        default=env_default("learner"),
        metavar="HOST[:PORT]",
        help=f"learner address (port default: {DEFAULT_PORT}; env {ENV['learner']})",
    )
    actor.add_argument(
        "--actor-index",
        type=int,
        default=env_default("actor_index", int),
        metavar="I",
        help=f"position on the exploration ladder (default: the learner assigns one; env {ENV['actor_index']})",
    )
    actor.add_argument(
        "--num-envs",
        type=int,
        default=env_default("num_envs", int),
        metavar="K",
        help=f"environments in this process (default: the learner's actor.num_envs; env {ENV['num_envs']})",
    )
    add_config_flags(actor, actor=True)
    add_allow_import(actor, "the learner's")
    actor.set_defaults(handler=cmd.actor)


def _add_serve(commands: Subcommands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the policy to simulators apex does not step (HTTP/JSON, ZeroMQ)",
        description="An actor whose environments are remote: clients ask it for actions and report rewards "
        "over HTTP/JSON or ZeroMQ/msgpack; it trains the learner on their episodes.",
    )
    serve.add_argument(
        "--learner",
        default=env_default("learner"),
        metavar="HOST[:PORT]",
        help=f"learner address (port default: {DEFAULT_PORT}; env {ENV['learner']})",
    )
    serve.add_argument(
        "--http",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="HTTP/JSON address (default: 127.0.0.1:8000; 'off': none)",
    )
    serve.add_argument(
        "--zmq",
        default=None,
        metavar="[HOST:]PORT",
        help="ZeroMQ/msgpack address for apex.client.PolicyClient (default: none; host 127.0.0.1)",
    )
    serve.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token clients must send (first line; env APEX_SERVE_TOKEN); required when "
        "--http or --zmq listens beyond 127.0.0.1",
    )
    serve.add_argument(
        "--max-episodes",
        type=int,
        default=1024,
        metavar="N",
        help="episodes open at once (default: 1024); more are refused with 429",
    )
    serve.add_argument(
        "--episode-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="an episode without a request for S seconds is closed, what it played kept (default: 60)",
    )
    serve.add_argument(
        "--actor-index",
        type=int,
        default=env_default("actor_index", int),
        metavar="I",
        help="position on the exploration ladder (default: the learner assigns one)",
    )
    serve.add_argument(
        "--num-envs",
        type=int,
        default=env_default("num_envs", int),
        metavar="K",
        help="Ape-X: rungs of the ladder its episodes take in turn; IMPALA: unrolls per batch "
        "(default: the learner's actor.num_envs)",
    )
    add_config_flags(serve, actor=True)
    add_allow_import(serve, "the learner's")
    serve.set_defaults(handler=cmd.serve)


def _add_run(commands: Subcommands) -> None:
    run = commands.add_parser(
        "run",
        help="run a learner and N actors on this machine",
        description="Run a learner and N actor processes here, restarting actors that die.",
    )
    add_config_flags(run)
    add_shorthands(run, num_envs=True)
    run.add_argument("--actors", type=int, default=2, metavar="N", help="actor processes (default: 2)")
    add_logdir(run)
    run.add_argument(
        "--port",
        type=int,
        default=env_default("port", int),
        metavar="P",
        help="learner control port on 127.0.0.1; P+1 and P+2 are used too (default: transport.port)",
    )
    add_stop_flags(run)
    add_resume(run)
    add_allow_import(run, "the checkpoint's (--resume without --config)")
    run.add_argument(
        "--learner-restarts",
        type=int,
        default=10,
        metavar="N",
        help="times a learner that dies is restarted from its newest checkpoint (default: 10; 0: never)",
    )
    run.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="N",
        help="learner processes, as one data-parallel group (apex learner --ranks N; default: 1)",
    )
    ray = run.add_argument_group("on a Ray cluster (pip install 'apex-rl[ray]')")
    ray.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the learner and the actors as Ray actors on the cluster at ADDRESS (auto: the one "
        "ray.init finds, e.g. inside `ray job submit`); the run directory is on the learner's node",
    )
    ray.add_argument(
        "--ray-actor-cpus", type=float, default=1.0, metavar="C", help="CPUs Ray reserves for each actor (default: 1)"
    )
    run.set_defaults(handler=cmd.run)
