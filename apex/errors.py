"""The error types apex raises for problems a user can fix.

Each message names the value, the rule it broke and what to do instead, e.g.
``replay.capacity must be a positive integer, got -5``.
"""


class ApexError(Exception):
    """Base class for every error apex raises on purpose."""


class ConfigError(ApexError, ValueError):
    """A configuration file or override is invalid."""


class ProtocolError(ApexError, ValueError):
    """A message on the wire is malformed, too large or of the wrong version."""
