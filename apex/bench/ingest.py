"""`apex bench ingest`: how many transitions a learner absorbs into its replay.

A real learner process core (the same ingest thread, decode, checks and replay insert that
`apex learner` runs, rate limiting off) receives from sender processes that replay one
pre-encoded Ape-X batch (each frame once) as fast as the transport allows. Measured twice:
with the train loop paused (ingest alone) and with it training flat out in the same process.
The projection divides by the transitions an Ape-X paper actor produces: 139 frames/s at a
frame skip of 4, 34.75 transitions/s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from apex import config as config_module
from apex.algos.apex_dqn.learner import ApexDqnLearner
from apex.bench import batches
from apex.bench.timing import print_table
from apex.bench.transport import free_base_port, socket_options
from apex.config import StopConditions
from apex.errors import ConfigError
from apex.learner.process import LearnerProcess
from apex.transport import Session
from apex.wire import protocol

SENDERS = 2
WARMUP_S = 0.5
APE_X_ACTOR_TRANSITIONS_PER_S = 139 / 4

CASES: dict[str, tuple[list[str], Callable[[], dict[str, np.ndarray]], int]] = {
    # name: (config overrides, the batch, its transitions)
    "cartpole": (
        ["env.id=CartPole-v1", "apex_dqn.replay.capacity=1000000"],
        batches.cartpole_chunk,
        batches.CARTPOLE_TRANSITIONS,
    ),
    "atari": (
        ["env.id=ALE/Pong-v5", "apex_dqn.replay.capacity=100000", "apex_dqn.batch_size=64"],
        lambda: batches.atari()[0],
        batches.ATARI_TRANSITIONS,
    ),
}
UNLIMITED = [
    "apex_dqn.replay_ratio=1e-9",
    "apex_dqn.replay.rate_slack=1000000000000",
    "apex_dqn.replay.min_size=1000",
    "learner.metrics_interval_s=5",
]


def session_sender(
    address: str, frames: Sequence[bytes | bytearray], options: dict[int, int], session: bytes, index: int
) -> None:
    """Sends one encoded batch over and over, as actor ``index`` of ``session`` would: each
    time with the next sequence number (the learner accepts a batch once)."""
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    for option, value in options.items():
        push.setsockopt(option, value)
    push.connect(address)
    header = {k: v for k, v in protocol.header_of(frames).items() if k != "seq"}
    # The sequence number last, as a uint64 (from 2**32 up msgpack always writes 8 bytes):
    # each send patches it in place instead of encoding the batch again, so that what the
    # senders spend per message is what they spent before sessions existed.
    head = protocol.with_header(frames, {**header, "session": session, "actor_index": index, "seq": 2**32})
    packed = bytearray(head[0])
    seq, at = 2**32, protocol.PREFIX_BYTES + len(protocol.split_head(packed)[0]) - 8
    while True:
        struct.pack_into(">Q", packed, at, seq)
        push.send_multipart([packed, *head[1:]], copy=False)  # frame 0 (under 64 KiB) is copied
        seq += 1


def _open_sessions(process: LearnerProcess, count: int) -> list[bytes]:
    """Sessions as handshakes would open them (the senders do not say hello)."""
    tokens = []
    for index in range(count):
        token = os.urandom(16)
        process.endpoint.sessions.open(
            Session(
                index,
                f"bench-{index}".encode(),
                token,
                "bench",
                os.getpid(),
                process.config.actor.num_envs,
                last_seen=time.monotonic() + 1e9,
            )
        )
        tokens.append(token)
    return tokens


def _measure(
    overrides: list[str], batch: dict[str, np.ndarray], train: bool, seconds: float, port: int
) -> dict[str, Any]:
    config = config_module.load(None, overrides + UNLIMITED)
    frames = protocol.encode("batch", batches.BATCH_FIELDS, batch)
    with tempfile.TemporaryDirectory(prefix="apex-ingest-") as logdir:
        process = LearnerProcess(config, Path(logdir), "127.0.0.1", port, StopConditions())
        core = process.learner
        if not isinstance(core, ApexDqnLearner):  # the default algo: its replay and rate limiter are measured
            process.endpoint.close()
            raise TypeError(f"bench ingest measures Ape-X's learner, not {config.algo}'s")
        send_options, _ = socket_options("run")
        address = f"tcp://127.0.0.1:{process.endpoint.ports.trajectories}"
        spawn = mp.get_context("spawn")
        senders = [
            spawn.Process(target=session_sender, args=(address, frames, send_options, token, index), daemon=True)
            for index, token in enumerate(_open_sessions(process, SENDERS))
        ]
        process.ingest.start()
        for p in senders:
            p.start()
        try:
            deadline = time.monotonic() + 60
            while core.limiter.inserts < config.apex_dqn.replay.min_size + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            end_warmup = time.monotonic() + WARMUP_S
            while time.monotonic() < end_warmup:
                if train:
                    core.step()
                else:
                    time.sleep(0.01)
            inserts0, updates0, start = core.limiter.inserts, core.updates, time.monotonic()
            while (now := time.monotonic()) - start < seconds:
                if train:
                    core.step()
                else:
                    time.sleep(0.01)
            elapsed = now - start
            inserted, updates = core.limiter.inserts - inserts0, core.updates - updates0
        finally:
            for p in senders:
                p.terminate()
            for p in senders:
                p.join()
            process.ingest.stop()
            process.endpoint.close()
    return {
        "transitions_per_s": round(inserted / elapsed),
        "updates_per_s": round(updates / elapsed, 1),
        "rejected_messages": process.endpoint.rejected_messages,
    }


def run(seconds: float = 2.0) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name, (overrides, make_batch, transitions) in CASES.items():
        try:
            batch = make_batch()
            paused = _measure(overrides, batch, train=False, seconds=seconds, port=free_base_port())
            training = _measure(overrides, batch, train=True, seconds=seconds, port=free_base_port())
        except ConfigError as e:  # e.g. Atari without ale-py
            skipped[name] = str(e)
            continue
        rows.append(
            {
                "batch": name,
                "transitions_per_batch": transitions,
                "senders": SENDERS,
                "transitions_per_s": paused["transitions_per_s"],
                "training_transitions_per_s": training["transitions_per_s"],
                "training_updates_per_s": training["updates_per_s"],
                "ape_x_actors_served": round(paused["transitions_per_s"] / APE_X_ACTOR_TRANSITIONS_PER_S),
                "ape_x_actors_served_while_training": round(
                    training["transitions_per_s"] / APE_X_ACTOR_TRANSITIONS_PER_S
                ),
                "rejected_messages": paused["rejected_messages"] + training["rejected_messages"],
            }
        )
    print_table(
        f"ingest: {SENDERS} sender processes -> one learner's replay (train loop paused / running)",
        ["batch", "transitions/s paused", "transitions/s training", "updates/s", "Ape-X actors served"],
        [
            [
                r["batch"],
                r["transitions_per_s"],
                r["training_transitions_per_s"],
                r["training_updates_per_s"],
                r["ape_x_actors_served"],
            ]
            for r in rows
        ],
    )
    for name, reason in skipped.items():
        print(f"ingest {name}: skipped ({reason})")
    return {
        "baseline": "the same learner with its train loop running (training_*)",
        "results": rows,
        "skipped": skipped,
    }
