"""The actor process: handshake, then the algorithm's actor core in a loop that takes the
newest weights, sends batches and keeps the connection alive, until the learner says stop.

The cores (``apex.algos.<algo>.actor``) step K environments with one batched forward pass
and know nothing of sockets. SIGTERM and SIGINT are honoured within a second in every state:
waiting for the learner, stepping, or waiting to send.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from apex import algos
from apex.config import MAX_ENVS_PER_ACTOR, Config
from apex.config.trust import from_elsewhere
from apex.core import ActorCore, ActorSide, EpisodeRecord
from apex.envs.multi_agent import is_multi_agent
from apex.errors import ProtocolError
from apex.multiagent.actor import MultiAgentActor
from apex.system.logs import RateLimitedLog
from apex.system.signals import StopSignals
from apex.transport import ActorConnection, HandshakeRejected, Stopped, TransportConfig

log = logging.getLogger(__name__)

TICK_S = 0.02  # how often the actor loop services the connection (heartbeats, weights, stops)


def run_actor(
    host: str,
    port: int,
    *,
    actor_index: int | None = None,
    num_envs: int | None = None,
    options: TransportConfig = TransportConfig(),
    allow_imports: tuple[str, ...] = (),
) -> int:
    """The actor process: connect, act, send, until the learner says stop or a signal
    arrives. Returns 0 (130 after SIGINT). The learner's config may import only the modules
    of ``allow_imports`` (apex.config.trust): ConfigError otherwise, before anything is made."""
    # gymnasium first, under the default signal handlers (a signal ends the process at
    # once): after the welcome the actor has only a heartbeat timeout to build its
    # environments and say it is alive. torch is imported only for image observations
    # (apex.nets.numpy_nets), once the welcome has said what they are.
    import apex.envs.make  # noqa: F401

    with StopSignals() as signals:
        client = ActorConnection(
            host,
            port,
            actor_index=actor_index,
            num_envs=num_envs or 0,
            options=options,
            should_stop=lambda: signals.received,
        )
        try:
            try:
                _act(client, signals, f"the welcome of the learner at {host}:{port}", allow_imports)
            except Stopped:
                pass
            except HandshakeRejected:
                if client.stop_reason is None:
                    raise
                # Said hello again just as the learner was stopping for good: that is a stop too.
            log.info("actor %s stopping: %s", client.actor_index, client.stop_reason or signals.reason())
            return signals.exit_code() if client.stop_reason is None else 0
        finally:
            client.close()


def welcome_setup(setup: dict[str, Any], allow_imports: tuple[str, ...], source: str) -> tuple[Config, ActorSide]:
    """The run's config and the algorithm's actor side from a welcome's setup, checked as data
    from elsewhere (a welcome may be forged): the config imports only what this side allows
    (ConfigError), sizes and the algorithm's part are in range (ProtocolError, one line)."""
    for key, kind in (("config", dict), ("num_envs", int), ("seed", int)):
        if type(setup.get(key)) is not kind:
            raise ProtocolError(
                f"{source} is malformed: setup.{key} must be a {kind.__name__}, got {type(setup.get(key)).__name__}"
            )
    if not 1 <= setup["num_envs"] <= MAX_ENVS_PER_ACTOR:
        raise ProtocolError(
            f"{source} is malformed: setup.num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {setup['num_envs']}"
        )
    if not 0 <= setup["seed"] < 2**63:
        raise ProtocolError(f"{source} is malformed: setup.seed must be in 0..2**63-1, got {setup['seed']}")
    config = from_elsewhere(setup["config"], allow_imports, source)
    side = algos.get(config.algo).actor()
    # A multi-agent setup has a part a policy, which MultiAgentActor checks.
    if not is_multi_agent(config.env) and (problem := side.setup_problem(setup)) is not None:
        raise ProtocolError(f"{source} is malformed: {problem}")
    return config, side


def _act(client: ActorConnection, signals: StopSignals, source: str, allow_imports: tuple[str, ...]) -> None:
    """Handshake, then step the algorithm's actor core and send its batches until a stop."""
    setup = client.handshake().fields["setup"]
    config, side = welcome_setup(setup, allow_imports, source)
    # Heartbeats go on while the environments are made (16 Atari ones take ~5 s, the
    # learner's heartbeat timeout): otherwise it drops the actor and it must join again.
    core: ActorCore = (
        MultiAgentActor(config, setup, setup["seed"], tick=client.tick)
        if is_multi_agent(config.env)
        else side.core(config, setup, setup["seed"], tick=client.tick)
    )
    try:
        log.info("actor %d: %d envs of %s (%s)", client.actor_index, core.num_envs, config.env.id, config.algo)
        bad_weights = RateLimitedLog(log, interval_s=10.0)
        episodes: list[EpisodeRecord] = []
        last_tick = 0.0
        sent = False
        while client.stop_reason is None and not signals.received:
            now = time.monotonic()
            if now - last_tick > TICK_S:
                client.tick()
                last_tick = now
            # Newest weights every few steps, and after every send: a send may have waited
            # for the learner while it trained on.
            if sent or core.steps % config.algo_config.weights_update_steps == 0:
                if (weights := client.take_weights()) is not None:
                    try:
                        core.set_weights(weights)
                    except ProtocolError as e:  # it acts on with the weights it has
                        bad_weights.warning("actor %d: weights refused: %s", client.actor_index, e)
                sent = False
            batch, finished = core.act()
            episodes += finished
            if batch is not None:
                # Env steps are not reported: the learner counts them from the batch itself.
                if not client.send_batch(batch, weights_version=core.weights_version, info=core.batch_info(episodes)):
                    break  # a stop arrived while waiting to send
                episodes, sent = [], True
    finally:
        core.close()
