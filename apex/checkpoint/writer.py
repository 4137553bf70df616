"""CheckpointWriter: checkpoints written atomically, in the background if asked, pruned."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from apex.checkpoint.common import FORMAT, MANIFESTS, finite_or_none, score_of
from apex.checkpoint.manifest import shard_file_name
from apex.checkpoint.selection import best_of, best_saved_score, readable
from apex.system.files import remove_stale_temps, write_atomic

if TYPE_CHECKING:
    from apex.replay import StackedReplay

log = logging.getLogger("apex.checkpoint")


class _CrcWriter:
    """A write-only file that keeps the CRC-32 and size of what went through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self._f.write(data)


def _write_atomic(path: Path, write: Callable[[_CrcWriter], Any]) -> tuple[dict[str, int], Any]:
    """Calls ``write`` with a file at a temporary name, then fsyncs and renames it to
    ``path``; returns ({"bytes", "crc32"}, what ``write`` returned)."""

    def counted(f: BinaryIO) -> tuple[_CrcWriter, Any]:
        out = _CrcWriter(f)
        return out, write(out)

    out, result = write_atomic(path, counted)
    return {"bytes": out.size, "crc32": out.crc}, result


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter:
    """Writes checkpoints into one directory, in the background if asked, keeping the
    newest ``keep`` and the best-scoring one."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.directory)  # left by a learner killed while writing
        self._thread: threading.Thread | None = None
        self.written = 0
        self.last_seconds = 0.0  # how long the last one took to write
        self.failures = 0
        # The highest score saved in the directory (a resumed run's included): the learner
        # compares its evaluation return with it to save a checkpoint when it improves.
        self.best_score: float | None = best_saved_score(self.directory)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def save(
        self,
        name: str,
        state: dict[str, Any],
        replay: StackedReplay | None = None,
        *,
        background: bool = False,
        score: float | None = None,
        shards: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Writes checkpoint ``name`` (e.g. ``ckpt-000001000``): ``state`` (serialised now, so
        training may go on) and, if given, the replay (copied piece by piece while ingest goes
        on). ``shards``: the entries of a learner group's other ranks' replay shards, written
        by them beside it (``write_shard``). ``score`` is the run's return_mean_100 now (None
        before any evaluation episode; a non-finite one is recorded as None): pruning and
        ``find(path, "best")`` rank by it.
        Returns False, writing nothing, if a background write is still running."""
        if self.busy:
            return False
        buffer = io.BytesIO()
        import torch

        torch.save(state, buffer)
        scored = {
            "return_mean_100": finite_or_none(score),
            "eval_episodes": _eval_episodes(state),
            **({"shards": shards} if shards else {}),
        }
        args = (name, buffer, replay, state.get("config"), scored)
        if background:
            self._thread = threading.Thread(target=self._write, args=args, name="checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        return True

    def _write(
        self,
        name: str,
        state: io.BytesIO,
        replay: StackedReplay | None,
        config: dict[str, Any] | None,
        scored: dict[str, Any] | None = None,
    ) -> None:
        start = time.monotonic()
        try:
            files: dict[str, dict[str, int]] = {}
            header = None
            if replay is not None:
                files["replay"], header = _write_atomic(self.directory / f"{name}.replay", replay.save)
            files["state"], _ = _write_atomic(self.directory / f"{name}.pt", lambda f: f.write(state.getbuffer()))
            manifest = {
                "format": FORMAT,
                "name": name,
                "files": files,
                "replay_header": header,
                "config": config,
                **(scored or {}),
            }
            _write_atomic(self.directory / f"{name}.json", lambda f: f.write(json.dumps(manifest).encode()))
            _fsync_dir(self.directory)
            score = score_of(manifest)
            if score is not None and (self.best_score is None or score > self.best_score):
                self.best_score = score
            self._prune()
            self.written += 1
            self.last_seconds = time.monotonic() - start
            log.info("checkpoint %s written in %.2fs", name, self.last_seconds)
        except Exception:  # a full disk must not end a run: log, count, try again next time
            self.failures += 1
            log.exception("writing checkpoint %s failed", name)

    def _prune(self) -> None:
        manifests = sorted(self.directory.glob(MANIFESTS))
        best = best_of(readable(manifests))
        for old in manifests[: -self.keep]:
            if best is not None and old == best[0]:
                continue  # the run's best policy outlives the newest `keep`
            for suffix in (".json", ".replay", ".pt"):  # the manifest first: no manifest without its files
                old.with_suffix(suffix).unlink(missing_ok=True)
            for shard in self.directory.glob(shard_file_name(old.stem, "*")):
                shard.unlink(missing_ok=True)
        # Files of checkpoints whose manifest was never written (a learner killed while
        # writing); this writer is the only one, and its own checkpoint is complete by now.
        # A group's other ranks write their shards of a checkpoint before its manifest: only
        # shards older than the newest manifest are orphans.
        committed = sorted(m.stem for m in self.directory.glob(MANIFESTS))
        for orphan in [*self.directory.glob("ckpt-*.pt"), *self.directory.glob("ckpt-*.replay")]:
            name = orphan.name.split(".")[0]
            is_shard = orphan.name != f"{name}{orphan.suffix}"
            if name not in committed and not (is_shard and (not committed or name > committed[-1])):
                orphan.unlink(missing_ok=True)


def _eval_episodes(state: dict[str, Any]) -> int | None:
    """How many evaluation episodes the score is the mean of (at most 100): a best of one
    lucky episode is told apart from a best of a hundred."""
    stats = state.get("episode_stats")
    returns = stats.get("eval") if isinstance(stats, dict) else None
    return len(returns) if isinstance(returns, list) else None


def write_shard(directory: Path, name: str, rank: int, replay: StackedReplay) -> dict[str, Any]:
    """Writes rank ``rank``'s replay shard of checkpoint ``name`` (atomically); returns its
    manifest entry (rank, bytes, crc32, replay_header). Raises OSError if it cannot."""
    files, header = _write_atomic(Path(directory) / shard_file_name(name, rank), replay.save)
    return {"rank": rank, **files, "replay_header": header}
