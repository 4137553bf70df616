"""The `apex` argument parser: every subcommand, flag and environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any

from apex import __version__
from apex.cli import commands as cmd
from apex.cli.environment import ENV
from apex.config import ALGOS, DEFAULT_PORT

# What an unknown flag's error adds, by subcommand: most unknown flags of run and learner
# are config values (`--lr 1e-3`), and every config value has a --set.
UNKNOWN_FLAG_HINTS = {
    "run": "any config value is set with --set KEY=VALUE (e.g. --set apex_dqn.lr=1e-3); `apex config show` lists them",
    "learner": "any config value is set with --set KEY=VALUE (e.g. --set apex_dqn.lr=1e-3); "
    "`apex config show` lists them",
    "actor": "the environment, model and algorithm come from the learner (set them there); an actor takes "
    "--set transport.KEY=VALUE",
}


class Parser(argparse.ArgumentParser):
    """argparse, with a hint for an unknown flag that says where such a setting goes."""

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = getattr(parsed, "command", None)
            hint = UNKNOWN_FLAG_HINTS.get(command) if command is not None else None
            self.error(
                f"unrecognized arguments: {' '.join(unknown)}"
                + (f"; {hint}" if hint else "")
                + f"; `apex {getattr(parsed, 'command', 'COMMAND')} --help` lists the flags"
            )
        return parsed


def _env_default(name: str, cast: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(ENV[name])
    if value in (None, ""):
        return None
    try:
        return cast(value)
    except ValueError:
        raise SystemExit(
            f"apex: error: environment variable {ENV[name]}={value!r} is not a valid {cast.__name__}"
        ) from None


def _add_config_flags(p: argparse.ArgumentParser, actor: bool = False) -> None:
    if actor:  # the learner decides everything but the transport
        config_help = "YAML config or preset; only its transport section is used, the rest comes from the learner"
        set_help = (
            "override one transport value, e.g. --set transport.give_up_after_s=0 (repeatable); "
            "the environment, model and algorithm come from the learner"
        )
    else:
        config_help = (
            "YAML config, or a shipped preset by name (`apex config list`; default: the embedded CartPole Ape-X run)"
        )
        set_help = (
            "override one config value, e.g. --set apex_dqn.lr=1e-3 (value parsed as YAML; repeatable; "
            "`apex config show` lists every key)"
        )
    p.add_argument(
        "--config", default=_env_default("config"), metavar="FILE|NAME", help=f"{config_help} (env {ENV['config']})"
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    p.add_argument(
        "--curve-dir",
        default=_env_default("curve_dir"),
        metavar="DIR",
        help=f"CURVE keys from `apex keygen` (same as --set transport.curve_dir=DIR; env {ENV['curve_dir']})",
    )


def _add_shorthands(p: argparse.ArgumentParser, num_envs: bool = False) -> None:
    group = p.add_argument_group("shorthands for --set")
    group.add_argument("--env", metavar="ID", help="environment: a Gymnasium id (--set env.id=ID)")
    group.add_argument("--algo", choices=ALGOS, help="algorithm (--set algo=ALGO)")
    group.add_argument("--seed", type=int, metavar="N", help="seed of the run (--set seed=N)")
    if num_envs:
        group.add_argument(
            "--num-envs",
            type=int,
            default=_env_default("num_envs", int),
            metavar="K",
            help=f"environments per actor (--set actor.num_envs=K; env {ENV['num_envs']})",
        )


def _add_stop_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stop-return", type=float, metavar="R", help="stop once return_mean_100 (100 evaluation episodes) reaches R"
    )
    p.add_argument("--stop-seconds", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--stop-env-steps", type=int, metavar="N", help="stop after N environment steps")


def _add_resume(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        default=_env_default("resume"),
        metavar="DIR",
        help="continue the run in DIR (a --logdir) from its newest valid checkpoint: networks, "
        "optimizer, counters, episode returns and replay; the config is the checkpoint's "
        f"(plus --set) unless --config is given; logs go on in DIR (env {ENV['resume']})",
    )


def _add_allow_import(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument(
        "--allow-import",
        dest="allow_imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=f"let {whose} config import MODULE and its submodules (env.imports, env.id module:Id, "
        "env.wrappers): a config from elsewhere imports nothing this side does not allow "
        "(repeatable; config env.allow_imports; env APEX_ALLOW_IMPORTS, comma-separated)",
    )


def _add_logdir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logdir",
        default=_env_default("logdir"),
        metavar="DIR",
        help=f"where metrics.jsonl, summary.json and checkpoints/ go (default: runs/<time>-<env>; env {ENV['logdir']})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="apex",
        description="Distributed reinforcement learning (Ape-X DQN, IMPALA) over ZeroMQ.",
    )
    parser.add_argument("--version", action="version", version=f"apex {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from apex.bench import BENCHMARKS

    bench = commands.add_parser(
        "bench",
        help="measure throughput (prints tables; --json writes a report)",
        description="Measure apex's throughput against a baseline run in the same process.",
    )
    bench.add_argument(
        "names",
        nargs="*",
        default=["all"],
        choices=[*BENCHMARKS, "all"],
        metavar="BENCHMARK",
        help=f"benchmarks to run: {', '.join(BENCHMARKS)} or all (default: all; all leaves out the soak)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    bench.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="time per measured operation, or per actor count for e2e (default: each benchmark's own)",
    )
    e2e = bench.add_argument_group("e2e options")
    e2e.add_argument("--algo", choices=["apex_dqn", "impala"], default="apex_dqn", help="algorithm (default: apex_dqn)")
    e2e.add_argument("--env", metavar="ID", help="Gymnasium id (default: the config's, CartPole-v1)")
    e2e.add_argument(
        "--actors",
        default=None,
        metavar="N,N,...",
        help="actor counts to run (e2e default: 1,2,4; soak: one count, default 3)",
    )
    e2e.add_argument("--plot", metavar="FILE.png", help="also draw the scaling curves (soak: the RSS curve)")
    learner_options = bench.add_argument_group("learner options")
    learner_options.add_argument(
        "--ranks",
        default=None,
        metavar="N,N,...",
        help="data-parallel group sizes to measure as well (default: 1, one process; "
        "e.g. 1,2: one process, then two learner processes over torch.distributed)",
    )
    soak = bench.add_argument_group("soak options (not part of all; --seconds default 600)")
    soak.add_argument(
        "--churn-seconds", type=float, default=10.0, metavar="S", help="mean seconds between actor kills (default: 10)"
    )
    soak.add_argument(
        "--checkpoint-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="learner checkpoint interval, replay included (default: 60)",
    )
    soak.add_argument("--logdir", metavar="DIR", help="keep the soak's run directory here (default: a temporary one)")
    soak.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a learner config value, e.g. --set apex_dqn.replay.capacity=50000",
    )
    learn = bench.add_argument_group("learn options (not part of all; --plot draws the curves)")
    learn.add_argument(
        "--tasks",
        metavar="T,T,...",
        help="tasks to learn: cartpole, acrobot, mountaincar, lunarlander (Box2D extra), minatar_breakout, "
        "minatar_spaceinvaders, minatar_asterix, minatar_freeway, minatar_seaquest (minatar extra), "
        "and with continuous actions (IMPALA only) pendulum, lunarlandercontinuous (Box2D) "
        "(default: all)",
    )
    learn.add_argument("--algos", metavar="A,A,...", help="apex_dqn, impala (default: both)")
    learn.add_argument(
        "--seeds",
        type=int,
        default=3,
        metavar="N",
        help="seeds per task and algorithm (default: 3); serve: runs per algorithm and transport of "
        "its CartPole comparison (0: throughput only)",
    )
    learn.add_argument(
        "--minutes",
        type=float,
        default=None,
        metavar="M",
        help="time limit per run (default: each task's own: 2 for cartpole and acrobot, 5 for "
        "mountaincar, lunarlander and pendulum, 15 for lunarlandercontinuous, 20 for MinAtar; "
        "--seconds overrides it)",
    )
    learn.add_argument(
        "--runs-dir",
        metavar="DIR",
        help="keep each run's directory and record here; the same command run again reads the runs "
        "already recorded instead of repeating them (a long bench can be stopped and go on)",
    )
    bench.set_defaults(handler=cmd.bench)

    learner = commands.add_parser(
        "learner",
        help="run the learner (binds ports P, P+1, P+2)",
        description="Run the learner: it binds its ports and trains from what actors send.",
    )
    _add_config_flags(learner)
    _add_shorthands(learner)
    _add_logdir(learner)
    learner.add_argument(
        "--bind-host",
        default=_env_default("bind_host") or "127.0.0.1",
        metavar="HOST",
        help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 for actors on "
        f"other hosts, with CURVE keys from `apex keygen`; env {ENV['bind_host']})",
    )
    learner.add_argument(
        "--port",
        type=int,
        default=_env_default("port", int),
        metavar="P",
        help=f"control port; P+1 and P+2 are used too (default: transport.port, {DEFAULT_PORT}; env {ENV['port']})",
    )
    _add_stop_flags(learner)
    _add_resume(learner)
    _add_allow_import(learner, "the checkpoint's (--resume without --config)")
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
    learner.set_defaults(handler=cmd.learner)

    actor = commands.add_parser(
        "actor",
        help="run one actor process against a learner",
        description="Run an actor: it gets the environment and model from the learner.",
    )
    actor.add_argument(
        "--learner",
        default=_env_default("learner"),
        metavar="HOST[:PORT]",
        help=f"learner address (port default: {DEFAULT_PORT}; env {ENV['learner']})",
    )
    actor.add_argument(
        "--actor-index",
        type=int,
        default=_env_default("actor_index", int),
        metavar="I",
        help=f"position on the exploration ladder (default: the learner assigns one; env {ENV['actor_index']})",
    )
    actor.add_argument(
        "--num-envs",
        type=int,
        default=_env_default("num_envs", int),
        metavar="K",
        help=f"environments in this process (default: the learner's actor.num_envs; env {ENV['num_envs']})",
    )
    _add_config_flags(actor, actor=True)
    _add_allow_import(actor, "the learner's")
    actor.set_defaults(handler=cmd.actor)

    serve = commands.add_parser(
        "serve",
        help="serve the policy to simulators apex does not step (HTTP/JSON, ZeroMQ)",
        description="An actor whose environments are remote: clients ask it for actions and report rewards "
        "over HTTP/JSON or ZeroMQ/msgpack; it trains the learner on their episodes.",
    )
    serve.add_argument(
        "--learner",
        default=_env_default("learner"),
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
        default=_env_default("actor_index", int),
        metavar="I",
        help="position on the exploration ladder (default: the learner assigns one)",
    )
    serve.add_argument(
        "--num-envs",
        type=int,
        default=_env_default("num_envs", int),
        metavar="K",
        help="Ape-X: rungs of the ladder its episodes take in turn; IMPALA: unrolls per batch "
        "(default: the learner's actor.num_envs)",
    )
    _add_config_flags(serve, actor=True)
    _add_allow_import(serve, "the learner's")
    serve.set_defaults(handler=cmd.serve)

    run = commands.add_parser(
        "run",
        help="run a learner and N actors on this machine",
        description="Run a learner and N actor processes here, restarting actors that die.",
    )
    _add_config_flags(run)
    _add_shorthands(run, num_envs=True)
    run.add_argument("--actors", type=int, default=2, metavar="N", help="actor processes (default: 2)")
    _add_logdir(run)
    run.add_argument(
        "--port",
        type=int,
        default=_env_default("port", int),
        metavar="P",
        help="learner control port on 127.0.0.1; P+1 and P+2 are used too (default: transport.port)",
    )
    _add_stop_flags(run)
    _add_resume(run)
    _add_allow_import(run, "the checkpoint's (--resume without --config)")
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
    run.set_defaults(handler=cmd.run)

    evaluate = commands.add_parser(
        "eval",
        help="play a checkpoint's policy and report its returns",
        description="Play a learner checkpoint greedily (Ape-X: epsilon 0 by default).",
    )
    evaluate.add_argument(
        "--checkpoint",
        required=True,
        metavar="PATH",
        help="a LOGDIR/checkpoints/ckpt-*.pt file, or a LOGDIR (its checkpoint chosen by --which)",
    )
    evaluate.add_argument(
        "--which",
        choices=["best", "newest"],
        default="best",
        help="for a LOGDIR: the checkpoint with the best return_mean_100 (the newest when none has "
        "one), or the newest (default: best)",
    )
    evaluate.add_argument("--episodes", type=int, default=10, metavar="N", help="episodes to play (default: 10)")
    evaluate.add_argument("--epsilon", type=float, default=0.0, help="random-action probability (default: 0)")
    evaluate.add_argument("--seed", type=int, default=12345, help="environment seed (default: 12345)")
    evaluate.add_argument("--video", metavar="DIR", help="also record every episode to DIR (needs moviepy)")
    evaluate.add_argument("--json", metavar="FILE", help="also write the result to FILE")
    _add_allow_import(evaluate, "the checkpoint's")
    evaluate.set_defaults(handler=cmd.evaluate)

    plot = commands.add_parser(
        "plot",
        help="draw learning curves and throughput of runs",
        description="Draw return vs env steps and wall time, and throughput, from metrics.jsonl.",
    )
    plot.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="run directories (each with metrics.jsonl)")
    plot.add_argument(
        "-o", "--output", default="apex-runs.png", metavar="FILE.png", help="output image (default: apex-runs.png)"
    )
    plot.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        metavar="W",
        help="smooth the curves: an exponential moving average of weight W in [0, 1), as in "
        "TensorBoard (default: 0, off; the raw curve stays behind, faint)",
    )
    plot.set_defaults(handler=cmd.plot)

    config_cmd = commands.add_parser(
        "config",
        help="list the shipped presets, or show a config with every setting explained",
        description="List the shipped presets, or show a config as YAML with each setting's meaning as a comment.",
    )
    config_actions = config_cmd.add_subparsers(dest="action", required=True, metavar="ACTION")
    config_actions.add_parser(
        "list",
        help="the shipped presets (usable as --config NAME)",
        description="The shipped presets, usable as --config NAME.",
    )
    show = config_actions.add_parser(
        "show",
        help="a config with every setting's docstring",
        description="Print a config (a preset, a YAML file, or the embedded default) "
        "as YAML, each setting with its meaning.",
    )
    show.add_argument(
        "name", nargs="?", metavar="NAME|FILE", help="preset name or YAML file (default: the embedded default)"
    )
    show.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value first (repeatable)",
    )
    config_cmd.set_defaults(handler=cmd.config_command)

    keygen = commands.add_parser(
        "keygen",
        help="create CURVE key pairs for the learner and the actors",
        description=(
            "Create CURVE key pairs in DIR: learner.key(_secret), actor.key(_secret), and "
            "authorized/actor.key. The learner (transport.curve_dir=DIR) accepts only the "
            "public keys in DIR/authorized/. Copy learner.key and actor.key_secret to actor hosts. "
            "Also serve.key(_secret), client.key(_secret) and serve-clients/client.key for apex serve's "
            "ZeroMQ frontend (with --curve-dir DIR) and its clients (PolicyClient(curve_dir=...))."
        ),
    )
    keygen.add_argument("dir", metavar="DIR", help="directory to create the keys in (must not hold keys yet)")
    keygen.set_defaults(handler=cmd.keygen)
    return parser
