"""The `apex` command line: thin argument parsing (``parser``) that calls into the modules
(``commands``)."""

from __future__ import annotations

import logging
import os
import sys

from apex.cli.commands import load_config
from apex.cli.environment import ENV
from apex.cli.parser import build_parser
from apex.errors import ApexError
from apex.system.parent import watch_parent

__all__ = ["ENV", "build_parser", "load_config", "main"]


def main(argv: list[str] | None = None) -> int:
    # Every apex process is one worker of a machine shared with others (actors, servers, the
    # learner): NumPy's BLAS threads only contend. An actor's or `apex serve`'s forward pass
    # of a 128x128 MLP on 32 observations spun two OpenBLAS threads to 65% of two cores, and
    # `apex serve` went from 7k to 15k CartPole steps/s with one. Set before NumPy is imported
    # (here, it is not yet); children inherit it; a user's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what a command passes on to its children
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    watch_parent()  # started by `apex run`: ends with it
    try:
        code: int = args.handler(args)
        return code
    except ApexError as e:
        print(f"apex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
