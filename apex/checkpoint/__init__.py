"""Learner checkpoints on disk: written atomically, found and verified on resume.

A checkpoint ``ckpt-<updates>`` is up to three files in LOGDIR/checkpoints:

- ``ckpt-N.pt``: networks, optimizer, counters and config (``torch.load`` reads it);
- ``ckpt-N.replay``: the replay's contents and priorities (Ape-X, optional);
- ``ckpt-N.json``: the manifest, written last: every file's size and CRC-32 and the
  replay's header. A checkpoint exists once its manifest does, so a learner killed
  while writing leaves nothing that looks complete.

The manifest also records the run's evaluation return when the checkpoint was written
(``return_mean_100``, null before the first evaluation episode), so that the best policy
of a run is kept and found: pruning keeps the newest ``keep`` and the best-scoring one, and
``find(path, "best")`` / ``candidates(path, "best")`` walk the checkpoints best first.

Each file is written under a unique temporary name, fsync'ed and renamed (apex.system.files). A
checkpoint whose manifest is malformed or whose files do not match it (truncated,
corrupted) is never loaded: ``candidates`` says so, renames its files to ``*.corrupt`` and
goes on with the one before. Size and CRC-32 only catch accidents, so loading trusts the
files no further: ``torch.load(weights_only=True)`` never runs code, and what it returns is
checked to be an apex state before anyone uses it. A checkpoint that verifies but does not
load is set aside the same way with ``mark_corrupt``. Nor does a planted file make loading
hang or run out of memory: each file is opened only if it is a regular file (not a link, a
FIFO or a device; ``apex.system.files.open_regular``) of the size its manifest says, a manifest of
at most 16 MiB, and the walk over a state visits each shared list once, a million values at most.
"""

from apex.checkpoint.common import FORMAT, MANIFESTS, ORDERS, CorruptCheckpoint, IncompatibleCheckpoint
from apex.checkpoint.manifest import Checkpoint, verify
from apex.checkpoint.selection import (
    RunCheckpoints,
    best_and_newest,
    candidates,
    checkpoint_dir,
    find,
    find_latest,
    first_loadable,
    has_checkpoint,
    mark_corrupt,
)
from apex.checkpoint.state import check_state, read_state
from apex.checkpoint.writer import CheckpointWriter

__all__ = [
    "FORMAT",
    "MANIFESTS",
    "ORDERS",
    "Checkpoint",
    "CheckpointWriter",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "RunCheckpoints",
    "best_and_newest",
    "candidates",
    "check_state",
    "checkpoint_dir",
    "find",
    "find_latest",
    "first_loadable",
    "has_checkpoint",
    "mark_corrupt",
    "read_state",
    "verify",
]
