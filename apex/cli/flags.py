"""The `apex` parser class and the flags several subcommands share (config, shorthands, stop
conditions, resume, trust, log directory), each with its environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from apex.cli.environment import ENV
from apex.config import ALGOS

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


def env_default(name: str, cast: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(ENV[name])
    if value in (None, ""):
        return None
    try:
        return cast(value)
    except ValueError:
        raise SystemExit(
            f"apex: error: environment variable {ENV[name]}={value!r} is not a valid {cast.__name__}"
        ) from None


def add_config_flags(p: argparse.ArgumentParser, actor: bool = False) -> None:
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
        "--config", default=env_default("config"), metavar="FILE|NAME", help=f"{config_help} (env {ENV['config']})"
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    p.add_argument(
        "--curve-dir",
        default=env_default("curve_dir"),
        metavar="DIR",
        help=f"CURVE keys from `apex keygen` (same as --set transport.curve_dir=DIR; env {ENV['curve_dir']})",
    )


def add_shorthands(p: argparse.ArgumentParser, num_envs: bool = False) -> None:
    group = p.add_argument_group("shorthands for --set")
    group.add_argument("--env", metavar="ID", help="environment: a Gymnasium id (--set env.id=ID)")
    group.add_argument("--algo", choices=ALGOS, help="algorithm (--set algo=ALGO)")
    group.add_argument("--seed", type=int, metavar="N", help="seed of the run (--set seed=N)")
    group.add_argument(
        "--track",
        action="append",
        choices=("wandb", "mlflow"),
        help="an experiment tracker that gets the config, the metrics and the summary; repeatable "
        "(--set logging.track=[...]; W&B offline unless logged in, MLflow to MLFLOW_TRACKING_URI)",
    )
    if num_envs:
        group.add_argument(
            "--num-envs",
            type=int,
            default=env_default("num_envs", int),
            metavar="K",
            help=f"environments per actor (--set actor.num_envs=K; env {ENV['num_envs']})",
        )


def add_stop_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stop-return", type=float, metavar="R", help="stop once return_mean_100 (100 evaluation episodes) reaches R"
    )
    p.add_argument("--stop-seconds", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--stop-env-steps", type=int, metavar="N", help="stop after N environment steps")


def add_resume(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        default=env_default("resume"),
        metavar="DIR",
        help="continue the run in DIR (a --logdir) from its newest valid checkpoint: networks, "
        "optimizer, counters, episode returns and replay; the config is the checkpoint's "
        f"(plus --set) unless --config is given; logs go on in DIR (env {ENV['resume']})",
    )


def add_allow_import(p: argparse.ArgumentParser, whose: str) -> None:
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


def add_logdir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logdir",
        default=env_default("logdir"),
        metavar="DIR",
        help=f"where metrics.jsonl, summary.json and checkpoints/ go (default: runs/<time>-<env>; env {ENV['logdir']})",
    )


# What build_parser adds each subcommand to (argparse names the type only privately).
Subcommands: TypeAlias = "argparse._SubParsersAction[Parser]"
