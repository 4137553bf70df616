"""The `apex` command line: thin argument parsing that calls into the modules."""

from __future__ import annotations

import argparse
import sys

from apex import __version__
from apex.errors import ApexError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        help=f"benchmarks to run: {', '.join(BENCHMARKS)} or all (default: all)",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    bench.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="time spent on each measured operation (default: 1.0)",
    )
    bench.set_defaults(handler=_bench)

    keygen = commands.add_parser(
        "keygen",
        help="create CURVE key pairs for the learner and the actors",
        description=(
            "Create CURVE key pairs in DIR: learner.key(_secret), actor.key(_secret), and "
            "authorized/actor.key. The learner (transport.curve_dir=DIR) accepts only the "
            "public keys in DIR/authorized/. Copy learner.key and actor.key_secret to actor hosts."
        ),
    )
    keygen.add_argument("dir", metavar="DIR", help="directory to create the keys in (must not hold keys yet)")
    keygen.set_defaults(handler=_keygen)
    return parser


def _bench(args: argparse.Namespace) -> int:
    from apex import bench

    if args.seconds <= 0:
        raise ApexError(f"--seconds must be positive, got {args.seconds}")
    bench.run(args.names or ["all"], json_path=args.json, seconds=args.seconds)
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from apex.transport import generate_keys

    paths = generate_keys(args.dir)
    print(f"learner secret key (keep on the learner host): {paths['learner_secret']}")
    print(f"actor secret key (copy to every actor host):   {paths['actor_secret']}")
    print(f"learner public key (copy to every actor host): {paths['learner_public']}")
    print(f"authorised actor public keys:                  {paths['authorized']}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ApexError as e:
        print(f"apex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
