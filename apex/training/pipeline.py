"""The learner's pipelined step: a prefetch thread samples and stages batches on the device
ahead of the main thread, which only trains; each step's results come back to the host in one
non-blocking copy that the prefetch thread reads (and writes back) steps later.

A learner core splits its update in three (``apex.LearnerCore``):

    prepare(timeout, most) -> [Staged]  prefetch thread: sample (or take unrolls), copy to the device
    train(staged) -> Pending            main thread: forward, backward, optimizer step; no host sync
    finish([Pending]) -> [metrics]      prefetch thread, steps later: priorities written back, counts

On CUDA a staged batch is copied from pinned memory on a side stream that the training
stream waits on (an event, not the host), and the results of a step (skip flag, metrics,
priorities: one packed tensor) go back to pinned host memory without blocking, so the host
enqueues step t+1 before anyone reads step t: the device never waits for the CPU to sample.
On the CPU the same code overlaps sampling with training on another core (torch and NumPy
release the GIL in their kernels) and every copy is a view.

Section timings (``SectionTimes``): sample, to device, train (forward, backward, optimizer;
on CUDA the time to enqueue it), write back (finish, waiting for the results included),
publish, and idle (the main loop waiting for a staged batch), in ms per step.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from apex.core import TrainingCore

if TYPE_CHECKING:
    from apex.core import TrainingCore

PREFETCH_WAIT_S = 0.05  # longest the prefetch thread waits for data before looking at its stop flag
# The prefetch thread waits for room on a timer of its own, asleep until the main loop is due
# to have used half of the staged batches, then looking every ROOM_POLL_S: were the main loop
# to wake it (a semaphore), each step would pay for waking a thread on another core (measured
# on this project's 2-core VM: 50-70 us a release), and each time the thread wakes it takes
# the GIL, which costs the main loop as much when it must hand the GIL over.
ROOM_POLL_S = 0.0005
SECTIONS = ("sample", "to_device", "train", "write_back", "publish", "idle")


@dataclass
class Staged:
    """A batch on the device, ready to train on once ``ready`` (a CUDA event) has passed."""

    tensors: dict[str, torch.Tensor]
    context: Any = None  # what ``finish`` needs besides the results (Ape-X: the sampled indices)
    ready: Any = None  # torch.cuda.Event on the copy stream, None on the CPU
    sample_s: float = 0.0
    copy_s: float = 0.0

    def wait(self) -> None:
        """Makes the current stream wait for the copy (on the device, not the host)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            for tensor in self.tensors.values():
                tensor.record_stream(stream)  # its memory is not reused before this stream is done with it


@dataclass
class Pending:
    """A step's results on their way to the host: ``result()`` gives them as one float64 array."""

    parts: list[torch.Tensor]  # on the CPU: the step's own tensors; on CUDA: one pinned host tensor
    done: Any = None  # torch.cuda.Event, None on the CPU
    context: Any = None

    def result(self) -> np.ndarray:
        row: np.ndarray = collect([self])[0]
        return row


class DeviceStager:
    """Host arrays onto the device: on CUDA from pinned memory on a side stream, without
    blocking the host or the training stream; on the CPU as views (no copy)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]  # unannotated in torch

    def stage(self, arrays: dict[str, np.ndarray], context: Any = None, sample_s: float = 0.0) -> Staged:
        """One batch (``stage_batches`` of one)."""
        return self.stage_batches(arrays, [context], sample_s)[0]

    def stage_batches(self, arrays: dict[str, np.ndarray], contexts: list[Any], sample_s: float = 0.0) -> list[Staged]:
        """``len(contexts)`` batches laid one after the other along each array's first
        dimension, staged together (one copy a field on CUDA) and split into views, one Staged
        each: per batch no more work than a dict of views, which the prefetch thread does with
        the GIL held."""
        start = time.perf_counter()
        count = len(contexts)
        if any(len(array) % count for array in arrays.values()):
            raise ValueError(
                f"cannot split arrays of lengths {sorted({len(a) for a in arrays.values()})} "
                f"into {count} batches of one size"
            )
        if self.stream is None:
            parts = {name: torch.from_numpy(array).tensor_split(count) for name, array in arrays.items()}
            ready = None
        else:
            with torch.cuda.stream(self.stream):
                parts = {
                    name: torch.from_numpy(array).pin_memory().to(self.device, non_blocking=True).tensor_split(count)
                    for name, array in arrays.items()
                }
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
                ready.record(self.stream)
        copy_s = (time.perf_counter() - start) / count
        return [
            Staged({name: views[k] for name, views in parts.items()}, context, ready, sample_s, copy_s)
            for k, context in enumerate(contexts)
        ]


def fetch(parts: list[torch.Tensor], context: Any = None) -> Pending:
    """Starts copying a step's results (1-d tensors) to the host: on CUDA as one tensor,
    into pinned memory without blocking; on the CPU they are there already."""
    if parts[0].device.type != "cuda":
        return Pending([part.detach() for part in parts], None, context)
    packed = torch.cat([part.detach().to(torch.float64) for part in parts])
    host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
    done.record()
    return Pending([host], done, context)


def collect(pending: list[Pending]) -> np.ndarray:
    """The results of steps of one kind (one step at least), as the rows of one float64
    array: one copy for them all, not one each."""
    for step in pending:
        if step.done is not None:
            step.done.synchronize()
    parts = [part for step in pending for part in step.parts]
    return torch.cat(parts).numpy().astype(np.float64).reshape(len(pending), -1)


@dataclass
class SectionTimes:
    """Seconds spent per section since the last ``take``, and the steps they cover."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SECTIONS, 0.0))
    steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, section: str, seconds: float) -> None:
        with self.lock:
            self.seconds[section] += seconds

    def take(self) -> dict[str, float]:
        """``time_<section>_ms``: mean milliseconds per step since the last call (none without steps)."""
        with self.lock:
            seconds, steps = self.seconds, self.steps
            self.seconds, self.steps = dict.fromkeys(SECTIONS, 0.0), 0
        if not steps:
            return {}
        return {f"time_{name}_ms": round(1e3 * s / steps, 4) for name, s in seconds.items()}


class Wakeup:
    """A pipe that the prefetch thread writes a byte to when a batch is staged while the main
    loop waits, so that the loop blocks on one ZeroMQ poller for control messages and data
    alike (instead of polling both in turn every few milliseconds)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.waiting = False  # set by the main loop around its wait; the prefetch thread writes only then

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        if self.waiting:
            try:
                os.write(self._write, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class Pipeline:
    """A learner core's update over two threads. The prefetch thread keeps up to
    ``core.prefetch_batches`` batches staged: once half of them are used it writes back the
    results of the steps trained since (``finish``, together) and samples the missing
    batches (``prepare``, together); the main loop takes staged batches, trains on them and
    hands their results back (``submit``). So the main thread does nothing but train, the
    replay's memory stays in the other core's caches, and the sampling thread's work, whose
    GIL the training thread must wait for, is paid once for several steps."""

    def __init__(
        self,
        core: TrainingCore,
        times: SectionTimes,
        on_ready: Callable[[], None] = lambda: None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``core``: a learner core (``prepare`` / ``finish``, ``prefetch_batches``);
        ``on_ready``: called when batches were staged (to wake the main loop); ``on_error``:
        told of a bug met in the thread, inside its ``except`` (the thread goes on; without
        it the thread dies)."""
        self.core = core
        self.times = times
        self.on_ready = on_ready
        self.on_error = on_error
        self.depth = max(1, int(core.prefetch_batches))
        self.refill_at = self.depth // 2  # staged batches left when the thread samples more
        self._staged: queue.SimpleQueue[Staged] = queue.SimpleQueue()
        self._pending: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._metrics: queue.SimpleQueue[dict[str, float]] = queue.SimpleQueue()
        self._last_take = time.perf_counter()
        self._period = 0.0  # between the main loop's takes (moving average): when to look again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread, then finishes what was submitted (in the calling thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._write_back()

    def take(self) -> Staged | None:
        """The next staged batch, or None if none is ready."""
        try:
            staged = self._staged.get_nowait()
        except queue.Empty:
            return None
        now = time.perf_counter()
        interval = min(now - self._last_take, PREFETCH_WAIT_S)
        self._period = interval if self._period == 0.0 else self._period + 0.1 * (interval - self._period)
        self._last_take = now
        return staged

    def staged(self) -> int:
        """Batches staged now (at least this many ``take`` calls will succeed)."""
        return self._staged.qsize()

    def submit(self, pending: Pending) -> None:
        """A trained step whose results the thread writes back."""
        self._pending.put(pending)

    def results(self) -> list[dict[str, float]]:
        """The metrics of the steps written back since the last call ({} for a skipped one)."""
        out = []
        while True:
            try:
                out.append(self._metrics.get_nowait())
            except queue.Empty:
                return out

    def _write_back(self) -> None:
        pending = []
        while True:
            try:
                pending.append(self._pending.get_nowait())
            except queue.Empty:
                break
        if pending:
            started = time.perf_counter()
            for metrics in self.core.finish(pending):
                self._metrics.put(metrics)
            self.times.add("write_back", time.perf_counter() - started)

    def _run(self) -> None:
        while not self._stop.is_set():
            staged = self._staged.qsize()
            if staged > self.refill_at:
                # Asleep until the main loop should have used enough of them, then looking
                # every ROOM_POLL_S.
                due = self._last_take + self._period * (staged - self.refill_at) - time.perf_counter()
                time.sleep(min(max(due, ROOM_POLL_S), PREFETCH_WAIT_S))
                continue
            try:
                self._write_back()
                batches = self.core.prepare(PREFETCH_WAIT_S, self.depth - staged)
            except Exception as e:
                self._failed(e)
                continue
            if batches:
                self.times.add("sample", sum(batch.sample_s for batch in batches))
                self.times.add("to_device", sum(batch.copy_s for batch in batches))
                for batch in batches:
                    self._staged.put(batch)
                self.on_ready()

    def _failed(self, error: Exception) -> None:
        """A bug met in the thread (called inside its ``except``): reported, and the thread
        goes on after a pause, so that a bug met every time does not spin."""
        if self.on_error is None:
            raise error
        self.on_error(error)
        time.sleep(PREFETCH_WAIT_S)
