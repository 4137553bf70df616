"""The actor process: handshake, then the algorithm's actor core in a loop that takes the
newest weights, sends batches and keeps the connection alive, until the learner says stop.

The cores (``apex.algos.<algo>.Actor``) step K environments with one batched forward pass
and know nothing of sockets.
"""

from __future__ import annotations

import logging
import signal
import time

from apex import algos
from apex import config as config_module
from apex.transport import HandshakeRejected, LearnerClient, TransportOptions

log = logging.getLogger(__name__)


def run_actor(
    host: str,
    port: int,
    *,
    actor_index: int | None = None,
    num_envs: int | None = None,
    options: TransportOptions = TransportOptions(),
) -> int:
    """The actor process: connect, act, send, until the learner says stop. Returns 0."""
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    client = LearnerClient(host, port, actor_index=actor_index, num_envs=num_envs or 0, options=options)
    try:
        try:
            _act(client, stopping)
        except HandshakeRejected:
            if client.stop_reason is None:
                raise
            # Said hello again just as the learner was stopping for good: that is a stop too.
        log.info("actor %s stopping: %s", client.actor_index, client.stop_reason or f"signal {stopping['signal']}")
        return 0
    finally:
        client.close()


def _act(client: LearnerClient, stopping: dict) -> None:
    """Handshake, then step the algorithm's actor core and send its batches until a stop."""
    spec = client.handshake().fields["spec"]
    config = config_module.from_dict(spec["config"])
    core = algos.get(config.algo).Actor(config, spec, spec["seed"])
    try:
        log.info("actor %d: %d envs of %s (%s)", client.actor_index, core.num_envs, config.env.id, config.algo)
        episodes: list[list] = []
        env_steps = 0
        last_tick = 0.0
        sent = False
        while client.stop_reason is None and stopping["signal"] is None:
            now = time.monotonic()
            if now - last_tick > 0.02:
                client.tick()
                last_tick = now
            # Newest weights every few steps, and after every send: a send may have waited
            # for the learner while it trained on.
            if sent or core.steps % config.actor.weights_update_steps == 0:
                if (weights := client.take_weights()) is not None:
                    core.set_weights(weights)
                sent = False
            batch, finished = core.act()
            episodes += finished
            env_steps += core.num_envs
            if batch is not None:
                info = {"episodes": episodes, "env_steps": env_steps}
                if not client.send_batch(batch, weights_version=core.weights_version, info=info):
                    break  # a stop arrived while waiting to send
                episodes, env_steps, sent = [], 0, True
    finally:
        core.close()
