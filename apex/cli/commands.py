"""The `apex` subcommands: each checks its flags, then calls into the modules that do the work
(heavy imports inside, so that `apex --help` stays fast)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from apex.cli.environment import ENV
from apex.config import DEFAULT_PORT
from apex.errors import ApexError

if TYPE_CHECKING:  # (imported where used: `apex --help` stays fast)
    from apex.checkpoint import Checkpoint
    from apex.config import Config, StopConditions, TransportConfig
    from apex.training.rank import Rank


def shorthand_overrides(args: argparse.Namespace) -> list[str]:
    """The --set equivalents of --env, --algo, --seed, --num-envs and --track (put before the
    --set flags, which win where both are given)."""
    overrides = []
    shorthands = (("env", "env.id"), ("algo", "algo"), ("seed", "seed"), ("num_envs", "actor.num_envs"))
    for flag, key in (*shorthands, ("track", "logging.track")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")  # JSON is YAML: an id is read back as the string it is
    return overrides


def bench(args: argparse.Namespace) -> int:
    from apex import bench

    if args.seconds is not None and args.seconds <= 0:
        raise ApexError(f"--seconds must be positive, got {args.seconds}")
    try:
        actors = tuple(int(n) for n in args.actors.split(",")) if args.actors else None
    except ValueError:
        raise ApexError(f"--actors takes a comma-separated list of counts, e.g. 1,2,4; got {args.actors!r}") from None
    if actors is not None and (not actors or min(actors) < 1):
        raise ApexError(f"--actors counts must be >= 1, got {args.actors!r}")
    try:
        ranks = tuple(int(n) for n in args.ranks.split(",")) if args.ranks else (1,)
    except ValueError:
        raise ApexError(f"--ranks takes a comma-separated list of group sizes, e.g. 1,2; got {args.ranks!r}") from None
    if not ranks or min(ranks) < 1:
        raise ApexError(f"--ranks sizes must be >= 1, got {args.ranks!r}")
    names = args.names or ["all"]
    if "soak" in names and actors is not None and len(actors) != 1:
        raise ApexError(f"bench soak takes one actor count, e.g. --actors 3; got {args.actors!r}")
    if args.churn_seconds <= 0 or args.checkpoint_seconds <= 0:
        raise ApexError("--churn-seconds and --checkpoint-seconds must be positive")
    e2e_options = {"algo": args.algo, "env": args.env, "plot": args.plot, **({"actors": actors} if actors else {})}
    soak_options = {
        "churn_s": args.churn_seconds,
        "checkpoint_s": args.checkpoint_seconds,
        "plot": args.plot,
        "overrides": tuple(args.overrides),
        "logdir": args.logdir,
        **({"actors": actors[0]} if actors else {}),
    }
    serve_options = {"seeds": args.seeds, "tasks": args.serve_tasks, "idle_connections": args.idle_connections}
    learn_options = {
        "tasks": args.tasks,
        "algos": args.algos,
        "seeds": args.seeds,
        "minutes": args.minutes,
        "plot": args.plot,
        "runs_dir": args.runs_dir,
    }
    bench.run(
        names,
        json_path=args.json,
        seconds=args.seconds,
        e2e_options=e2e_options,
        soak_options=soak_options,
        learn_options=learn_options,
        serve_options=serve_options,
        learner_options={"ranks": ranks},
    )
    return 0


def load_config(args: argparse.Namespace, resume: Checkpoint | None = None, shorthands: bool = True) -> Config:
    """The config of --config (or the embedded default) with --set; when resuming without
    --config, the checkpoint's with --set, importing only what --allow-import allows (the
    checkpoint may have come from elsewhere: apex.config.trust). An actor's --num-envs is its own, not a shorthand
    (``shorthands=False``)."""
    from apex import config

    overrides = [*(shorthand_overrides(args) if shorthands else []), *args.overrides]
    if args.curve_dir:
        overrides.append(f"transport.curve_dir={json.dumps(args.curve_dir)}")
    if resume is not None and not args.config:
        from apex.config.trust import allowed_imports, from_elsewhere

        return from_elsewhere(
            resume.config, allowed_imports(args.allow_imports), f"checkpoint {resume.state_path}", overrides
        )
    return config.load(args.config, overrides)


def resume_checkpoint(args: argparse.Namespace) -> Checkpoint | None:
    """The newest valid checkpoint of --resume DIR (None without --resume)."""
    from apex.checkpoint import find_latest

    return find_latest(Path(args.resume)) if args.resume else None


def stop_conditions(args: argparse.Namespace) -> StopConditions:
    from apex.config import StopConditions

    stop = StopConditions(args.stop_return, args.stop_seconds, args.stop_env_steps)
    stop.validate()
    return stop


def run_logdir(args: argparse.Namespace, config: Config) -> Path:
    from apex.run.launch import default_logdir

    return Path(args.logdir) if args.logdir else default_logdir(config)


def group_rank(args: argparse.Namespace) -> Rank | None:
    """This process's place in a learner group (--rank/--world-size/--master, or torchrun's
    variables), or None."""
    from apex.training.rank import Rank

    given = [args.rank is not None, args.world_size is not None, args.master is not None]
    if any(given) and not all(given):
        raise ApexError(
            "--rank, --world-size and --master go together (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if all(given):
        return Rank.checked(args.rank, args.world_size, args.master)
    return Rank.from_environment()


def learner_link(args: argparse.Namespace, who: str) -> tuple[str, int, TransportConfig, tuple[str, ...]]:
    """What `apex actor` and `apex serve` (an actor too) take to join a learner: its address
    (--learner HOST[:PORT]), --num-envs, transport options (only transport.* may be set), and
    what the learner's config may import here (--allow-import, the local env.allow_imports,
    APEX_ALLOW_IMPORTS). Returns (host, port, TransportConfig, allowed modules)."""
    from apex.config.trust import allowed_imports

    if not args.learner:
        raise ApexError(f"--learner HOST[:PORT] is required (or set {ENV['learner']})")
    host, _, port_text = args.learner.rpartition(":") if ":" in args.learner else (args.learner, "", "")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ApexError(f"--learner {args.learner!r}: port must be a number, e.g. 10.0.0.5:{DEFAULT_PORT}") from None
    if args.num_envs is not None and args.num_envs < 1:
        raise ApexError(f"--num-envs must be >= 1, got {args.num_envs}")
    settable = ("transport.", "serve.") if who == "apex serve" else ("transport.",)
    for override in args.overrides:
        if not override.startswith(settable):
            raise ApexError(
                f"--set {override}: {who} takes only {' and '.join(s + '*' for s in settable)} settings; "
                "the environment, model and "
                "algorithm come from the learner (set them there, e.g. apex learner --set ...)"
            )
    local = load_config(args, shorthands=False)
    return (
        host,
        port,
        local.transport,
        allowed_imports(args.allow_imports, local.env, local.multi_agent.mapping_function),
    )


def actor(args: argparse.Namespace) -> int:
    from apex.actor.process import run_actor

    host, port, options, allowed = learner_link(args, "an actor")
    return run_actor(
        host, port, actor_index=args.actor_index, num_envs=args.num_envs, options=options, allow_imports=allowed
    )


def parse_address(flag: str, text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    host, _, port_text = text.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise ApexError(f"{flag} {text!r}: give HOST:PORT, e.g. 0.0.0.0:8000") from None
    if not 0 <= port <= 65535:
        raise ApexError(f"{flag} {text!r}: the port must be in 0..65535")
    return host or default_host, port


def serve(args: argparse.Namespace) -> int:
    from apex.serve.server import ServeOptions, read_token, run_serve

    learner_host, port, transport, allowed = learner_link(args, "apex serve")
    http = None if args.http in ("off", "none", "") else parse_address("--http", args.http)
    zmq_address = None if args.zmq is None else parse_address("--zmq", args.zmq if ":" in args.zmq else f":{args.zmq}")
    if http is None and zmq_address is None:
        raise ApexError("--http off and no --zmq: give clients at least one address")
    if args.max_episodes < 1:
        raise ApexError(f"--max-episodes must be >= 1, got {args.max_episodes}")
    if not args.episode_timeout > 0:
        raise ApexError(f"--episode-timeout must be positive, got {args.episode_timeout}")
    options = ServeOptions(
        http=http,
        zmq=zmq_address,
        token=read_token(args.token_file),
        max_episodes=args.max_episodes,
        episode_timeout_s=args.episode_timeout,
        curve_dir=transport.curve_dir,
        allow_imports=allowed,
        limits=load_config(args, shorthands=False).serve,
    )
    return run_serve(
        learner_host, port, options, actor_index=args.actor_index, num_envs=args.num_envs, transport=transport
    )


def run(args: argparse.Namespace) -> int:
    from apex.run import launch

    if args.actors < 1:
        raise ApexError(f"--actors must be >= 1, got {args.actors}")
    if args.learner_restarts < 0:
        raise ApexError(f"--learner-restarts must be >= 0, got {args.learner_restarts}")
    if args.ranks < 1:
        raise ApexError(f"--ranks must be >= 1, got {args.ranks}")
    if args.ranks > args.actors:
        raise ApexError(
            f"--ranks {args.ranks} needs at least as many actors (each rank trains on its actors' batches): "
            f"give --actors {args.ranks} or more"
        )
    resume = resume_checkpoint(args)
    config = load_config(args, resume)
    stop = stop_conditions(args)
    if resume is not None and args.logdir and Path(args.logdir).resolve() != resume.logdir.resolve():
        raise ApexError(
            f"--logdir {args.logdir} differs from --resume {args.resume}: a resumed run goes on in its own directory"
        )
    logdir = resume.logdir if resume else run_logdir(args, config)
    port = args.port if args.port is not None else config.transport.port
    # A wrong env id fails here, in a second, not in every child process after its imports.
    from apex.envs.policy_map import check_env

    check_env(config)
    if args.ray is not None:
        if args.ranks > 1:
            raise ApexError("--ray runs one learner: give --ranks 1 (a learner group on Ray is not supported)")
        if not args.ray_actor_cpus > 0:
            raise ApexError(f"--ray-actor-cpus must be positive, got {args.ray_actor_cpus}")
        from apex.run.ray_launch import run_on_ray

        return run_on_ray(
            args.ray,
            config,
            args.actors,
            logdir.resolve(),
            stop,
            port,
            actor_cpus=args.ray_actor_cpus,
            learner_restarts=args.learner_restarts,
        )
    return launch.run(
        config,
        args.actors,
        logdir,
        stop,
        port,
        resume=resume is not None,
        learner_restarts=args.learner_restarts,
        ranks=args.ranks,
    )


def evaluate(args: argparse.Namespace) -> int:
    import json

    from apex.config.trust import allowed_imports
    from apex.run.evaluation import evaluate

    result = evaluate(
        args.checkpoint,
        args.episodes,
        args.epsilon,
        args.seed,
        args.video,
        which=args.which,
        allow_imports=allowed_imports(args.allow_imports),
        policy=args.policy,
    )
    print(f"{result['checkpoint']} ({result['which']})")
    print(
        f"{result['env']} ({result['algo']}, {result['updates']} updates): return "
        f"{result['return_mean']:.1f} +- {result['return_std']:.1f} over {result['episodes']} episodes "
        f"(epsilon {result['epsilon']}, mean length {result['length_mean']:.0f})"
    )
    if "policies" in result:  # a multi-agent checkpoint's
        of = f"policy {result['policy']}'s agents" if result["policy"] else "the team (the mean over its agents)"
        print(f"returns above are {of}; by policy: " + ", ".join(f"{k} {v:.2f}" for k, v in result["policies"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def plot(args: argparse.Namespace) -> int:
    from apex.run.plot import plot

    print(f"wrote {plot(args.logdirs, args.output, smooth=args.smooth)}")
    return 0


def config_command(args: argparse.Namespace) -> int:
    from apex import config

    if args.action == "list":
        for name, preset in config.presets().items():
            print(f"{name:20s} {config.describe_preset(preset)}")
        return 0
    loaded = config.load(args.name, args.overrides)
    if args.name is not None:
        tuned = config.tuned_settings(loaded)
        print(
            f"# {args.name} sets these apart from what --algo {loaded.algo} --env {loaded.env.id} alone gives:\n"
            + "".join(f"#   {key}: {value}\n" for key, value in tuned.items())
            if tuned
            else f"# {args.name}: what --algo {loaded.algo} --env {loaded.env.id} alone gives\n",
            end="",
        )
    print(config.annotated_yaml(loaded), end="")
    return 0


def keygen(args: argparse.Namespace) -> int:
    from apex.transport import generate_keys

    paths = generate_keys(args.dir)
    print(f"learner secret key (keep on the learner host): {paths['learner_secret']}")
    print(f"actor secret key (copy to every actor host):   {paths['actor_secret']}")
    print(f"learner public key (copy to every actor host): {paths['learner_public']}")
    print(f"authorised actor public keys:                  {paths['authorized']}/")
    print(f"apex serve's ZeroMQ secret key (its host):     {paths['serve_secret']}")
    print(f"its clients' secret key (copy to client hosts, with serve.key): {paths['client_secret']}")
    print(f"authorised client public keys:                 {paths['serve_clients']}/")
    return 0
