"""Choosing among a run's checkpoints: newest or best first, the refused ones set aside."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from apex.checkpoint.common import MANIFESTS, ORDERS, CorruptCheckpoint, score_of
from apex.checkpoint.manifest import Checkpoint, read_manifest, verify
from apex.errors import ApexError

log = logging.getLogger("apex.checkpoint")
T = TypeVar("T")


def readable(manifests: list[Path], set_aside: bool = False) -> list[tuple[Path, dict[str, Any]]]:
    """(path, manifest) of those whose manifest is valid; the others are set aside if asked,
    else left for ``candidates`` to report and set aside when a checkpoint is chosen."""
    found = []
    for path in manifests:
        try:
            found.append((path, read_manifest(path)))
        except CorruptCheckpoint as e:
            if set_aside:
                _set_aside(path, e)
    return found


def _rank(entry: tuple[Path, dict[str, Any]]) -> tuple[bool, float, str]:
    """Best first when sorted in reverse: scored before unscored, then by score, then newest."""
    path, manifest = entry
    score = score_of(manifest)
    return score is not None, score or 0.0, path.name


def best_of(readable: list[tuple[Path, dict[str, Any]]]) -> tuple[Path, dict[str, Any]] | None:
    """The highest-scoring of (path, manifest) pairs, the newest of equals; None if none
    has a score."""
    best = max(readable, key=_rank, default=None)
    return best if best is not None and score_of(best[1]) is not None else None


def best_saved_score(directory: Path) -> float | None:
    best = best_of(readable(sorted(directory.glob(MANIFESTS))))
    return None if best is None else score_of(best[1])


def _check_order(which: str) -> None:
    if which not in ORDERS:
        raise ApexError(f"which checkpoint: {which!r} is neither 'best' (highest return_mean_100) nor 'newest'")


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
    raise ApexError(
        f"no checkpoints in {path}: pass the --logdir of a run that wrote some "
        "(LOGDIR/checkpoints/ckpt-*.json), or start without --resume"
    )


def candidates(path: Path, which: str = "newest") -> Iterator[Checkpoint]:
    """The verified checkpoints under ``path`` (a run directory or its checkpoints/), newest
    first, or with ``which="best"`` best first: highest score first (the newest of equals),
    then those without a score, newest first. Each one refused is reported in one line and
    renamed ``*.corrupt``, so that neither this nor a later resume tries it again. A caller
    that cannot load the one it got calls ``mark_corrupt`` and takes the next. ApexError if
    ``path`` has no checkpoints or ``which`` is neither "best" nor "newest"."""
    _check_order(which)
    return _verified(checkpoint_dir(path), which)


def _verified(directory: Path, which: str = "newest") -> Iterator[Checkpoint]:
    manifests = sorted(directory.glob(MANIFESTS), reverse=True)
    if which == "best":
        manifests = _best_first(manifests)
    for manifest_path in manifests:
        try:
            checkpoint = verify(manifest_path)
        except CorruptCheckpoint as e:
            _set_aside(manifest_path, e)
            continue
        yield checkpoint


def _best_first(manifests: list[Path]) -> list[Path]:
    """The manifests ordered by score, those without one last, newest first; a malformed
    manifest is set aside now, as verifying it would."""
    return [path for path, _ in sorted(readable(manifests, set_aside=True), key=_rank, reverse=True)]


def mark_corrupt(checkpoint: Checkpoint, reason: str | BaseException) -> None:
    """Reports in one line that ``checkpoint`` cannot be used, and why, and renames its
    files ``*.corrupt`` (never tried again, kept for a post-mortem)."""
    _set_aside(checkpoint.manifest_path, reason)


def _set_aside(manifest_path: Path, reason: str | BaseException) -> None:
    text = str(reason).strip()
    why = text.splitlines()[0] if text else type(reason).__name__
    log.warning("checkpoint %s refused: %s; renamed to *.corrupt, trying the one before", manifest_path.stem, why)
    for suffix in (".json", ".replay", ".pt"):  # the manifest first: no manifest without its files
        bad = manifest_path.with_suffix(suffix)
        try:
            bad.rename(bad.with_name(bad.name + ".corrupt"))
        except FileNotFoundError:
            continue
        except OSError as e:  # e.g. a read-only directory: said, and the next one tried
            log.warning("could not rename %s to *.corrupt: %s", bad.name, e.strerror)


def first_loadable(
    path: Path, load: Callable[[Checkpoint], T], first: Checkpoint | None = None, which: str = "newest"
) -> T:
    """What ``load`` returns for the newest (``which="best"``: the best, see ``candidates``)
    checkpoint under ``path`` it succeeds on (``first``, already verified, is tried before
    the others). One for which it raises CorruptCheckpoint is set aside (``mark_corrupt``)
    and the next tried; ApexError if none loads."""
    _check_order(which)

    def in_order() -> Iterator[Checkpoint]:
        if first is not None:
            yield first
        try:
            yield from candidates(path, which)
        except ApexError:  # no checkpoints left at all
            return

    for checkpoint in in_order():
        try:
            return load(checkpoint)
        except CorruptCheckpoint as e:
            mark_corrupt(checkpoint, e)
    raise ApexError(f"no checkpoint under {path} could be loaded (see the messages above); start without --resume")


def find_latest(path: Path) -> Checkpoint:
    """The newest checkpoint under ``path`` whose manifest and files all verify (see
    ``candidates``); ApexError if there is none."""
    return find(path, "newest")


def find(path: Path, which: str) -> Checkpoint:
    """The checkpoint under ``path`` to use: ``which="newest"`` the newest that verifies,
    ``which="best"`` the highest-scoring one that verifies (the newest when none has a
    score); the ones refused on the way are set aside (see ``candidates``). ApexError if
    there is none."""
    _check_order(which)
    directory = checkpoint_dir(path)  # now: the refused ones are gone from it below
    for checkpoint in _verified(directory, which):
        return checkpoint
    raise ApexError(
        f"no valid checkpoint in {directory}: every one was truncated or corrupt "
        "(see the messages above); start without --resume"
    )


class RunCheckpoints(NamedTuple):
    """A run's best checkpoint (None when none has a score yet), its score, and its newest."""

    best: Path | None
    best_score: float | None
    newest: Path | None


def best_and_newest(path: Path) -> RunCheckpoints:
    """The state files (ckpt-*.pt) of the best-scoring and of the newest checkpoint under
    ``path``, for a run's closing line. Only the manifests are read (the files are verified
    when one is loaded), nothing is set aside; all None if there is no valid manifest."""
    try:
        directory = checkpoint_dir(path)
    except ApexError:
        return RunCheckpoints(None, None, None)
    manifests = readable(sorted(directory.glob(MANIFESTS)))
    if not manifests:
        return RunCheckpoints(None, None, None)
    newest = manifests[-1][0].with_suffix(".pt")
    best = best_of(manifests)
    if best is None:
        return RunCheckpoints(None, None, newest)
    return RunCheckpoints(best[0].with_suffix(".pt"), score_of(best[1]), newest)
