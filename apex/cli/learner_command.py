"""`apex learner`: one learner, one rank of a data-parallel group, or the whole group on this
host (--ranks N). Heavy imports inside, so that `apex --help` stays fast."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from apex.cli.commands import group_rank, load_config, resume_checkpoint, run_logdir, stop_conditions
from apex.config import port_problem
from apex.errors import ApexError

if TYPE_CHECKING:  # (imported where used: `apex --help` stays fast)
    from apex.config import Config, StopConditions
    from apex.training.distributed import LearnerGroup
    from apex.training.rank import Rank


def learner(args: argparse.Namespace) -> int:
    """`apex learner`: a whole group (--ranks N), one rank of one, or a learner alone."""
    from apex.checkpoint import has_checkpoint
    from apex.envs.policy_map import check_env

    rank = group_rank(args)
    if args.ranks is not None:
        if args.ranks < 1:
            raise ApexError(f"--ranks must be >= 1, got {args.ranks}")
        if rank is not None:
            raise ApexError("--ranks starts the whole group: give it without --rank/--world-size/--master")
    if args.ranks is not None and args.ranks > 1:
        from apex.run.launch import run_ranks

        config = load_config(args, resume_checkpoint(args))
        check_env(config)
        port = args.port if args.port is not None else config.transport.port
        return run_ranks(args.argv, args.ranks, port)
    if rank is not None and rank.world_size == 1:
        rank = None

    if args.auto_resume:
        if args.resume or not args.logdir:
            raise ApexError("--auto-resume takes the run directory from --logdir DIR, without --resume")
        if has_checkpoint(Path(args.logdir)):
            args.resume = args.logdir
    resume = resume_checkpoint(args)
    config = load_config(args, resume)
    stop = stop_conditions(args)
    logdir = Path(args.logdir) if args.logdir else resume.logdir if resume else run_logdir(args, config)
    check_env(config)  # said before torch is imported (2 s on 2 cores)
    from apex.learner.process import LearnerProcess

    group = _join_group(args, config, rank, logdir) if rank is not None else None
    resume_command = args.resume_command or _resume_command(args, logdir, rank, stop)
    process = LearnerProcess(
        config, logdir, args.bind_host, args.port, stop, resume=resume, resume_command=resume_command, group=group
    )
    _exit_now(process.run())


def _resume_command(args: argparse.Namespace, logdir: Path, rank: Rank | None, stop: StopConditions) -> str:
    """The closing line's "resume with": this command's own addresses, keys and stops."""
    from apex.run.launch import stop_args

    group_args = []
    if rank is not None:  # the whole group resumes: --ranks N on one host, each rank's own flags on several
        group_args = (
            ["--ranks", str(rank.world_size)]
            if rank.master.startswith("127.0.0.1:")
            else ["--rank", str(rank.rank), "--world-size", str(rank.world_size), "--master", rank.master]
        )
    return shlex.join(
        [
            "apex",
            "learner",
            "--resume",
            str(logdir),
            *group_args,
            *(["--port", str(args.port)] if args.port is not None else []),
            *(["--bind-host", args.bind_host] if args.bind_host != "127.0.0.1" else []),
            *(["--curve-dir", args.curve_dir] if args.curve_dir else []),
            *stop_args(stop),
        ]
    )


def _join_group(args: argparse.Namespace, config: Config, rank: Rank, logdir: Path) -> LearnerGroup:
    """This rank's place in a data-parallel learner group; a rank other than 0 runs as a
    follower here and exits."""
    from apex.learner.runtime import pick_device
    from apex.training.distributed import COLLECTIVE_TIMEOUT_S, LearnerGroup
    from apex.training.rendezvous import run_secret
    from apex.transport import is_loopback
    from apex.transport.keys import load_keypair

    base = args.port if args.port is not None else config.transport.port
    if (problem := port_problem(base + 2 + rank.world_size)) is not None:
        raise ApexError(f"--port {base} leaves no room for {rank.world_size} ranks: {problem}")
    # Where actors reach this rank's trajectories: None is the host they reached rank 0 at.
    host = None if is_loopback(args.bind_host) or args.bind_host in ("0.0.0.0", "::", "*") else args.bind_host
    curve_dir = config.transport.curve_dir
    learner_secret = load_keypair(Path(curve_dir) / "learner.key_secret")[1] if curve_dir else None
    group = LearnerGroup(
        rank,
        pick_device(config.learner.device),
        (host, base + 1 if rank.is_leader else base + 2 + rank.rank),
        config.digest(),
        partial(run_secret, learner_secret, logdir, rank.is_leader, COLLECTIVE_TIMEOUT_S),
    )
    if not rank.is_leader:
        from apex.learner.follower import FollowerProcess

        _exit_now(FollowerProcess(config, logdir, args.bind_host, args.port, group).run())
    return group


def _exit_now(code: int) -> NoReturn:
    # Everything is written and closed by now; tearing down torch's interpreter state takes
    # ~0.8 s more on two cores, time a container's stop or a supervisor waits for nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
