"""Helpers for tests that open real sockets."""

from __future__ import annotations

import random
import socket


def free_base_port(count: int = 3) -> int:
    """A port P such that P .. P+count-1 are all free on loopback right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free block of ports found")
