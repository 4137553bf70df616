"""Data-parallel learners over ``torch.distributed``: the process group and the gradient
all-reduce that makes every rank take the same step.

Each rank trains on its own batch (Ape-X: sampled from its own replay shard; IMPALA: its own
unrolls) and, between backward and the optimizer, ``GradientAllReduce`` averages the gradients
of all ranks in one collective (every gradient flattened into one buffer with the rank's
"not finite" flag at its end). So the ranks' networks stay identical, and a step equals a
single-process step on the ranks' batches concatenated (the losses are means over equal
batches): the gradient is clipped after the average, and a step that is not finite on any
rank is skipped on every rank.

Backends: gloo on the CPU, NCCL on CUDA. The group is reached through a TCP store at
``--master HOST:PORT`` or the standard ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``
variables (so ``torchrun`` works).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from apex.errors import ApexError

# A rank that stops answering (killed, hung) is noticed within this: the others' collective
# fails and the group stops.
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Rank:
    """Where this process sits in a data-parallel learner group."""

    rank: int
    world_size: int
    master: str  # HOST:PORT of the group's TCP store (rank 0 serves it)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> Rank | None:
        """The rank torchrun (or a user) set in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
        None when RANK and WORLD_SIZE are not set."""
        env = os.environ if env is None else env
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{int(env['MASTER_PORT'])}"
        except (KeyError, ValueError) as e:
            raise ApexError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers set together ({e}): "
                            "set all of them, or use --rank R --world-size W --master HOST:PORT") from None
        return cls.checked(rank, world, master)

    @classmethod
    def checked(cls, rank: int, world_size: int, master: str) -> Rank:
        if world_size < 1:
            raise ApexError(f"--world-size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ApexError(f"--rank must be in 0..{world_size - 1} for --world-size {world_size}, got {rank}")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ApexError(f"--master must be HOST:PORT, got {master!r}")
        return cls(rank, world_size, master)


def init_group(rank: Rank, device: torch.device) -> None:
    """Joins the group (blocks until every rank has joined, or COLLECTIVE_TIMEOUT_S)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"tcp://{rank.master}", rank=rank.rank,
                                world_size=rank.world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except (RuntimeError, ValueError) as e:  # torch's DistNetworkError is a RuntimeError
        raise ApexError(f"rank {rank.rank} could not join the learner group at {rank.master}: "
                        f"{str(e).splitlines()[0]}") from None


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class GradientAllReduce:
    """``optim.guarded_step``'s ``all_reduce``: averages the gradients over the group and
    tells whether any rank's step was not finite; one collective a step."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __call__(self, parameters: list[torch.nn.Parameter], bad: torch.Tensor) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([*(g.reshape(-1).float() for g in grads), bad.reshape(1).float()])
        dist.all_reduce(flat)  # sum
        offset = 0
        for p, g in zip(parameters, grads):
            n = g.numel()
            averaged = flat[offset : offset + n].view_as(g).div_(self.world_size).to(g.dtype)
            if p.grad is None:
                p.grad = averaged
            else:
                p.grad.copy_(averaged)
            offset += n
        return flat[-1] > 0
