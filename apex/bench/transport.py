"""`apex bench transport`: batches/s from sender processes into one receiver over ZeroMQ.

Senders are real processes that replay one pre-encoded batch as fast as the socket takes
it (encoding is `apex bench codec`'s business); the receiver decodes every batch fully into
NumPy arrays, as the learner's ingest does. The codecs are compared on the same plain
PUSH/PULL socket with ZeroMQ's defaults: apex's frames against pickles of the naive forms of
the same batch (see apex.bench.batches). A last column runs apex's frames with the settings
of a run's trajectory stream (apex.transport.TransportConfig: a high-water mark of 4
batches and 32 KB kernel buffers, which keep a throttled learner's batches fresh): the price
of that freshness, not of the codec (each batch read costs ZeroMQ a credit command to its
sender for every HWM / 2 messages read).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from apex.bench import batches
from apex.bench.timing import print_table
from apex.transport import TransportConfig
from apex.wire import protocol

SENDERS = (1, 4)
WARMUP_S = 0.5

Frames = Sequence[bytes | bytearray]  # one message's
Decode = Callable[[list[zmq.Frame]], int]  # a received message -> the transitions it holds


def sender(address: str, frames: Frames, options: dict[int, int]) -> None:
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    for option, value in options.items():
        push.setsockopt(option, value)
    push.connect(address)
    while True:
        push.send_multipart(frames, copy=False)


def socket_options(settings: str) -> tuple[dict[int, int], dict[int, int]]:
    """(sender, receiver) options: ZeroMQ's defaults, or those of a run's trajectory stream ("run")."""
    if settings != "run":
        return {}, {}
    options = TransportConfig()
    return (
        {zmq.SNDHWM: options.trajectory_hwm, zmq.SNDBUF: options.trajectory_buffer_bytes},
        {zmq.RCVHWM: options.trajectory_hwm, zmq.RCVBUF: options.trajectory_buffer_bytes},
    )


def _receive(
    address: str, settings: str, decode: Decode, senders: int, frames: Frames, seconds: float
) -> dict[str, float]:
    send_options, receive_options = socket_options(settings)
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    for option, value in receive_options.items():
        pull.setsockopt(option, value)
    pull.bind(address)
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=sender, args=(address, frames, send_options), daemon=True) for _ in range(senders)]
    for p in procs:
        p.start()
    try:
        # Wait for the first message, then a warm-up, then count.
        if not pull.poll(60_000):
            raise RuntimeError(f"no sender reached {address}")
        end_warmup = time.perf_counter() + WARMUP_S
        while time.perf_counter() < end_warmup:
            decode(pull.recv_multipart(copy=False))
        transitions = messages = wire = 0
        cpu0, start = time.process_time(), time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            received = pull.recv_multipart(copy=False)
            transitions += decode(received)
            messages += 1
            wire += sum(len(f.buffer) for f in received)
        elapsed = now - start
        cpu = time.process_time() - cpu0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
        pull.close(linger=0)
        context.term()
    return {
        "transitions_per_s": round(transitions / elapsed),
        "messages_per_s": round(messages / elapsed),
        "wire_mb_per_s": round(wire / elapsed / 1e6, 1),
        "receiver_cpu_percent": round(100 * cpu / elapsed),
    }


def _decode_apex(frames: list[zmq.Frame]) -> int:
    return len(protocol.decode(frames).arrays["priority"])


def _decode_pickle(frames: list[zmq.Frame]) -> int:
    return len(pickle.loads(frames[0].buffer))


def _decode_pickle_columns(frames: list[zmq.Frame]) -> int:
    return len(pickle.loads(frames[0].buffer)["priority"])


METHODS = ("apex", "pickle", "pickle_columns", "apex_run_settings")


def run(seconds: float = 2.0) -> dict[str, Any]:
    cartpole, cartpole_naive = batches.cartpole()
    atari, atari_naive, source = batches.atari()
    payloads: dict[str, dict[str, tuple[Frames, Decode, str]]] = {}
    for batch, (arrays, columns) in {"cartpole": (cartpole, cartpole_naive), "atari": (atari, atari_naive)}.items():
        apex_frames = protocol.encode("batch", batches.BATCH_FIELDS, arrays)
        payloads[batch] = {  # method: (frames, decode, socket settings)
            "apex": (apex_frames, _decode_apex, "defaults"),
            "pickle": ([pickle.dumps(batches.naive_transitions(columns), protocol=5)], _decode_pickle, "defaults"),
            "pickle_columns": ([pickle.dumps(columns, protocol=5)], _decode_pickle_columns, "defaults"),
            "apex_run_settings": (apex_frames, _decode_apex, "run"),
        }
    rows = []
    with tempfile.TemporaryDirectory(prefix="apex-bench-") as tmp:
        for transport in ("tcp", "ipc"):
            for senders in SENDERS:
                for batch, methods in payloads.items():
                    row: dict[str, Any] = {"transport": transport, "senders": senders, "batch": batch}
                    for method, (frames, decode, settings) in methods.items():
                        address = (
                            f"tcp://127.0.0.1:{free_port()}"
                            if transport == "tcp"
                            else f"ipc://{os.path.join(tmp, f'{batch}-{method}-{senders}')}"
                        )
                        figures = _receive(address, settings, decode, senders, frames, seconds)
                        prefix = "" if method == "apex" else method + "_"
                        row.update({prefix + k: v for k, v in figures.items()})
                    row["speedup_vs_pickle"] = round(row["transitions_per_s"] / row["pickle_transitions_per_s"], 2)
                    row["speedup_vs_pickle_columns"] = round(
                        row["transitions_per_s"] / row["pickle_columns_transitions_per_s"], 2
                    )
                    rows.append(row)
    print_table(
        f"transport: senders -> 1 receiver, every batch decoded; transitions/s (Atari: {source})",
        [
            "transport",
            "senders",
            "batch",
            "apex",
            "pickle",
            "speedup",
            "pickle columns",
            "speedup",
            "apex MB/s",
            "apex, run's HWM",
        ],
        [
            [
                r["transport"],
                r["senders"],
                r["batch"],
                r["transitions_per_s"],
                r["pickle_transitions_per_s"],
                r["speedup_vs_pickle"],
                r["pickle_columns_transitions_per_s"],
                r["speedup_vs_pickle_columns"],
                r["wire_mb_per_s"],
                r["apex_run_settings_transitions_per_s"],
            ]
            for r in rows
        ],
    )
    return {
        "baseline": "pickle of the batch as a list of transitions with full frame stacks (pickle_*), "
        "and as a dict of stacked arrays (pickle_columns_*), over the same plain PUSH/PULL socket with ZeroMQ's "
        "defaults as apex; apex_run_settings_*: apex with a run's trajectory socket settings",
        "atari_frames": source,
        "results": rows,
    }


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start theirs higher still


# Where the next search starts: each call hands out ports past the last one's, so two ranges taken
# in a row (a learner's and a front end's) never overlap although neither is bound yet.
_next_port: int | None = None


def free_base_port(span: int = 3) -> int:
    """A port P with P .. P+span-1 free on 127.0.0.1 (a learner binds P, P+1, P+2; its ranks the
    next ones). Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to 0)
    is free when checked, but any outgoing connection (an actor's, another process's) may take it
    again before the learner binds, which CI saw as "Address already in use"."""
    global _next_port
    low, high = 10000, _ephemeral_low() - span
    if high <= low:
        low, high = 1024, 65535 - span
    if _next_port is None or not low <= _next_port <= high:
        _next_port = random.SystemRandom().randint(low, high)  # not the seeded global generator
    for _ in range(200):
        base = _next_port
        _next_port = base + span if base + span <= high else low
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + span):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {span} consecutive free ports found on 127.0.0.1 in {low}-{high + span - 1}")


def free_port() -> int:
    return free_base_port(span=1)
