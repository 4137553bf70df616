"""Learner checkpoints on disk: written atomically, found and verified on resume.

A checkpoint ``ckpt-<updates>`` is up to three files in LOGDIR/checkpoints:

- ``ckpt-N.pt``: networks, optimizer, counters and config (``torch.load`` reads it);
- ``ckpt-N.replay``: the replay's contents and priorities (Ape-X, optional);
- ``ckpt-N.json``: the manifest, written last: every file's size and CRC-32 and the
  replay's header. A checkpoint exists once its manifest does, so a learner killed
  while writing leaves nothing that looks complete.

Each file is written under a temporary name, fsync'ed and renamed. A checkpoint whose files
do not match their manifest (truncated, corrupted) is never loaded: ``find_latest`` says so,
renames its files to ``*.corrupt`` and goes on with the one before.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from apex.errors import ApexError

log = logging.getLogger(__name__)

FORMAT = 1
MANIFESTS = "ckpt-*.json"  # one per complete checkpoint
_READ_BYTES = 16 << 20


class CorruptCheckpoint(ApexError):
    """A checkpoint's files do not match its manifest."""


class _CrcWriter:
    """A write-only file that keeps the CRC-32 and size of what went through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self._f.write(data)


def _write_atomic(path: Path, write: Callable[[_CrcWriter], Any]) -> tuple[dict, Any]:
    """Calls ``write`` with a file at a temporary name, then fsyncs and renames it to
    ``path``; returns ({"bytes", "crc32"}, what ``write`` returned)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        out = _CrcWriter(f)
        result = write(out)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": out.size, "crc32": out.crc}, result


def _file_crc(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest and the paths of its files."""

    manifest_path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest_path.stem

    @property
    def config(self) -> dict:
        """The run's configuration, as saved with the checkpoint."""
        return self.manifest["config"]

    @property
    def logdir(self) -> Path:
        """The run directory the checkpoint belongs to (LOGDIR of LOGDIR/checkpoints)."""
        return self.manifest_path.parent.parent

    @property
    def state_path(self) -> Path:
        return self.manifest_path.with_suffix(".pt")

    @property
    def replay_path(self) -> Path | None:
        return self.manifest_path.with_suffix(".replay") if "replay" in self.manifest["files"] else None

    def load_state(self) -> dict:
        return torch.load(self.state_path, map_location="cpu", weights_only=False)

    def load_replay(self, replay) -> None:
        """Fills ``replay`` (new and empty, of the checkpoint's shape) from the replay file."""
        with open(self.replay_path, "rb") as f:
            replay.load(f, self.manifest["replay_header"])


class CheckpointWriter:
    """Writes checkpoints into one directory, in the background if asked, keeping the
    newest ``keep``."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.tmp"):  # left by a learner killed while writing
            stale.unlink()
        self._thread: threading.Thread | None = None
        self.written = 0
        self.last_seconds = 0.0  # how long the last one took to write
        self.failures = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def save(self, name: str, state: dict, replay=None, *, background: bool = False) -> bool:
        """Writes checkpoint ``name`` (e.g. ``ckpt-000001000``): ``state`` (serialised now, so
        training may go on) and, if given, the replay (copied piece by piece while ingest goes
        on). Returns False, writing nothing, if a background write is still running."""
        if self.busy:
            return False
        buffer = io.BytesIO()
        torch.save(state, buffer)
        args = (name, buffer, replay, state.get("config"))
        if background:
            self._thread = threading.Thread(target=self._write, args=args,
                                            name="checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        return True

    def _write(self, name: str, state: io.BytesIO, replay, config: dict | None) -> None:
        start = time.monotonic()
        try:
            files, header = {}, None
            if replay is not None:
                files["replay"], header = _write_atomic(self.directory / f"{name}.replay", replay.save)
            files["state"], _ = _write_atomic(self.directory / f"{name}.pt",
                                              lambda f: f.write(state.getbuffer()))
            manifest = {"format": FORMAT, "name": name, "files": files, "replay_header": header,
                        "config": config}
            _write_atomic(self.directory / f"{name}.json", lambda f: f.write(json.dumps(manifest).encode()))
            _fsync_dir(self.directory)
            self._prune()
            self.written += 1
            self.last_seconds = time.monotonic() - start
            log.info("checkpoint %s written in %.2fs", name, self.last_seconds)
        except Exception:  # a full disk must not end a run: log, count, try again next time
            self.failures += 1
            log.exception("writing checkpoint %s failed", name)

    def _prune(self) -> None:
        manifests = sorted(self.directory.glob(MANIFESTS))
        for old in manifests[: -self.keep]:
            for suffix in (".json", ".replay", ".pt"):  # the manifest first: no manifest without its files
                old.with_suffix(suffix).unlink(missing_ok=True)
        # Files of checkpoints whose manifest was never written (a learner killed while
        # writing); this writer is the only one, and its own checkpoint is complete by now.
        committed = {m.stem for m in self.directory.glob(MANIFESTS)}
        for orphan in [*self.directory.glob("ckpt-*.pt"), *self.directory.glob("ckpt-*.replay")]:
            if orphan.stem not in committed:
                orphan.unlink(missing_ok=True)


def has_checkpoint(logdir: Path) -> bool:
    """Whether a run directory holds a complete checkpoint (verified only when resuming)."""
    return any((Path(logdir) / "checkpoints").glob(MANIFESTS))


def checkpoint_dir(path: Path) -> Path:
    """LOGDIR/checkpoints for a run's directory; the directory itself if it holds checkpoints."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and any(path.glob(MANIFESTS)):
        return path
    raise ApexError(f"no checkpoints in {path}: pass the --logdir of a run that wrote some "
                    "(LOGDIR/checkpoints/ckpt-*.json), or start without --resume")


def verify(manifest_path: Path) -> Checkpoint:
    """The checkpoint of a manifest, after checking every file's size and CRC-32."""
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or "state" not in files or not isinstance(manifest.get("config"), dict):
            raise CorruptCheckpoint(f"{manifest_path.name} is not an apex checkpoint manifest of format {FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"cannot read {manifest_path.name}: {e}") from e
    checkpoint = Checkpoint(manifest_path, manifest)
    for kind, path in (("state", checkpoint.state_path), ("replay", checkpoint.replay_path)):
        if path is None:
            continue
        expected = files[kind]
        try:
            size, crc = _file_crc(path)
        except OSError as e:
            raise CorruptCheckpoint(f"{path.name}: {e.strerror}") from e
        if size != expected["bytes"]:
            raise CorruptCheckpoint(f"{path.name} has {size} bytes, its manifest says {expected['bytes']} (truncated?)")
        if crc != expected["crc32"]:
            raise CorruptCheckpoint(f"{path.name} fails its CRC-32 check (corrupted on disk)")
    return checkpoint


def find_latest(path: Path) -> Checkpoint:
    """The newest checkpoint under ``path`` whose files all verify. Bad ones are reported
    and renamed ``*.corrupt``, so that neither this nor a later resume tries them again."""
    directory = checkpoint_dir(path)
    for manifest_path in sorted(directory.glob(MANIFESTS), reverse=True):
        try:
            return verify(manifest_path)
        except CorruptCheckpoint as e:
            log.warning("checkpoint %s refused: %s; renamed to *.corrupt, trying the one before", manifest_path.stem, e)
            for suffix in (".replay", ".pt", ".json"):
                bad = manifest_path.with_suffix(suffix)
                if bad.exists():
                    bad.rename(bad.with_name(bad.name + ".corrupt"))
    raise ApexError(f"no valid checkpoint in {directory}: every one was truncated or corrupt "
                    "(see the messages above); start without --resume")
