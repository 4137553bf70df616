"""The flooders of `apex bench flood` (``apex.bench.flood``): one process that connects the
peers of a phase's attacks to a learner and sends as fast as non-blocking sends allow until
SIGTERM: `python -m apex.bench.flooder PORT KIND...`."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from typing import Any

from apex.wire import protocol

CONTROL_PEERS = 2
TRAJECTORY_PEERS = 10
HELLO, CONTROL_GARBAGE, TRAJECTORY_GARBAGE = "hello", "control_garbage", "trajectory_garbage"


def header_start(msg_type: str, noise: bytes) -> bytes:
    """A frame 0 whose prefix and header begin like apex's (a map's first two entries: this
    version, the type), then noise."""
    import struct

    import msgpack

    start: bytes = msgpack.packb({"v": protocol.PROTOCOL, "type": msg_type, "x": 0})[:-3]  # without the entry "x"
    return protocol.MAGIC + struct.pack("<I", len(start) + len(noise)) + start + noise


def _control_garbage(rng: random.Random) -> list[list[bytes]]:
    """Random frames, frames that start like a header, and hellos whose fields are out of
    range or of the wrong type: all under the control port's frame size limit."""
    import msgpack

    good = {"actor_index": None, "num_envs": 1, "host": "flood", "pid": 1}
    hello = protocol.encode("hello", good)

    def header(fields: dict[str, Any]) -> bytes:
        header = {"v": protocol.PROTOCOL, "type": "hello", **fields, "layout": msgpack.packb([])}
        return protocol.with_header(hello, header)[0]

    messages = []
    for _ in range(48):
        frames = [rng.randbytes(rng.randint(1, 2048)) for _ in range(rng.choice((1, 1, 2, 3)))]
        if rng.random() < 0.4:
            frames[0] = header_start("hello", frames[0])
        messages.append(frames)
    for bad in (
        {"actor_index": 2**40},
        {"actor_index": -1},
        {"num_envs": -1},
        {"num_envs": 10**6},
        {"host": "x" * 1000},
        {"pid": -5},
        {"pid": 2**40},
        {"actor_index": "zero"},
        {"num_envs": 1.5},
        {"host": b"\xff"},
        {"extra": 1},
    ):
        messages.append([header({**good, **bad})])
    return messages


def _trajectory_garbage(rng: random.Random) -> list[list[bytes]]:
    """Random frames, and well-formed CartPole-sized batches (64 transitions) of made-up sessions."""
    import numpy as np

    n = 64
    arrays: dict[str, np.ndarray] = {
        "frames": np.zeros((n + 6, 4), np.float32),
        "obs_frame": np.arange(n, dtype=np.int32),
        "next_obs_frame": np.arange(n, dtype=np.int32) + 3,
        "action": np.zeros(n, np.int64),
        "reward": np.ones(n, np.float32),
        "discount": np.full(n, 0.97, np.float32),
        "priority": np.ones(n, np.float32),
    }
    messages = []
    for _ in range(32):
        frames = [rng.randbytes(rng.randint(1, 4096)) for _ in range(rng.choice((1, 2, 3)))]
        if rng.random() < 0.4:
            frames[0] = header_start("batch", frames[0])
        messages.append(frames)
        fields = {
            "actor_index": 0,
            "weights_version": 0,
            "info": {},
            "session": rng.randbytes(16),
            "seq": rng.randrange(2**31),
        }
        messages.append([bytes(f) for f in protocol.encode("batch", fields, arrays)])
    return messages


def _flooder_main(argv: list[str]) -> int:
    """Floods the learner at port ``argv[0]`` with the kinds that follow, until SIGTERM;
    prints ``ready`` once connected and, at the end, what it sent as one JSON line."""
    import zmq

    port, kinds = int(argv[0]), argv[1:]
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    rng = random.Random(12)
    context = zmq.Context()
    peers: list[
        tuple[zmq.Socket[bytes], list[list[bytes]], bool]
    ] = []  # socket, its messages, whether it reads replies

    def dealer(name: bytes) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, name)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    if HELLO in kinds:
        hello = [
            bytes(f) for f in protocol.encode("hello", {"actor_index": None, "num_envs": 1, "host": "flood", "pid": 1})
        ]
        peers += [(dealer(b"flood-hello-%d" % i), [hello], True) for i in range(CONTROL_PEERS)]
    if CONTROL_GARBAGE in kinds:
        garbage = _control_garbage(rng)
        peers += [(dealer(b"flood-garbage-%d" % i), garbage, True) for i in range(CONTROL_PEERS)]
    if TRAJECTORY_GARBAGE in kinds:
        garbage = _trajectory_garbage(rng)
        for _ in range(TRAJECTORY_PEERS):
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port + 1}")
            peers.append((sock, garbage, False))
    print("ready", flush=True)
    sent = blocked = replies = i = 0
    start = time.monotonic()
    while not stopping:
        for k, (sock, messages, reads) in enumerate(peers):
            try:
                sock.send_multipart(messages[(i + k) % len(messages)], flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                blocked += 1
            while reads:
                try:
                    sock.recv_multipart(flags=zmq.NOBLOCK)
                    replies += 1
                except zmq.Again:
                    break
        i += 1
    print(
        json.dumps(
            {"sent": sent, "blocked": blocked, "replies": replies, "seconds": round(time.monotonic() - start, 2)}
        ),
        flush=True,
    )
    for sock, _, _ in peers:
        sock.close(linger=0)
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(_flooder_main(sys.argv[1:]))
