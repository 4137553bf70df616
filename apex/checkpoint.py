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

Each file is written under a unique temporary name, fsync'ed and renamed (apex.files). A
checkpoint whose manifest is malformed or whose files do not match it (truncated,
corrupted) is never loaded: ``candidates`` says so, renames its files to ``*.corrupt`` and
goes on with the one before. Size and CRC-32 only catch accidents, so loading trusts the
files no further: ``torch.load(weights_only=True)`` never runs code, and what it returns is
checked to be an apex state before anyone uses it. A checkpoint that verifies but does not
load is set aside the same way with ``mark_corrupt``.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import reprlib
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar

from apex.errors import ApexError
from apex.files import remove_stale_temps, write_atomic

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT = 1
MANIFESTS = "ckpt-*.json"  # one per complete checkpoint
ORDERS = ("best", "newest")  # the ways of choosing among a run's checkpoints
_READ_BYTES = 16 << 20


class CorruptCheckpoint(ApexError):
    """A checkpoint's manifest is malformed, its files do not match it, or they do not hold
    what an apex checkpoint holds: set it aside and use the one before."""


class IncompatibleCheckpoint(ApexError):
    """A sound checkpoint that this run cannot use (e.g. a replay of another shape): every
    checkpoint of the run would say the same, so falling back to an older one does not help."""


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
    def counted(f: BinaryIO) -> tuple[_CrcWriter, Any]:
        out = _CrcWriter(f)
        return out, write(out)

    out, result = write_atomic(path, counted)
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


# What every apex learner state holds beside its algorithm's networks, as torch.load
# (weights_only) returns it; bool is excluded where an int is wanted.
_STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "updates": int, "env_steps": int, "time": (int, float), "episode_stats": dict, "config": dict}
_NETWORK_KEYS = {"apex_dqn": ("online", "target", "optimizer"), "impala": ("net", "optimizer")}
_DEFAULT_ALGO = "apex_dqn"  # Config.algo's default: a config written without one means it
_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def read_state(path: Path) -> Any:
    """What ``torch.load`` finds in ``path``, loaded without running any code (tensors and
    plain containers only); CorruptCheckpoint with a one-line reason if it cannot."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. a forged file's pickle protocol: the error says enough
            import torch  # here, not at import: `apex run` and the CLI start without torch

            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (untrusted bytes can fail the parser in any way, none our bug)
        raise CorruptCheckpoint(f"{Path(path).name} cannot be loaded: {_load_failure(e)}") from None


def _load_failure(error: Exception) -> str:
    text = str(error).strip()
    if text.startswith("Weights only load failed"):
        found = _WEIGHTS_ONLY_GLOBAL.search(text)
        what = f"it would call {found.group(1)}" if found else "it holds objects other than tensors and plain containers"
        return f"{what}, and a checkpoint is loaded without running code (a forged or foreign file?)"
    first = text.splitlines()[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def check_state(state: Any, source: str) -> dict:
    """``state`` if it holds what every apex learner checkpoint does (the counters, the
    episode stats, the config and its algorithm's networks and optimizer);
    CorruptCheckpoint naming the first thing missing or of the wrong type."""
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{source} holds a {type(state).__name__}, not an apex learner state (a dict)")
    for key, kind in _STATE_KEYS.items():
        if key not in state:
            raise CorruptCheckpoint(f"{source} lacks {key!r}: not an apex learner checkpoint")
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CorruptCheckpoint(f"{source}: {key!r} is a {type(value).__name__}, expected {_type_names(kind)}")
    if state["updates"] < 0 or state["env_steps"] < 0 or not 0 <= state["time"] < float("inf"):
        raise CorruptCheckpoint(f"{source}: updates, env_steps and time must be finite and >= 0, got "
                                f"{state['updates']}, {state['env_steps']}, {state['time']}")
    _check_episode_stats(state["episode_stats"], source)
    _check_optional(state, source)
    algo = state["config"].get("algo", _DEFAULT_ALGO)
    if not isinstance(algo, str) or algo not in _NETWORK_KEYS:
        raise CorruptCheckpoint(f"{source}: config.algo is {_show(algo)}, expected one of {sorted(_NETWORK_KEYS)}")
    for key in _NETWORK_KEYS[algo]:
        if not isinstance(state.get(key), dict):
            raise CorruptCheckpoint(f"{source} lacks {key!r}, which every {algo} checkpoint holds (a state_dict)")
    return state


def _check_episode_stats(stats: dict, source: str) -> None:
    """What EpisodeStats.load_state_dict reads."""
    numbers = all(isinstance(stats.get(k), list) and all(isinstance(x, (int, float)) for x in stats[k])
                  for k in ("eval", "train"))
    if not (numbers and _is_int(stats.get("episodes")) and isinstance(stats.get("best"), (int, float))):
        raise CorruptCheckpoint(f"{source}: 'episode_stats' must hold lists 'eval' and 'train' of returns, "
                                "an int 'episodes' and a number 'best'")


def _check_optional(state: dict, source: str) -> None:
    """Keys that older checkpoints may lack, checked when present (the learner reads them)."""
    hosts = state.get("env_steps_by_host", {})
    if not (isinstance(hosts, dict) and all(isinstance(k, str) and _is_int(v) for k, v in hosts.items())):
        raise CorruptCheckpoint(f"{source}: 'env_steps_by_host' must map host names to ints >= 0")
    limiter = state.get("limiter", {"inserts": 0, "samples": 0})
    if not (isinstance(limiter, dict) and _is_int(limiter.get("inserts")) and _is_int(limiter.get("samples"))):
        raise CorruptCheckpoint(f"{source}: 'limiter' must hold ints 'inserts' and 'samples' >= 0")


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


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

    @property
    def score(self) -> float | None:
        """The run's return_mean_100 when it was written (None: no evaluation episode yet,
        or a checkpoint older than scores)."""
        return _score(self.manifest)

    def load_state(self) -> dict:
        """The learner state (networks, optimizer, counters, config), loaded without running
        code; CorruptCheckpoint if it cannot be loaded or is not an apex learner state."""
        return check_state(read_state(self.state_path), self.state_path.name)

    def load_replay(self, replay) -> None:
        """Fills ``replay`` (new and empty, of the checkpoint's shape) from the replay file.
        IncompatibleCheckpoint if this run's replay has another shape; CorruptCheckpoint if
        the file does not hold what its header says. After either, ``replay`` is still empty
        (its counters are set last), so the one before may be loaded into it."""
        header = self.manifest["replay_header"]
        _check_replay_fits(header, replay, self.name)
        try:
            with open(self.replay_path, "rb") as f:
                replay.load(f, header)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CorruptCheckpoint(f"{self.replay_path.name} does not hold the replay its manifest describes "
                                    f"({_load_failure(e)})") from None


def _check_replay_fits(header: dict, replay, name: str) -> None:
    """The replay's shape checked first: another shape is the run's configuration
    changing, not a damaged file."""
    if (mismatch := replay.shape_mismatch(header)) is not None:
        raise IncompatibleCheckpoint(f"{name}: {mismatch}: resume with the configuration the checkpoint was made "
                                     "with (drop the --set that changes it)")


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
        self.best_score: float | None = _best_score(self.directory)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def save(self, name: str, state: dict, replay=None, *, background: bool = False,
             score: float | None = None) -> bool:
        """Writes checkpoint ``name`` (e.g. ``ckpt-000001000``): ``state`` (serialised now, so
        training may go on) and, if given, the replay (copied piece by piece while ingest goes
        on). ``score`` is the run's return_mean_100 now (None before any evaluation episode;
        a non-finite one is recorded as None): pruning and ``find(path, "best")`` rank by it.
        Returns False, writing nothing, if a background write is still running."""
        if self.busy:
            return False
        buffer = io.BytesIO()
        import torch

        torch.save(state, buffer)
        scored = {"return_mean_100": _finite_or_none(score), "eval_episodes": _eval_episodes(state)}
        args = (name, buffer, replay, state.get("config"), scored)
        if background:
            self._thread = threading.Thread(target=self._write, args=args,
                                            name="checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(*args)
        return True

    def _write(self, name: str, state: io.BytesIO, replay, config: dict | None, scored: dict | None = None) -> None:
        start = time.monotonic()
        try:
            files, header = {}, None
            if replay is not None:
                files["replay"], header = _write_atomic(self.directory / f"{name}.replay", replay.save)
            files["state"], _ = _write_atomic(self.directory / f"{name}.pt",
                                              lambda f: f.write(state.getbuffer()))
            manifest = {"format": FORMAT, "name": name, "files": files, "replay_header": header,
                        "config": config, **(scored or {})}
            _write_atomic(self.directory / f"{name}.json", lambda f: f.write(json.dumps(manifest).encode()))
            _fsync_dir(self.directory)
            score = _score(manifest)
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
        best = _best(_readable(manifests))
        for old in manifests[: -self.keep]:
            if best is not None and old == best[0]:
                continue  # the run's best policy outlives the newest `keep`
            for suffix in (".json", ".replay", ".pt"):  # the manifest first: no manifest without its files
                old.with_suffix(suffix).unlink(missing_ok=True)
        # Files of checkpoints whose manifest was never written (a learner killed while
        # writing); this writer is the only one, and its own checkpoint is complete by now.
        committed = {m.stem for m in self.directory.glob(MANIFESTS)}
        for orphan in [*self.directory.glob("ckpt-*.pt"), *self.directory.glob("ckpt-*.replay")]:
            if orphan.stem not in committed:
                orphan.unlink(missing_ok=True)


def _finite_or_none(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _eval_episodes(state: dict) -> int | None:
    """How many evaluation episodes the score is the mean of (at most 100): a best of one
    lucky episode is told apart from a best of a hundred."""
    stats = state.get("episode_stats")
    returns = stats.get("eval") if isinstance(stats, dict) else None
    return len(returns) if isinstance(returns, list) else None


def _score(manifest: dict) -> float | None:
    return _finite_or_none(manifest.get("return_mean_100"))


def _readable(manifests: list[Path], set_aside: bool = False) -> list[tuple[Path, dict]]:
    """(path, manifest) of those whose manifest is valid; the others are set aside if asked,
    else left for ``candidates`` to report and set aside when a checkpoint is chosen."""
    readable = []
    for path in manifests:
        try:
            readable.append((path, _read_manifest(path)))
        except CorruptCheckpoint as e:
            if set_aside:
                _set_aside(path, e)
    return readable


def _rank(entry: tuple[Path, dict]) -> tuple[bool, float, str]:
    """Best first when sorted in reverse: scored before unscored, then by score, then newest."""
    path, manifest = entry
    score = _score(manifest)
    return score is not None, score or 0.0, path.name


def _best(readable: list[tuple[Path, dict]]) -> tuple[Path, dict] | None:
    """The highest-scoring of (path, manifest) pairs, the newest of equals; None if none
    has a score."""
    best = max(readable, key=_rank, default=None)
    return best if best is not None and _score(best[1]) is not None else None


def _best_score(directory: Path) -> float | None:
    best = _best(_readable(sorted(directory.glob(MANIFESTS))))
    return None if best is None else _score(best[1])


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
    raise ApexError(f"no checkpoints in {path}: pass the --logdir of a run that wrote some "
                    "(LOGDIR/checkpoints/ckpt-*.json), or start without --resume")


def verify(manifest_path: Path) -> Checkpoint:
    """The checkpoint of a manifest, after checking the manifest's every field and every
    file's size and CRC-32; CorruptCheckpoint (one line) saying what is wrong."""
    manifest_path = Path(manifest_path)
    manifest = _read_manifest(manifest_path)
    checkpoint = Checkpoint(manifest_path, manifest)
    for kind, path in (("state", checkpoint.state_path), ("replay", checkpoint.replay_path)):
        if path is not None:
            _check_file(path, manifest["files"][kind])
    return checkpoint


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpoint(f"cannot read {path.name}: {e}") from e
    problems = _manifest_problems(manifest, path.stem)
    if problems:
        raise CorruptCheckpoint(f"{path.name} is not a valid apex checkpoint manifest of format {FORMAT}: "
                                + "; ".join(problems))
    return manifest


def _manifest_problems(manifest: Any, name: str) -> list[str]:
    """Every field the loaders rely on, checked before any is used."""
    if not isinstance(manifest, dict):
        return [f"it holds a {type(manifest).__name__}, not an object"]
    problems = []
    if manifest.get("format") != FORMAT:
        problems.append(f"format is {_show(manifest.get('format'))}")
    if manifest.get("name") != name:
        problems.append(f"name is {_show(manifest.get('name'))}, its file says {name!r}")
    if not isinstance(manifest.get("config"), dict):
        problems.append("config must be an object")
    # Optional (older manifests lack them); null before the run's first evaluation episode.
    score = manifest.get("return_mean_100")
    if score is not None and _finite_or_none(score) is None:
        problems.append(f"return_mean_100 must be a finite number or null, got {_show(score)}")
    episodes = manifest.get("eval_episodes")
    if episodes is not None and not _is_int(episodes):
        problems.append(f"eval_episodes must be an int >= 0 or null, got {_show(episodes)}")
    files = manifest.get("files")
    if not isinstance(files, dict) or "state" not in files:
        return [*problems, "files must be an object listing 'state'"]
    for kind, entry in files.items():
        problems += _file_entry_problems(kind, entry)
    if "replay" in files:
        problems += _replay_header_problems(manifest.get("replay_header"))
    return problems


def _file_entry_problems(kind: Any, entry: Any) -> list[str]:
    if kind not in ("state", "replay"):
        return [f"files lists {_show(kind)}, expected 'state' and optionally 'replay'"]
    if not (isinstance(entry, dict) and _is_int(entry.get("bytes"))
            and _is_int(entry.get("crc32")) and entry["crc32"] < 2**32):
        return [f"files.{kind} must be {{bytes: int >= 0, crc32: int in [0, 2**32)}}, got {_show(entry)}"]
    return []


def _replay_header_problems(header: Any) -> list[str]:
    """What StackedReplay.load relies on (see StackedReplay.save)."""
    if not isinstance(header, dict):
        return [f"replay_header must be an object when a replay file is listed, got {_show(header)}"]
    problems = []
    shape = header.get("frame_shape")
    if not (isinstance(shape, list) and all(_is_int(n, 1) for n in shape)):
        problems.append(f"replay_header.frame_shape must be a list of positive ints, got {_show(shape)}")
    if not isinstance(header.get("frame_dtype"), str):
        problems.append(f"replay_header.frame_dtype must be a string, got {_show(header.get('frame_dtype'))}")
    for key in ("stack", "capacity", "frame_capacity", "chunk_items"):
        if not _is_int(header.get(key), 1):
            problems.append(f"replay_header.{key} must be an int >= 1, got {_show(header.get(key))}")
    if problems:  # the ranges below are checked against these
        return problems
    problems += _range_problems(header, "frames", header["frame_capacity"], "frame_capacity")
    problems += _range_problems(header, "items", header["capacity"], "capacity")
    return problems or _chunks_problems(header)


def _range_problems(header: dict, key: str, capacity: int, capacity_key: str) -> list[str]:
    """[start, valid, end]: ids of the oldest saved, the oldest intact and one past the newest."""
    value = header.get(key)
    if not (isinstance(value, list) and len(value) == 3 and all(_is_int(n) for n in value)):
        return [f"replay_header.{key} must be [start, valid, end], ints >= 0, got {_show(value)}"]
    start, valid, end = value
    if not start <= valid <= end:
        return [f"replay_header.{key} must have start <= valid <= end, got {value}"]
    if end - start > capacity:
        return [f"replay_header.{key} spans {end - start}, more than {capacity_key} {capacity}"]
    return []


def _chunks_problems(header: dict) -> list[str]:
    """[end, first] pairs, oldest first: where each chunk's transitions end (insertion ids)
    and its first frame id. A chunk has one frame at least, so there are at most
    frame_capacity of them and their first frames strictly increase."""
    chunks = header.get("chunks")
    shape = ("replay_header.chunks must be a list of at most frame_capacity [end, first] pairs of ints >= 0, "
             "in insertion order, within items and frames")
    if not isinstance(chunks, list) or len(chunks) > header["frame_capacity"]:
        return [shape]
    items_end, frames_end = header["items"][2], header["frames"][2]
    last_end, last_first = 0, -1
    for chunk in chunks:
        if not (isinstance(chunk, list) and len(chunk) == 2 and all(_is_int(n) for n in chunk)):
            return [f"{shape}; got {_show(chunk)}"]
        end, first = chunk
        if not (last_end <= end <= items_end and last_first < first < frames_end):
            return [f"{shape}; got {chunk} after {[last_end, last_first]}"]
        last_end, last_first = end, first
    return []


def _show(value: Any) -> str:
    """A short repr: a forged manifest may hold anything, of any size."""
    return reprlib.repr(value)


def _check_file(path: Path, expected: dict) -> None:
    try:
        size, crc = _file_crc(path)
    except OSError as e:
        raise CorruptCheckpoint(f"{path.name}: {e.strerror}") from e
    if size != expected["bytes"]:
        raise CorruptCheckpoint(f"{path.name} has {size} bytes, its manifest says {expected['bytes']} (truncated?)")
    if crc != expected["crc32"]:
        raise CorruptCheckpoint(f"{path.name} fails its CRC-32 check (corrupted on disk)")


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
    return [path for path, _ in sorted(_readable(manifests, set_aside=True), key=_rank, reverse=True)]


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


def first_loadable(path: Path, load: Callable[[Checkpoint], T], first: Checkpoint | None = None,
                   which: str = "newest") -> T:
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
    raise ApexError(f"no valid checkpoint in {directory}: every one was truncated or corrupt "
                    "(see the messages above); start without --resume")


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
    readable = _readable(sorted(directory.glob(MANIFESTS)))
    if not readable:
        return RunCheckpoints(None, None, None)
    newest = readable[-1][0].with_suffix(".pt")
    best = _best(readable)
    if best is None:
        return RunCheckpoints(None, None, newest)
    return RunCheckpoints(best[0].with_suffix(".pt"), _score(best[1]), newest)
