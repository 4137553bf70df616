"""The settings of what faces the network: the transport of both ends (ports, high-water
marks, heartbeats, CURVE, the limits on what a learner accepts) and `apex serve`'s own."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 5550


def port_problem(port: int) -> str | None:
    """Why ``port`` cannot be a learner's base port (it uses port+1 and port+2 too), or None."""
    if not 1 <= port <= 65533:
        return f"port must be in 1..65533 (the learner also uses port+1 and port+2), got {port}"
    return None


@dataclass(frozen=True)
class TransportConfig:
    """The transport settings of both ends (the learner's, and those an actor is started with)."""

    port: int = DEFAULT_PORT
    """Learner control port; trajectories use port+1 and weights port+2."""
    trajectory_hwm: int = 4
    """Batches an actor may queue before sending blocks (ZeroMQ high-water mark)."""
    trajectory_buffer_bytes: int = 32 * 1024
    """Kernel socket buffer of the trajectory stream on each side; small, so queued batches
    stay fresh (the high-water mark counts messages, and the kernel's own megabytes would hold
    hundreds of small batches that then reach a throttled learner seconds stale)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which a peer counts as gone."""
    curve_dir: str | None = None
    """Directory from ``apex keygen``: encrypt and authenticate every socket."""
    give_up_after_s: float = 600.0
    """Seconds an actor keeps reconnecting to a silent learner before it exits with an
    error (0: forever). Long enough for a learner to be restarted and load its replay."""
    max_abs_reward: float = 1e6
    """Largest reward magnitude the learner accepts in a batch (per step; an Ape-X n-step
    return may reach n times it); a batch with a larger one is rejected and counted."""
    max_abs_obs: float | None = None
    """Largest magnitude of an observation value that the learner accepts in a batch and
    apex serve from a client (a batch or request with a larger one is refused and counted).
    None: each value's own bound where the observation space gives a finite one, 1e6 where it
    does not (finite alone is no defence: 1e30 poisons the updates it is sampled into)."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest trajectory message the learner accepts (ZMQ_MAXMSGSIZE on its socket). An
    actor whose batches could be larger (too many environments for the frame size) is
    refused at its hello with a message naming this setting."""

    def problems(self) -> list[str]:
        checks = (
            (port_problem(self.port) is None, f"transport.{port_problem(self.port)}"),
            (self.trajectory_hwm >= 1, f"transport.trajectory_hwm must be >= 1, got {self.trajectory_hwm}"),
            (
                self.trajectory_buffer_bytes >= 4096,
                f"transport.trajectory_buffer_bytes must be >= 4096, got {self.trajectory_buffer_bytes}",
            ),
            (
                self.heartbeat_interval_s > 0,
                f"transport.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}",
            ),
            (
                self.heartbeat_timeout_s > self.heartbeat_interval_s,
                f"transport.heartbeat_timeout_s must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.heartbeat_timeout_s}",
            ),
            (
                self.give_up_after_s == 0 or self.give_up_after_s > self.heartbeat_timeout_s,
                "transport.give_up_after_s must be 0 (never) or exceed heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s}), got {self.give_up_after_s}",
            ),
            (
                0 < self.max_abs_reward < float("inf"),
                f"transport.max_abs_reward must be a positive finite number, got {self.max_abs_reward}",
            ),
            (
                self.max_abs_obs is None or 0 < self.max_abs_obs < float("inf"),
                "transport.max_abs_obs must be a positive finite number or null (the space's bounds), "
                f"got {self.max_abs_obs}",
            ),
            (
                self.max_message_bytes >= 1 << 20,
                f"transport.max_message_bytes must be >= 1048576 (1 MiB), got {self.max_message_bytes}",
            ),
        )
        return [message for ok, message in checks if not ok]


@dataclass(frozen=True)
class ServeConfig:
    """`apex serve`'s own limits (its --config and --set serve.*; a learner's are unused)."""

    max_connections: int = 1024
    """HTTP connections open at once; one more closes the one idle longest (no request being
    handled; counted as idle_closed), or is answered 503 and closed if every one is busy
    (counted as connections)."""
    idle_timeout_s: float = 30.0
    """An HTTP connection that starts no request for this long, or sends a body more slowly
    than within it, is closed (counted)."""
    handshake_timeout_s: float = 5.0
    """A ZeroMQ connection that has not finished ZeroMQ's handshake (and CURVE's) within this
    is closed: each one held costs an open file, and the ZeroMQ frontend has no cap on
    connections of its own."""
    max_episodes_per_client: int = 256
    """Episodes one client may hold open at once (over both frontends; a client is its
    address: behind a proxy, the proxy's); one more is answered 429 (counted), so that one
    client cannot take every --max-episodes slot."""
    max_body_bytes_in_flight: int = 8 * 1024 * 1024
    """Request bytes (by Content-Length) that the HTTP connections may hold at once, all
    together; a request past it is answered 503 (counted). At least one body of the largest
    size the environment's observations need is always let in."""

    def problems(self) -> list[str]:
        checks = (
            (self.max_connections >= 1, f"serve.max_connections must be >= 1, got {self.max_connections}"),
            (0 < self.idle_timeout_s <= 3600, f"serve.idle_timeout_s must be in (0, 3600], got {self.idle_timeout_s}"),
            (
                0 < self.handshake_timeout_s <= 3600,
                f"serve.handshake_timeout_s must be in (0, 3600], got {self.handshake_timeout_s}",
            ),
            (
                self.max_episodes_per_client >= 1,
                f"serve.max_episodes_per_client must be >= 1, got {self.max_episodes_per_client}",
            ),
            (
                self.max_body_bytes_in_flight >= 1 << 16,
                f"serve.max_body_bytes_in_flight must be >= 65536 (64 KiB), got {self.max_body_bytes_in_flight}",
            ),
        )
        return [message for ok, message in checks if not ok]
