"""Where a process sits in a data-parallel learner group, from the command line or torchrun's
variables. Apart from the group itself (``apex.training.distributed``), so that the command
line checks it, and says what is wrong, before torch is imported."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from apex.errors import ApexError


@dataclass(frozen=True)
class Rank:
    """Where this process sits in a data-parallel learner group."""

    rank: int
    world_size: int
    master: str  # HOST:PORT of the group's TCP store (rank 0 serves it)
    by_environment: bool = False  # from RANK, WORLD_SIZE, MASTER_*: torchrun's agent may serve the store

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Rank | None:
        """The rank torchrun (or a user) set in RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
        None when RANK and WORLD_SIZE are not set."""
        if env is None:
            env = os.environ
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{int(env['MASTER_PORT'])}"
        except (KeyError, ValueError) as e:
            raise ApexError(
                f"RANK, WORLD_SIZE and MASTER_PORT must be integers set together ({e}): "
                "set all of them, or use --rank R --world-size W --master HOST:PORT"
            ) from None
        checked = cls.checked(rank, world, master)
        return cls(checked.rank, checked.world_size, checked.master, by_environment=True)

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
