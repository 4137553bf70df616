"""What both ends share: ports, loopback, failures (the settings are the config's ``TransportConfig``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from apex.config import DEFAULT_PORT, TransportConfig, port_problem
from apex.errors import ApexError

__all__ = ["DEFAULT_PORT", "MAX_HOST_CHARS", "Ports", "TransportConfig", "is_loopback"]
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
        if (problem := port_problem(port)) is not None:
            raise ApexError(problem)
        return cls(port, port + 1, port + 2)


class LearnerGone(ApexError):
    """No learner answered for ``give_up_after_s``: it stopped for good, or never came."""


class HandshakeRejected(ApexError):
    """The learner refused this actor; the message gives its reason."""


class Rejected(Exception):
    """Raised by a learner's welcome callback to turn an actor away with a reason."""


class Stopped(ApexError):
    """The actor process was told to stop (a signal) while waiting for the learner."""
