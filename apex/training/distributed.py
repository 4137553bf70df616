"""Data-parallel learners over ``torch.distributed``: the process group, what its ranks agree
on every loop (``LearnerGroup``: steps, stop, sync, checkpoint; counts and sessions as msgpack
bytes) and the gradient all-reduce that makes every rank take the same step.

Each rank trains on its own batch (Ape-X: sampled from its own replay shard; IMPALA: its own
unrolls) and, between backward and the optimizer, ``GradientAllReduce`` averages the gradients
of the ranks that had a batch in one collective (every gradient flattened into one buffer with
the rank's "not finite" flag and "had a batch" count at its end). The group never waits for a
rank's data: each loop's agreement takes the most batches any rank has staged, and a rank with
fewer takes the rest of the steps without a batch (``train_without_batch``: no gradient of its
own, the group's applied). So the ranks' networks stay identical, and a step equals a
single-process step on the batches of the ranks that had one, concatenated (the losses are
means over equal batches): the gradient is clipped after the average, and a step that is not
finite on any rank is skipped on every rank.

Backends: gloo on the CPU, NCCL on CUDA. The group meets at a store at ``--master HOST:PORT``
that rank 0 serves on that address alone (127.0.0.1 for ``--ranks N``) and that only the
run's ranks can use (``apex.training.rendezvous``), or through the standard
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` variables (so ``torchrun`` works; its
agent serves its own store, where torchrun binds it).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist

from apex.errors import ApexError
from apex.training import optim
from apex.training.rank import Rank
from apex.training.rendezvous import RunStore, StoreServer

if TYPE_CHECKING:
    from apex.core import TrainingCore
    from apex.training.pipeline import Pipeline

# A rank that stops answering (killed, hung) is noticed within this: the others' collective
# fails and the group stops.
COLLECTIVE_TIMEOUT_S = 60.0
# The context of a step's results (``Pending``) when the rank had no batch for it: finished as
# a step, with no priorities to write back and no metrics of its own.
NO_BATCH = "no batch"


_store: tuple[StoreServer | None, RunStore] | None = None  # this process's, until it leaves


def init_group(rank: Rank, device: torch.device, secret: Callable[[], bytes]) -> None:
    """Joins the group (blocks until every rank has joined, or COLLECTIVE_TIMEOUT_S); the
    store admits the key pair the run's secret derives alone (``apex.training.rendezvous``).
    ``secret`` gives it, and is asked again while the store does not answer (a rank may have
    read the last run's secret before rank 0 wrote this one's)."""
    global _store
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        if rank.by_environment:  # torchrun's agent serves the store on MASTER_PORT already
            dist.init_process_group(
                backend, init_method="env://", rank=rank.rank, world_size=rank.world_size, timeout=timeout
            )
            return
        host, _, port = rank.master.rpartition(":")
        host = _address_of(host.strip("[]"))
        first = secret()
        server = StoreServer(host, int(port), first) if rank.is_leader else None
        try:
            store = RunStore(host, int(port), first, timeout, None if rank.is_leader else secret)
            _store = (server, store)
            dist.init_process_group(backend, store=store, rank=rank.rank, world_size=rank.world_size, timeout=timeout)
        except BaseException:
            _close_store()
            if server is not None:
                server.close()
            raise
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError is a RuntimeError
        raise ApexError(
            f"rank {rank.rank} could not join the learner group at {rank.master}: {str(e).splitlines()[0]}"
        ) from None


def store_refusals() -> int | None:
    """Rank 0's count of the group store's refusals (strangers and refused requests); None
    on other ranks and in groups whose store is torchrun's."""
    server = _store[0] if _store is not None else None
    return server.refusals if server is not None else None


def _address_of(host: str) -> str:
    """--master's host as an address (a node's name resolved): where rank 0 listens alone."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as e:
        raise ApexError(f"rank 0 cannot listen on --master {host}: {e.strerror or e}") from None


def _close_store() -> None:
    global _store
    if _store is not None:
        server, store = _store
        store.close()
        if server is not None:
            server.close()
        _store = None


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _close_store()


class GradientAllReduce:
    """``optim.guarded_step``'s ``all_reduce``: averages the gradients over the ranks that
    had a batch for this step and tells whether any rank's step was not finite; one
    collective a step. A rank without a batch (``has_batch=False``) adds no gradient and is
    not counted, and takes the average of the others like every rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __call__(self, parameters: list[torch.nn.Parameter], bad: torch.Tensor, has_batch: bool = True) -> torch.Tensor:
        grads = [p.grad if p.grad is not None and has_batch else torch.zeros_like(p) for p in parameters]
        counted = bad.new_ones(1, dtype=torch.float32) if has_batch else bad.new_zeros(1, dtype=torch.float32)
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), bad.reshape(1).float(), counted])
        try:
            dist.all_reduce(flat)  # sum
        except RuntimeError as e:
            raise GroupBroken(
                f"the learner group broke during a step (a rank stopped, died or cannot be reached: {_first_words(e)})"
            ) from None
        with_batch = flat[-1:].clamp(min=1.0)  # every step has one rank with a batch at least (LearnerGroup.agree)
        offset = 0
        for p, g in zip(parameters, grads):
            n = g.numel()
            averaged = flat[offset : offset + n].view_as(g).div_(with_batch).to(g.dtype)
            if p.grad is None:
                p.grad = averaged
            else:
                p.grad.copy_(averaged)
            offset += n
        return flat[-2] > 0


def step_without_batch(
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.nn.Parameter],
    grad_clip: float,
    figures: int,
    all_reduce: GradientAllReduce,
) -> torch.Tensor:
    """``optim.guarded_step`` on a rank that has no batch for this step: a loss with no
    gradient (nothing of this rank's goes into the average) and ``figures`` zeros; the
    group's averaged gradient is applied as on every rank, so the networks stay the same."""
    parameters = list(parameters)
    zero = torch.zeros((), device=parameters[0].device, requires_grad=True)
    return optim.guarded_step(
        optimizer,
        zero,
        parameters,
        grad_clip,
        [zero.detach()] * figures,
        lambda params, bad: all_reduce(params, bad, has_batch=False),
    )


def train_steps(pipeline: Pipeline, core: TrainingCore, steps: int) -> int:
    """A group's ``steps`` agreed steps on this rank: on its staged batches while it has
    them, then without (``core.train_without_batch``); returns how many had no batch."""
    without = 0
    for _ in range(steps):
        staged = pipeline.take()
        if staged is None:
            without += 1
            pipeline.submit(core.train_without_batch())
        else:
            pipeline.submit(core.train(staged))  # written back by the prefetch thread
    return without


class GroupBroken(ApexError):
    """A collective failed: a rank stopped, died or could not be reached."""


def _first_words(error: BaseException) -> str:
    """The gist of a gloo/NCCL error: its first line, without the source location prefix and
    the advice that follows the first sentence."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


@dataclass(frozen=True)
class Agreement:
    """What every rank does next, agreed in one collective (``LearnerGroup.agree``)."""

    steps: int  # steps every rank takes now: the most batches any rank has staged
    stop: bool
    checkpoint: bool
    sync: bool  # exchange counts and sessions (``LearnerGroup.gather`` / ``broadcast``)
    # Several policies: each one's steps, in the order of the counts agreed on (``steps`` their sum).
    by_policy: tuple[int, ...] = ()


class LearnerGroup:
    """The ranks of one data-parallel learner and what they share besides gradients: the
    per-loop agreement (steps, stop, checkpoint, sync), byte messages gathered on every rank
    or broadcast from rank 0 (msgpack, never pickle), the session secret and the ranks'
    trajectory addresses. Control collectives run over gloo, whatever the gradients' backend."""

    def __init__(
        self,
        rank: Rank,
        device: torch.device,
        address: tuple[str | None, int],
        config_digest: str,
        secret: Callable[[], bytes],
    ) -> None:
        """Joins the group (blocking until every rank is there) and checks that every rank
        runs the same configuration; ``address``: (host or None, port) where actors reach this
        rank's trajectory stream (None: the host they reached rank 0 at); ``secret``: the
        run's (``init_group``)."""
        self.rank = rank
        init_group(rank, device, secret)
        try:
            self._control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
            digests = self.gather(config_digest.encode())
            if any(d != digests[0] for d in digests):
                odd = [r for r, d in enumerate(digests) if d != digests[0]]
                raise ApexError(
                    f"ranks {odd} run another configuration than rank 0: start every rank with the same "
                    "--config and --set"
                )
            self.secret = self.broadcast(os.urandom(32) if rank.is_leader else None)
            self.addresses = [tuple(msgpack.unpackb(a)) for a in self.gather(msgpack.packb(list(address)))]
        except BaseException:
            leave_group()
            raise

    @property
    def world_size(self) -> int:
        return self.rank.world_size

    def agree(
        self, staged: int | Sequence[int], *, stop: bool = False, checkpoint: bool = False, sync: bool = False
    ) -> Agreement:
        """One collective: the most batches staged on any rank (a rank with none, e.g. whose
        actors are silent, does not hold the others back: it steps without), and whether any
        rank asks to stop, checkpoint or sync. ``staged`` as a sequence: each policy's batches
        (every rank gives the same policies in the same order), agreed policy by policy."""
        counts = [staged] if isinstance(staged, int) else list(staged)
        flags = torch.tensor([*counts, int(stop), int(checkpoint), int(sync)], dtype=torch.int64)
        self._collective(dist.all_reduce, flags, op=dist.ReduceOp.MAX)
        *steps, stop_flag, checkpoint_flag, sync_flag = flags.tolist()
        by_policy = () if isinstance(staged, int) else tuple(steps)
        return Agreement(sum(steps), stop_flag > 0, checkpoint_flag > 0, sync_flag > 0, by_policy)

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, on every rank, in rank order."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._collective(dist.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else padded[:0]
        parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._collective(dist.all_gather, parts, padded)
        return [bytes(p[: int(s)].numpy()) for p, s in zip(parts, sizes)]

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._collective(dist.broadcast, size, src=0)
        buffer = torch.zeros(int(size), dtype=torch.uint8)
        if data is not None and data:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._collective(dist.broadcast, buffer, src=0)
        return bytes(buffer.numpy())

    def barrier(self) -> None:
        self._collective(dist.barrier)

    def _collective(self, operation: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            operation(*args, **kwargs, **({"group": self._control} if self._control is not None else {}))
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise GroupBroken(
                f"rank {self.rank.rank}: the learner group broke (a rank stopped, died or cannot "
                f"be reached: {_first_words(e)})"
            ) from None

    def close(self) -> None:
        leave_group()
