"""A hostile peer's side of a real learner: quick transport options, and the honest batch
an actor of the learner's run would send."""

from __future__ import annotations

from typing import Any

import numpy as np

from apex import algos
from apex import config as config_module
from apex.transport import ActorConnection, TransportConfig

OPTIONS = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)


def multi_agent_batch(port: int) -> tuple[ActorConnection, Any, dict, dict]:
    """A peer with a live session on the multi-agent learner at ``port`` and the first batch
    its actor core made: (the peer, the core, the batch as NumPy arrays, its info)."""
    from apex.multiagent.actor import MultiAgentActor

    peer = ActorConnection("127.0.0.1", port, num_envs=2, options=OPTIONS)
    setup = peer.handshake(timeout_s=20).fields["setup"]
    core = MultiAgentActor(config_module.from_dict(setup["config"]), setup, setup["seed"], tick=peer.tick)
    batch = None
    while batch is None:
        peer.tick()
        batch, teams = core.act()
    return peer, core, {name: np.array(a) for name, a in batch.items()}, core.batch_info(teams)


def honest_batch(client: ActorConnection) -> dict:
    """The first batch an actor of this run would send (the run's own config and spec). The
    peer's session is kept alive meanwhile, as an actor's is: on a loaded machine making the
    environments took longer than the learner's heartbeat timeout, and the session was gone."""
    spec = client.welcome.fields["setup"]
    config = config_module.from_dict(spec["config"])
    core = algos.get(config.algo).actor().core(config, spec, spec["seed"], tick=client.tick)
    batch = None
    while batch is None:
        client.tick()
        batch, _ = core.act()
    core.close()
    return {name: np.array(a) for name, a in batch.items()}
