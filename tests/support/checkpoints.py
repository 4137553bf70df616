"""What a checkpoint holds, one that runs code when loaded, and reads that must not block."""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import threading
import zlib
from pathlib import Path

import torch


def state(updates: int) -> dict:
    """What every apex checkpoint holds (see LearnerProcess.save_checkpoint), small."""
    net = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return {
        "online": net.state_dict(),
        "target": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "updates": updates,
        "env_steps": 10 * updates,
        "time": 1.5,
        "config": {"algo": "apex_dqn"},
        "episode_stats": {"eval": [], "train": [9.0], "episodes": 1, "best": -math.inf},
        "weights": torch.full((4,), float(updates)),
    }


def full_state(checkpoint: Path, updates: int) -> dict:
    """The ``checkpoint`` fixture's networks with everything else a learner checkpoint holds."""
    return {
        **torch.load(checkpoint, weights_only=True),
        "updates": updates,
        "env_steps": 100,
        "time": 1.0,
        "episode_stats": {"eval": [], "train": [], "episodes": 0, "best": -math.inf},
    }


def rewrite_state(pt: pathlib.Path, saved: dict) -> None:
    """Replaces a checkpoint's state and makes its manifest match (size and CRC-32 detect
    accidents, not attackers)."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    pt.write_bytes(buffer.getvalue())
    manifest_path = pt.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state"] = {"bytes": len(buffer.getvalue()), "crc32": zlib.crc32(buffer.getvalue())}
    manifest_path.write_text(json.dumps(manifest))


class RunsCode:
    """Pickles as a call that creates ``marker``: what a forged checkpoint would do."""

    def __init__(self, marker, how: str = "os.system") -> None:
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def within(seconds: float, call):
    """What ``call()`` returns or raises, run in a thread: AssertionError if it takes longer
    (a read that blocks on a FIFO would never return)."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
