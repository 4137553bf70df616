"""What every learner process sets up and shares, rank 0 and a group's other ranks alike: the
device and threads, the seeds it hands actors, its memory figures, the loop's timings."""

from __future__ import annotations

import resource

import numpy as np
import psutil
import torch

from apex.config import Config
from apex.envs.make import EnvSpec, env_spec
from apex.errors import ApexError
from apex.system.malloc import keep_large_blocks

IDLE_WAIT_S = 0.05
STOP_LINGER_S = 0.5  # heartbeats answered with stop after the run ends, so that every actor hears it
GROUP_SYNC_S = 0.25  # how often a learner group's ranks hand rank 0 their counts (episodes for stop-return)
# An actor's seed from the run's and its index: far apart for neighbouring indices and runs
# (two primes), so that no two actors' environments share a seed sequence.
SEED_RUN_FACTOR = 1_000_003
SEED_ACTOR_FACTOR = 10_007


def actor_seed(run_seed: int, actor_index: int) -> int:
    return (run_seed * SEED_RUN_FACTOR + SEED_ACTOR_FACTOR * (actor_index + 1)) % 2**63


def all_finite(arrays: dict[str, np.ndarray]) -> bool:
    """Whether every floating-point array holds only finite values."""
    return all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    # psutil has no peak resident size on Linux; getrusage has (in KiB there).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def learner_runtime(config: Config) -> tuple[EnvSpec, torch.device]:
    """What every learner process (a group's ranks alike) sets up first: (env spec, device),
    torch's CPU threads, and malloc keeping large blocks (decoded arrays off fresh pages)."""
    spec = env_spec(config.env, config.algo)
    device = pick_device(config.learner.device)
    torch.set_num_threads(config.learner.torch_threads)
    keep_large_blocks()
    return spec, device


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ApexError(f"learner.device={name} but CUDA is not available: use learner.device=auto or cpu")
    return device
