"""What both ends share about addresses: the learner's three ports and whether a host is loopback
(the transport's settings are the config's ``TransportConfig``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from apex.config import port_problem
from apex.errors import ApexError

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
