"""The `apex` subcommands around runs: bench, eval, plot, config and keygen."""

from __future__ import annotations

import argparse

from apex.cli import commands as cmd
from apex.cli.flags import Subcommands, add_allow_import
from apex.core import ALGOS


def add_bench(commands: Subcommands) -> None:
    from apex.bench import BENCHMARKS  # (the names only: each benchmark's module is imported when it runs)

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
    _add_e2e_options(bench)
    _add_soak_options(bench)
    _add_learn_options(bench)
    bench.set_defaults(handler=cmd.bench)


def _add_e2e_options(bench: argparse.ArgumentParser) -> None:
    e2e = bench.add_argument_group("e2e options")
    e2e.add_argument("--algo", choices=list(ALGOS), default="apex_dqn", help="algorithm (default: apex_dqn)")
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


def _add_soak_options(bench: argparse.ArgumentParser) -> None:
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


def _add_learn_options(bench: argparse.ArgumentParser) -> None:
    learn = bench.add_argument_group("learn options (not part of all; --plot draws the curves)")
    learn.add_argument(
        "--tasks",
        metavar="T,T,...",
        help="tasks to learn: cartpole, acrobot, mountaincar, lunarlander (Box2D extra), minatar_breakout, "
        "minatar_spaceinvaders, minatar_asterix, minatar_freeway, minatar_seaquest (minatar extra), "
        "with continuous actions (IMPALA, APPO, Ape-X DDPG) reach (a test env of apex's), pendulum, "
        "mountaincarcontinuous, lunarlandercontinuous (Box2D), bipedalwalker (Box2D), and "
        "multi-agent tictactoe (self-play), simple_spread (multiagent extra) (default: all)",
    )
    learn.add_argument("--algos", metavar="A,A,...", help=f"{', '.join(ALGOS)} (default: every one)")
    learn.add_argument(
        "--seeds",
        type=int,
        default=3,
        metavar="N",
        help="seeds per task and algorithm (default: 3); serve: runs per task, algorithm and transport "
        "of its learning comparison (0: throughput only)",
    )
    learn.add_argument(
        "--serve-tasks",
        metavar="T,T,...",
        help="serve: the tasks learned through apex serve: cartpole (Ape-X DQN, IMPALA), recall (a recurrent "
        "IMPALA; from a clone: tests/envs.py), pendulum (APPO, Ape-X DDPG) (default: all)",
    )
    learn.add_argument(
        "--idle-connections",
        type=int,
        default=20_000,
        metavar="N",
        help="serve: idle TCP connections held to each frontend while the batched clients are measured "
        "again (default: 20000; 0: no flood)",
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


def add_eval(commands: Subcommands) -> None:
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
    evaluate.add_argument(
        "--policy",
        metavar="NAME",
        help="a multi-agent checkpoint's policy whose agents' returns to report (default: the team's, "
        "the mean over an episode's agents); every agent acts with its own policy",
    )
    add_allow_import(evaluate, "the checkpoint's")
    evaluate.set_defaults(handler=cmd.evaluate)


def add_plot(commands: Subcommands) -> None:
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


def add_config(commands: Subcommands) -> None:
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


def add_keygen(commands: Subcommands) -> None:
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
