"""ZeroMQ transport between one learner and any number of actors.

The learner binds three sockets on consecutive ports; actors connect to them:

    port P     control       ROUTER <- DEALER   hello/welcome/reject, heartbeats, stop
    port P+1   trajectories  PULL   <- PUSH     batches; a high-water mark makes a slow
                                                learner push back on its actors
    port P+2   weights       ROUTER -> DEALER   newest weights only, to the actors that
                                                registered their session here (CONFLATE on
                                                the actor, a send queue of one per actor)

An actor says hello and gets a welcome with its setup (the run's config, its seed, the
algorithm's part), its actor index, a random session token and the learner's incarnation id
(or a reject with a reason), then the current weights at once over the control channel, then
newer ones as they are published. Every batch carries the session token and a sequence
number: the learner accepts batches only from a live session, in order, each once. Both
sides send heartbeats; an actor that stops hearing from the learner drops its control socket
and says hello again until a learner answers (the lazy-pirate pattern), so a restarted
learner gets its actors back by itself.

Optional CURVE (``apex keygen DIR``): every socket is encrypted and the learner accepts only
the actor public keys in ``DIR/authorized/``.

The learner's receiving side assumes an attacker: ZMQ_MAXMSGSIZE on every receiving socket,
at most ``MAX_CONTROL_PER_POLL`` control messages handled per loop iteration, hello rate
limits per connection and per peer address, bounded hello fields, an actor index that a
live actor keeps, and a weights socket that keeps state only for live sessions (PUB, and
XPUB even with manual subscriptions, keep every topic a subscriber sends: measured, 20 MiB
of random 1 KiB subscriptions grew the learner by 48 MB for good).
"""

from apex.config import DEFAULT_PORT, MAX_ENVS_PER_ACTOR, TransportConfig
from apex.transport.actor_side import ActorConnection
from apex.transport.errors import HandshakeRejected, LearnerGone, Rejected, Stopped
from apex.transport.keys import generate_keys, load_keypair, load_public
from apex.transport.learner_side import LearnerEndpoint
from apex.transport.ports import Ports, is_loopback
from apex.transport.receiver import TrajectoryReceiver
from apex.transport.sessions import Session

__all__ = [
    "DEFAULT_PORT",
    "MAX_ENVS_PER_ACTOR",
    "ActorConnection",
    "HandshakeRejected",
    "LearnerEndpoint",
    "LearnerGone",
    "Ports",
    "Rejected",
    "Session",
    "Stopped",
    "TrajectoryReceiver",
    "TransportConfig",
    "generate_keys",
    "is_loopback",
    "load_keypair",
    "load_public",
]
