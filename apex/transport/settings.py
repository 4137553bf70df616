"""Transport settings and errors shared by both ends: ports, options, loopback, failures."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from apex.errors import ApexError

DEFAULT_PORT = 5550
MAX_HOST_CHARS = 255  # an actor's host name in its hello


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address to bind or serve on) stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Ports:
    """The learner's ports: the one a user names and the two after it."""

    control: int
    trajectories: int
    weights: int

    @classmethod
    def from_base(cls, port: int) -> Ports:
        if not 1 <= port <= 65533:
            raise ApexError(f"port must be in 1..65533 (the learner also uses port+1 and port+2), got {port}")
        return cls(port, port + 1, port + 2)


@dataclass(frozen=True)
class TransportOptions:
    """Settings shared by both ends (the `transport` section of a config)."""

    trajectory_hwm: int = 4
    """Batches an actor may have queued before sending blocks (ZeroMQ high-water mark)."""
    trajectory_buffer_bytes: int = 32 * 1024
    """Kernel socket buffer of the trajectory stream on each side. The high-water mark
    counts messages, but without this cap the kernel's own buffers (megabytes) hold
    hundreds of small batches, which then reach a throttled learner seconds stale."""
    heartbeat_interval_s: float = 1.0
    """How often each side tells the other it is alive."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which the other side counts as gone."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest trajectory message the learner accepts (every array and frame of it too);
    also ZMQ_MAXMSGSIZE on its trajectory socket."""
    curve_dir: str | None = None
    """Directory made by `apex keygen`; enables CURVE encryption and authentication."""
    give_up_after_s: float = 600.0
    """An actor that has not heard from the learner for this long stops trying and exits
    (LearnerGone); 0: it keeps trying forever."""


def options_from_config(transport: Any) -> TransportOptions:
    """TransportOptions from a config's ``transport`` section."""
    return TransportOptions(
        trajectory_hwm=transport.trajectory_hwm,
        trajectory_buffer_bytes=transport.trajectory_buffer_bytes,
        heartbeat_interval_s=transport.heartbeat_interval_s,
        heartbeat_timeout_s=transport.heartbeat_timeout_s,
        curve_dir=transport.curve_dir,
        give_up_after_s=transport.give_up_after_s,
        max_message_bytes=transport.max_message_bytes,
    )


class LearnerGone(ApexError):
    """No learner answered for ``give_up_after_s``: it stopped for good, or never came."""


class HandshakeRejected(ApexError):
    """The learner refused this actor; the message gives its reason."""


class Rejected(Exception):
    """Raised by a learner's welcome callback to turn an actor away with a reason."""


class Stopped(ApexError):
    """The actor process was told to stop (a signal) while waiting for the learner."""
