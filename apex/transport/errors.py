"""The transport's failures an actor or a learner reports: a learner gone for good, a refused
hello, a stop while waiting."""

from __future__ import annotations

from apex.errors import ApexError


class LearnerGone(ApexError):
    """No learner answered for ``give_up_after_s``: it stopped for good, or never came."""


class HandshakeRejected(ApexError):
    """The learner refused this actor; the message gives its reason."""


class Rejected(Exception):
    """Raised by a learner's welcome callback to turn an actor away with a reason."""


class Stopped(ApexError):
    """The actor process was told to stop (a signal) while waiting for the learner."""
